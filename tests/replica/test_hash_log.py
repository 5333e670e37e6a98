"""HashLog against an OrderedDict kept the way BlockManager kept its recency order."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

import replica.hash_log
from replica.hash_log import HashLog


def logged(log: HashLog) -> list[int]:
    return [h for chunk in log.newest_first() for h in chunk.tolist()]


@pytest.mark.parametrize("slack", [0, 5, 4096])
@pytest.mark.parametrize("chunk", [3, 4096])
def test_newest_first_follows_touches_and_evictions(monkeypatch, slack, chunk):
    monkeypatch.setattr(replica.hash_log, "_CHUNK", chunk)
    rng = random.Random(slack * 7 + chunk)
    num_blocks = 40
    log = HashLog(num_blocks, slack=slack)
    order: OrderedDict[int, int] = OrderedDict()  # block -> hash, most recently used last
    for i in range(2000):
        block = rng.randrange(num_blocks)
        if block in order and rng.random() < 0.3:
            del order[block]  # evicted
            log.forget(block)
        elif block in order:
            order.move_to_end(block)  # reused: the same hash
            log.touch([block], [order[block]])
        else:  # registered with a new hash, full 64-bit range
            h = rng.getrandbits(64)
            order[block] = h
            log.touch([block], [h])
        if block in order:  # compacted as it goes (an eviction leaves it to the next touch)
            assert len(log.blocks) <= 2 * log.num_current + slack
        if i % 97 == 0 or i > 1990:
            assert logged(log) == list(reversed(order.values()))
            assert log.num_current == len(order)


def test_forgetting_a_block_without_a_hash_changes_nothing():
    log = HashLog(4)
    log.touch([1], [11])
    log.forget(2)
    log.forget(1)
    log.forget(1)
    assert log.num_current == 0 and logged(log) == []
    log.touch([1], [12])  # the block is reused for another hash: only the new one is current
    assert logged(log) == [12]


def test_a_reader_that_stops_early_leaves_the_log_appendable():
    log = HashLog(8, slack=0)
    log.touch(list(range(8)), [100 + b for b in range(8)])
    first = next(iter(log.newest_first()))  # the newest chunk, then the reader stops
    assert first.tolist()[0] == 107
    for b in range(8):  # appends (and compactions) with no buffer still exported
        log.touch([b], [100 + b])
    assert logged(log) == [107 - b for b in range(8)]
