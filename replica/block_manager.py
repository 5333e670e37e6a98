"""Paged KV block bookkeeping: free list, refcounts, prefix cache, slots. CPU only."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

import numpy as np

from replica.config import CacheConfig
from replica.hash_log import HashLog
from replica.hashing import summarize
from replica.sequence import Sequence


class BlockManager:
    """Owns every KV block and every row ("slot") of the global block table.

    A block is in exactly one state: free (refcount 0, no hash), cached
    (refcount 0, holding the hash of a computed full block: reusable until
    evicted, LRU first) or in use (refcount >= 1). Invariant, checked by
    check_invariants: free + cached + in use == total, and each refcount equals
    the number of live sequences whose block_ids hold that block.

    Prefix caching: a full block is named by a hash chained over its parent's
    hash and its tokens. A hash is registered only once the block's KV is
    computed (commit), so a hit never reads KV that is still to be written.
    Sharing happens only at full blocks, except after fork, where a partial
    last block is shared and the first write into it copies it (copy-on-write).

    Slots: a running sequence owns one row of block_table ([max_num_seqs + 1,
    max_blocks_per_seq]; the last row is the null row that padding uses). Rows
    that changed since take_dirty_slots() was last called are reported so the
    device copy is updated only there. Allocation failures are reported by
    can_allocate / can_append, never by raising mid-operation.
    """

    def __init__(self, config: CacheConfig, max_num_seqs: int) -> None:
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.null_block = config.num_blocks  # one extra block in the device cache
        self.null_slot = max_num_seqs
        self.ref_counts = [0] * self.num_blocks
        self.block_hash: list[int | None] = [None] * self.num_blocks
        self.hash_to_block: dict[int, int] = {}
        # The hashed blocks in most-recently-used order, packed: what recent_hashes reads.
        self.hash_log = HashLog(self.num_blocks)
        self.free_blocks: deque[int] = deque(range(self.num_blocks))
        self.cached_blocks: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.block_table = np.full(
            (max_num_seqs + 1, self.max_blocks_per_seq), self.null_block, dtype=np.int32
        )
        self.dirty_slots: set[int] = set()
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for copy-on-write
        # Whether a block may be shared while it still fills (only fork shares one: the
        # prefix cache shares full blocks alone, and a decode token's block holds its new
        # position, so it is not full). Until then, no decode token needs copy-on-write.
        self.forked = False
        # Since start: tokens of every allocated sequence, and those found cached.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- capacity -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate: never used plus cached (evictable)."""
        return len(self.free_blocks) + len(self.cached_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks, leaving >= 1 token to run."""
        # Prompt logprobs need the logits at every prompt position: such a request
        # computes its whole prompt.
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits = []
        for h in seq.full_block_hashes(self.block_size):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()  # the last token must be computed to produce logits
        return hits

    def first_uncached_hash(self, seq: Sequence) -> int | None:
        """The hash of the sequence's first full block with no cached KV (None: there is
        none, or prefix caching is off)."""
        if not self.enable_prefix_caching:
            return None
        for h in seq.full_block_hashes(self.block_size):
            if h not in self.hash_to_block:
                return h
        return None

    def uncommitted_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the running sequence's full blocks whose KV is not computed yet."""
        return seq.full_block_hashes(self.block_size)[seq.num_committed_blocks :]

    def can_allocate(self, seq: Sequence) -> bool:
        if not self.free_slots:
            return False
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        fresh = self.blocks_needed(len(seq)) - len(hits)
        return fresh + revived <= self.num_free_blocks

    # ---- allocation -----------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence a slot and blocks for all its tokens, reusing cached ones."""
        assert seq.slot < 0 and not seq.block_ids, f"{seq} already holds blocks"
        hits = self._prefix_hits(seq)
        for block in hits:
            self._take_ref(block)
        if hits:
            self.hash_log.touch(hits, seq.block_hashes[: len(hits)])  # hits: its leading blocks
        seq.block_ids = hits + [
            self._fresh_block() for _ in range(self.blocks_needed(len(seq)) - len(hits))
        ]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_query_tokens += len(seq)
        self.prefix_hit_tokens += seq.num_cached_tokens
        seq.num_committed_blocks = len(hits)
        seq.slot = self.free_slots.pop()
        self._write_row(seq, 0)

    def can_append(self, seqs: Iterable[Sequence]) -> bool:
        """Whether the blocks append_slots(seqs) takes, one per sequence of
        needing_blocks(seqs), are free."""
        return len(self.needing_blocks(seqs)) <= self.num_free_blocks

    def needing_blocks(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """The sequences whose newest token needs a block: its position starts a new one
        (rollover), or lands in a shared one (copy-on-write). append_slots acts on these
        alone, so a scheduler passes it this list (one pass over a decode batch)."""
        size, refs = self.block_size, self.ref_counts
        if not self.forked:  # the rollovers alone (one compare a row, 256 rows a step)
            return [seq for seq in seqs if len(seq.token_ids) > len(seq.block_ids) * size]
        return [
            seq
            for seq in seqs
            if (index := (len(seq.token_ids) - 1) // size) >= len(seq.block_ids)
            or refs[seq.block_ids[index]] > 1
        ]

    def append_slots(self, seqs: Iterable[Sequence]) -> None:
        """Make room for each sequence's newest token, in one batched pass.

        A sequence whose last block is full gets a fresh block (rollover); one
        whose target block is shared gets a private copy (copy-on-write, queued
        in pending_copies for the model runner). Other sequences are left as they
        are. Callers check can_append first.
        """
        size, refs = self.block_size, self.ref_counts
        for seq in seqs:
            index = (len(seq.token_ids) - 1) // size
            if index >= len(seq.block_ids):
                seq.block_ids.append(self._fresh_block())
                self.block_table[seq.slot, index] = seq.block_ids[index]
                self.dirty_slots.add(seq.slot)
            elif refs[seq.block_ids[index]] > 1:
                src = seq.block_ids[index]
                dst = self._fresh_block()
                self.ref_counts[src] -= 1
                seq.block_ids[index] = dst
                self.pending_copies.append((src, dst))
                self.block_table[seq.slot, index] = dst
                self.dirty_slots.add(seq.slot)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """Let child share all of parent's blocks (e.g. parallel sampling), its first
        num_tokens tokens (default: as many as parent computed) counted computed: their
        KV is parent's, so child's tokens must start with parent's.

        The shared tokens count as prefix hits (num_cached_tokens and the prefix_*
        counters), as the tokens of a cached prefix do. A child that will write into a
        shared block copies it first (append_slots' copy-on-write).
        """
        assert child.slot < 0 and not child.block_ids and self.free_slots
        num_tokens = parent.num_computed_tokens if num_tokens is None else num_tokens
        assert num_tokens <= parent.num_computed_tokens, f"{parent} has not computed {num_tokens}"
        self.forked = True
        for block in parent.block_ids:
            self.ref_counts[block] += 1
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = child.num_cached_tokens = num_tokens
        self.prefix_query_tokens += len(child)
        self.prefix_hit_tokens += num_tokens
        child.num_committed_blocks = min(parent.num_committed_blocks, num_tokens // self.block_size)
        child.block_hashes = list(parent.block_hashes)
        child.slot = self.free_slots.pop()
        self._write_row(child, 0)

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks whose KV is now fully computed."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = seq.num_computed_tokens // size
        if num_full <= seq.num_committed_blocks:
            return
        hashes = seq.full_block_hashes(size, seq.num_computed_tokens)
        block_hash, hash_to_block = self.block_hash, self.hash_to_block
        new_blocks, new_hashes = [], []
        for index in range(seq.num_committed_blocks, num_full):
            block, h = seq.block_ids[index], hashes[index]
            if block_hash[block] is None and h not in hash_to_block:
                block_hash[block] = h
                hash_to_block[h] = block
                new_blocks.append(block)
                new_hashes.append(h)
        if new_blocks:
            self.hash_log.touch(new_blocks, new_hashes)
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks and slot. Hashed blocks stay cached.

        Tail blocks enter the LRU before head blocks so that, under eviction, a
        shared prefix outlives the suffixes that hang off it.
        """
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free_blocks.append(block)
                else:
                    self.cached_blocks[block] = None
        seq.block_ids = []
        seq.num_committed_blocks = 0
        if seq.slot >= 0:
            self.block_table[seq.slot] = self.null_block
            self.dirty_slots.add(seq.slot)
            self.free_slots.append(seq.slot)
            seq.slot = -1

    # ---- reporting ------------------------------------------------------------
    def take_dirty_slots(self) -> list[int]:
        slots = sorted(self.dirty_slots)
        self.dirty_slots.clear()
        return slots

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def recent_hashes(self, limit: int) -> list[int]:
        """Hashes of resident full blocks, most recently used first: all of the newest, a
        sample of the older ones (replica.hashing.summarize), at most limit."""
        return summarize(self.hash_log.newest_first(), len(self.hash_to_block), limit)

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent with `live` sequences."""
        counts = [0] * self.num_blocks
        slots = set()
        for seq in live:
            for block in seq.block_ids:
                counts[block] += 1
            if seq.block_ids:
                assert seq.slot >= 0 and seq.slot not in slots, f"{seq} slot {seq.slot}"
                slots.add(seq.slot)
                row = self.block_table[seq.slot, : len(seq.block_ids)]
                assert row.tolist() == seq.block_ids, f"{seq} table row {row} != {seq.block_ids}"
        assert counts == self.ref_counts, "refcounts do not match the live block tables"
        if not self.forked:  # needing_blocks' premise: a block still filling is not shared
            for seq in live:
                if seq.block_ids and len(seq.token_ids) < len(seq.block_ids) * self.block_size:
                    assert counts[seq.block_ids[-1]] == 1, f"{seq} shares a block still filling"
        free, cached = set(self.free_blocks), set(self.cached_blocks)
        assert len(free) == len(self.free_blocks) and not free & cached
        in_use = {b for b in range(self.num_blocks) if counts[b] > 0}
        assert not in_use & (free | cached), "a block is both in use and free"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "blocks leaked"
        assert all(self.block_hash[b] is None for b in free), "a free block keeps a hash"
        assert all(self.block_hash[b] is not None for b in cached), "a cached block lost its hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map disagrees for block {b}"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
        logged = [h for chunk in self.hash_log.newest_first() for h in chunk.tolist()]
        assert len(logged) == self.hash_log.num_current == len(self.hash_to_block)
        assert set(logged) == self.hash_to_block.keys(), "hash_log disagrees with the cache"
        assert not slots & set(self.free_slots), "a live slot is also free"

    # ---- internals ------------------------------------------------------------
    def _take_ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.cached_blocks[block]
        self.ref_counts[block] += 1

    def _fresh_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.cached_blocks.popitem(last=False)  # evict the LRU cached block
            h = self.block_hash[block]
            del self.hash_to_block[h]
            self.hash_log.forget(block)
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _write_row(self, seq: Sequence, start: int) -> None:
        self.block_table[seq.slot, start : len(seq.block_ids)] = seq.block_ids[start:]
        self.dirty_slots.add(seq.slot)
