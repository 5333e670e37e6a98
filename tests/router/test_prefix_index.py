"""PrefixIndex postings and the Fleet's slots stay exact under updates, removals and moves."""

from __future__ import annotations

import random

import numpy as np
import pytest

from replica.hashing import prefix_block_hashes
from router import PrefixPolicy, RouteRequest
from router.fleet import Fleet
from router.prefix_index import PrefixIndex, mask_slots, slot_mask
from tests.router.router_fakes import make_stats


def check_index(index: PrefixIndex) -> None:
    expected: dict[int, int] = {}
    for slot, hashes in index.held.items():
        assert hashes, slot  # an empty summary is not kept
        for h in set(hashes):
            expected[h] = expected.get(h, 0) | (1 << slot)
    assert {h: index.holders(h) for h in index.postings} == expected
    for h, posting in index.postings.items():
        if posting >= 0:  # the bitmask form is kept for two holders or more
            assert posting & (posting - 1), h


@pytest.mark.parametrize("seed", range(20))
def test_postings_follow_updates_removals_and_moves(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    for _ in range(300):
        op = rng.random()
        slot = rng.randrange(12)
        if op < 0.6:
            index.update(slot, tuple(rng.sample(range(50), rng.randrange(0, 12))))
        elif op < 0.8:
            index.remove(slot)
        else:
            free = [s for s in range(12) if s not in index.held]
            if free:
                index.move(slot, rng.choice(free))
        check_index(index)


def test_deepest_levels_take_the_deepest_held_block() -> None:
    index = PrefixIndex()
    index.update(0, (1, 2, 3))
    index.update(1, (1, 3))  # block 2 left out of its summary: still 3
    index.update(2, (2,))  # no first block published: 2
    index.update(3, (9,))  # nothing of this prompt
    every = slot_mask(np.ones(4, dtype=bool))
    assert dict(index.deepest_levels([1, 2, 3], every)) == {3: 0b0011, 2: 0b0100}
    only_some = slot_mask(np.array([False, True, True, True]))
    assert dict(index.deepest_levels([1, 2, 3], only_some)) == {3: 0b0010, 2: 0b0100}
    assert index.deepest_levels([], every) == []
    assert index.deepest_levels([7, 8], every) == []


def test_match_levels_count_contiguous_blocks_from_the_first() -> None:
    index = PrefixIndex()
    index.update(0, (1, 2, 3))
    index.update(1, (1, 3))  # lost block 2: matches 1 only
    index.update(2, (2, 3))  # no first block: matches nothing
    index.update(3, (1, 2, 3, 4))
    levels = dict(index.match_levels([1, 2, 3], slot_mask(np.ones(4, dtype=bool))))
    assert levels == {1: 0b0010, 3: 0b1001}
    only_some = slot_mask(np.array([False, True, False, True]))
    assert dict(index.match_levels([1, 2, 3], only_some)) == {1: 0b0010, 3: 0b1000}
    assert index.match_levels([], only_some) == []
    assert index.match_levels([9], only_some) == []


def test_masks_round_trip_through_slot_arrays() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 100, 1000):
        slots = rng.random(n) < 0.3
        assert (mask_slots(slot_mask(slots), n) == slots).all()


@pytest.mark.parametrize("seed", range(10))
def test_fleet_slots_and_prefix_index_survive_forget(seed: int) -> None:
    rng = random.Random(seed)
    tokens = list(range(64))
    chain = tuple(prefix_block_hashes(tokens, 16))
    fleet = Fleet(with_prefix_index=True)
    live: dict[str, int] = {}
    for step in range(200):
        replica_id = f"r{rng.randrange(10)}"
        if rng.random() < 0.3:
            fleet.forget(replica_id)
            live.pop(replica_id, None)
        else:
            depth = rng.randrange(0, 5)
            used = rng.randrange(0, 50)
            fleet.observe(
                make_stats(replica_id, num_blocks_used=used, cached_prefix_hashes=chain[:depth])
            )
            live[replica_id] = used
        assert sorted(fleet.ids) == sorted(live)
        assert all(fleet.ids[slot] == r for r, slot in fleet.slot_of.items())
        for slot, replica_id in enumerate(fleet.ids):
            assert fleet.stats[slot].replica_id == replica_id
            used_column = fleet.column("total")[slot] - fleet.column("free")[slot]
            assert used_column == live[replica_id], step
            assert fleet.prefix is not None
            assert fleet.prefix.held.get(slot, ()) == fleet.stats[slot].cached_prefix_hashes
        check_index(fleet.prefix)


def test_prefix_policy_matches_requests_known_only_by_block_hashes() -> None:
    tokens = list(range(64))
    hashes = prefix_block_hashes(tokens, 16)
    stats = [
        make_stats("one", cached_prefix_hashes=tuple(hashes[:1])),
        make_stats("three", num_blocks_used=5, cached_prefix_hashes=tuple(hashes[:3])),
    ]
    policy = PrefixPolicy(balance_abs_threshold=0.1, balance_rel_threshold=1.5)
    by_hashes = RouteRequest.with_block_hashes("r", 64, 16, hashes)
    by_tokens = RouteRequest.from_tokens("r", tokens)
    assert policy.choose_replicas(stats, by_hashes, 0.0) == [["three"], ["one"]]
    assert policy.choose_replicas(stats, by_tokens, 0.0) == [["three"], ["one"]]
    with pytest.raises(ValueError, match="block_hashes"):
        RouteRequest.with_block_hashes("r", 64, 16, hashes[:2])
