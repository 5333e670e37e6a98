from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.block_manager import BlockManager
from replica.config import CacheConfig
from replica.hashing import SUMMARY_STRIDE, prefix_block_hashes
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence
from tests.replica.test_hashing import thinned

PARAMS = SamplingParams(max_tokens=8)


def make_manager(num_blocks=16, block_size=4, max_num_seqs=8, prefix=True) -> BlockManager:
    config = CacheConfig(block_size, num_blocks, prefix, max_blocks_per_seq=32)
    return BlockManager(config, max_num_seqs)


def make_seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), PARAMS)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model ran every token of seq, as the engine's postprocess does."""
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def test_allocate_free_returns_every_block():
    bm = make_manager()
    seq = make_seq(range(10))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_ids) == 3 and seq.slot >= 0
    bm.check_invariants([seq])
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16 and seq.slot == -1


def test_prefix_hit_reuses_computed_full_blocks_only():
    bm = make_manager()
    a = make_seq(range(10), "a")
    bm.allocate(a)
    early = make_seq(list(range(8)) + [99, 98], "early")
    bm.allocate(early)
    assert early.num_cached_tokens == 0  # a's blocks are not computed yet: no hit
    bm.free(early)
    compute_all(bm, a)
    b = make_seq(list(range(8)) + [99, 98], "b")
    bm.allocate(b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert b.num_cached_tokens == 8 == b.num_computed_tokens
    assert bm.ref_counts[a.block_ids[0]] == 2
    bm.check_invariants([a, b])


def test_decode_blocks_hash_as_the_whole_sequence_does_one_at_a_time_or_several():
    """full_block_hashes' one-generated-block path (a decode block that filled) gives the
    chained hashes prefix_block_hashes gives over the whole sequence, as the general path
    does."""
    bm = make_manager(num_blocks=32)
    seqs = {n: make_seq(range(100 + n, 106 + n), f"s{n}") for n in (1, 3)}  # 6-token prompts
    for seq in seqs.values():
        bm.allocate(seq)
        compute_all(bm, seq)
    for step in range(13):  # generated tokens, committed every step or every third
        for every, seq in seqs.items():
            seq.token_ids.append(50 + step)
            seq.num_computed_tokens += 1
            bm.append_slots(bm.needing_blocks([seq]))
            if step % every == 0:
                bm.commit(seq)
    for seq in seqs.values():
        bm.commit(seq)
        assert seq.num_committed_blocks == len(seq) // 4 == 4
        assert seq.block_hashes == prefix_block_hashes(seq.token_ids, 4)
        assert [bm.block_hash[b] for b in seq.block_ids[:4]] == seq.block_hashes
    bm.check_invariants(list(seqs.values()))


def test_prefix_cache_counters_count_admitted_and_cached_tokens():
    bm = make_manager()
    a = make_seq(range(10), "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(list(range(8)) + [99], "b")
    bm.allocate(b)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (19, 8)
    off = make_manager(prefix=False)
    for rid in "cd":
        seq = make_seq(range(10), rid)
        off.allocate(seq)
        compute_all(off, seq)
    assert (off.prefix_query_tokens, off.prefix_hit_tokens) == (20, 0)


def test_summary_of_a_full_cache_thins_the_older_blocks():
    bm = make_manager(num_blocks=64)
    seqs = [make_seq([1000 * c + t for t in range(32)], f"c{c}") for c in range(7)]
    for seq in seqs:  # seven chains of 8 blocks, the last one newest
        bm.allocate(seq)
        compute_all(bm, seq)
    newest_first = [
        h for seq in reversed(seqs) for h in reversed(prefix_block_hashes(seq.token_ids, 4))
    ]
    assert bm.recent_hashes(64) == newest_first  # the whole cache fits: all of it
    summary = bm.recent_hashes(16)
    assert summary[:8] == newest_first[:8] and len(summary) <= 16
    older = newest_first[8:]
    assert summary[8:] == [h for h in older if h % SUMMARY_STRIDE == 0][: 16 - 8]


def test_summary_follows_reuse_and_eviction():
    """Hits move a chain to the newest end and evictions drop the oldest blocks; the
    summary is always the rule applied to the cache as it is (recency kept here apart,
    in an OrderedDict: a chain used again is newest, block after block)."""
    bm = make_manager(num_blocks=96, max_num_seqs=4)
    chains = [[1000 * c + t for t in range(33)] for c in range(40)]  # 8 full blocks each
    recency: OrderedDict[int, None] = OrderedDict()  # most recently used last
    for step, c in enumerate([*range(12), 3, 0, 7, *range(12, 40), 20, 5]):
        seq = make_seq(chains[c], f"s{step}")
        bm.allocate(seq)  # a chain seen before is a hit: its blocks become the newest
        compute_all(bm, seq)
        bm.free(seq)
        bm.check_invariants([])
        for h in prefix_block_hashes(chains[c], 4):
            recency.pop(h, None)
            recency[h] = None
        for h in [h for h in recency if h not in bm.hash_to_block]:  # evicted
            del recency[h]
        assert recency.keys() == bm.hash_to_block.keys()
        newest_first = list(reversed(recency))
        for limit in (1, 16, 40, 64, 200):
            assert bm.recent_hashes(limit) == thinned(newest_first, limit)
    assert len(bm.hash_to_block) < 40 * 8  # evictions happened


def test_whole_prompt_hit_still_leaves_the_last_token_to_compute():
    bm = make_manager()
    a = make_seq(range(8), "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(range(8), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the second block is recomputed, privately
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    bm.check_invariants([a, b])


def test_freed_hashed_blocks_stay_cached_and_are_evicted_lru():
    bm = make_manager(num_blocks=4)
    a = make_seq(range(8), "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and len(bm.free_blocks) == 2
    b = make_seq(range(8), "b")
    bm.allocate(b)  # hits block 0, needs one fresh block
    assert b.num_cached_tokens == 4
    bm.free(b)
    c = make_seq(range(100, 116), "c")  # needs all 4 blocks: evicts every cached one
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert bm.num_cached_blocks == 0 and not bm.hash_to_block
    bm.check_invariants([c])


def test_eviction_order_keeps_the_shared_prefix_longest():
    bm = make_manager(num_blocks=3)
    a = make_seq(range(12), "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    other = make_seq([500], "other")
    bm.allocate(other)  # no free block left: evicts the LRU cached block, a's tail
    hashes = prefix_block_hashes(list(range(12)), 4)
    assert hashes[0] in bm.hash_to_block and hashes[1] in bm.hash_to_block
    assert hashes[2] not in bm.hash_to_block
    bm.check_invariants([other])


def test_batched_rollover_allocates_in_one_pass_and_marks_rows_dirty():
    bm = make_manager()
    seqs = [make_seq(range(i * 10, i * 10 + 4), f"s{i}") for i in range(3)]
    for s in seqs:
        bm.allocate(s)
        compute_all(bm, s)
        s.token_ids.append(7)  # a sampled token at position 4: a block boundary
    bm.take_dirty_slots()
    assert len(bm.needing_blocks(seqs)) == 3
    bm.append_slots(seqs)
    assert all(len(s.block_ids) == 2 for s in seqs)
    assert bm.take_dirty_slots() == sorted(s.slot for s in seqs)
    bm.check_invariants(seqs)


def test_needing_blocks_names_the_rollovers_and_copies_only():
    """A decode batch where one sequence rolls over, one writes into a block it shares
    with a fork, and one has room: append_slots over needing_blocks' list leaves the
    third as it was, as append_slots over all three would."""
    bm = make_manager()
    roll, room, parent = (
        make_seq(range(i * 10, i * 10 + n), f"s{i}") for i, n in enumerate([4, 5, 6])
    )
    for s in (roll, room, parent):
        bm.allocate(s)
        compute_all(bm, s)
    child = make_seq(range(20, 26), "c")
    bm.fork(parent, child)
    for s in (roll, room, child):
        s.token_ids.append(7)  # positions 4 (a boundary), 5 (room), 6 (the shared block)
    assert bm.needing_blocks([roll, room, child]) == [roll, child]
    room_blocks = list(room.block_ids)
    bm.append_slots(bm.needing_blocks([roll, room, child]))
    assert len(roll.block_ids) == 2 and room.block_ids == room_blocks
    assert child.block_ids[1] != parent.block_ids[1] and len(bm.take_copies()) == 1
    assert bm.needing_blocks([roll, room, child]) == []
    bm.check_invariants([roll, room, parent, child])


def test_fork_then_append_copies_on_write():
    bm = make_manager()
    parent = make_seq(range(6), "p")
    bm.allocate(parent)
    compute_all(bm, parent)
    child = make_seq(range(6), "c")
    bm.fork(parent, child)
    bm.check_invariants([parent, child])
    child.token_ids.append(1)  # writes position 6, inside the shared partial block
    assert len(bm.needing_blocks([child])) == 1
    bm.append_slots([child])
    [(src, dst)] = bm.take_copies()
    assert src == parent.block_ids[1] and dst == child.block_ids[1] and src != dst
    assert child.block_ids[0] == parent.block_ids[0]
    bm.check_invariants([parent, child])


def test_slots_are_exhausted_before_blocks():
    bm = make_manager(max_num_seqs=2)
    seqs = [make_seq([i], f"s{i}") for i in range(3)]
    bm.allocate(seqs[0])
    bm.allocate(seqs[1])
    assert not bm.can_allocate(seqs[2])
    bm.free(seqs[0])
    assert bm.can_allocate(seqs[2])


@pytest.mark.parametrize("prefix", [True, False])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50)), min_size=1, max_size=60))
def test_random_operations_keep_the_invariant(prefix, ops):
    bm = make_manager(num_blocks=12, block_size=4, max_num_seqs=6, prefix=prefix)
    live: list[Sequence] = []
    counter = 0
    for op, arg in ops:
        if op == 0:  # allocate a prompt drawn from a few shared prefixes
            base = [arg % 3] * (4 + arg % 5)
            seq = make_seq(base + list(range(arg % 7)), f"r{counter}")
            counter += 1
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
        elif op == 1 and live:  # compute everything, then append a decode token
            seq = live[arg % len(live)]
            compute_all(bm, seq)
            seq.token_ids.append(arg)
            if bm.can_append([seq]):
                bm.append_slots([seq])
            else:
                seq.token_ids.pop()
        elif op == 2 and live:  # free
            bm.free(live.pop(arg % len(live)))
        elif op == 3 and live and bm.free_slots:  # fork
            child = make_seq(live[arg % len(live)].token_ids, f"r{counter}")
            counter += 1
            bm.fork(live[arg % len(live)], child)
            live.append(child)
        elif op == 4 and live:  # batched append across every live sequence
            for seq in live:
                compute_all(bm, seq)
                seq.token_ids.append(arg)
            if bm.can_append(live):
                bm.append_slots(live)
            else:
                for seq in live:
                    seq.token_ids.pop()
        bm.take_copies()
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
