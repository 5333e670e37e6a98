"""PrefixIndex: which replicas publish each cached block hash, kept up to date per snapshot.

Matching a prompt against every replica's summary costs O(replicas x hashes) when
each summary becomes a set per request (99 ms per decision at 1,000 replicas of
2,048 hashes). The index turns it around: a posting per block hash names the
replicas (fleet slots) holding it, so a match walks the prompt's blocks once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def slot_mask(slots: np.ndarray) -> int:
    """The bitmask (bit s set for slot s) of a bool array over slots."""
    return int.from_bytes(np.packbits(slots, bitorder="little").tobytes(), "little")


def mask_slots(mask: int, num_slots: int) -> np.ndarray:
    """The bool array over slots [num_slots] of a bitmask."""
    raw = np.frombuffer(mask.to_bytes((num_slots + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:num_slots].view(bool)


class HashPostings:
    """Block hash -> the slots holding it, as one int per hash.

    A posting is ~slot (a negative int) while one slot holds the hash, which is
    most of them (private blocks), else a bitmask of slots (bit s for slot s):
    small for the common case, and one big-int AND per block for a match,
    however many slots hold it.
    """

    def __init__(self) -> None:
        self.postings: dict[int, int] = {}

    def add(self, block_hash: int, slot: int) -> None:
        posting = self.postings.get(block_hash)
        if posting is None:
            self.postings[block_hash] = ~slot
        elif posting < 0:
            self.postings[block_hash] = (1 << ~posting) | (1 << slot)
        else:
            self.postings[block_hash] = posting | (1 << slot)

    def discard(self, block_hash: int, slot: int) -> None:
        """Drop slot from the hash's posting (it must hold it)."""
        posting = self.postings[block_hash]
        if posting < 0:
            del self.postings[block_hash]
            return
        posting &= ~(1 << slot)
        # One holder left: back to the small form.
        is_single = posting & (posting - 1) == 0
        self.postings[block_hash] = ~(posting.bit_length() - 1) if is_single else posting

    def holders(self, block_hash: int) -> int:
        """Bitmask of the slots holding block_hash."""
        posting = self.postings.get(block_hash)
        if posting is None:
            return 0
        return 1 << ~posting if posting < 0 else posting

    def match_levels(self, hashes: Sequence[int], candidates: int) -> list[tuple[int, int]]:
        """(num_blocks, slots) pairs: the candidate slots that hold exactly the first
        num_blocks of `hashes` contiguously (num_blocks >= 1; the others match 0).

        Contiguous from the first block, because a cached block is only reusable
        when every block before it is too.
        """
        if not hashes:
            return []
        levels = []
        alive = candidates
        for depth, block_hash in enumerate(hashes):
            still = alive & self.holders(block_hash)
            if still != alive and depth:
                levels.append((depth, alive & ~still))
            alive = still
            if not alive:
                return levels
        levels.append((len(hashes), alive))
        return levels

    def deepest_levels(self, hashes: Sequence[int], candidates: int) -> list[tuple[int, int]]:
        """(num_blocks, slots) pairs: the candidate slots whose deepest held block of
        `hashes` is block num_blocks - 1 (num_blocks >= 1; the others match 0).

        For a replica's published summary, which may leave out blocks: block hashes are
        chained, so holding block i's hash means having computed blocks 0..i, and the
        block manager evicts a chain's tail before its head, so the deepest published
        block vouches for the blocks before it. A capped summary (the most recently used
        blocks, a chain's tail being its newest) leaves out the heads of older chains;
        contiguous matching from the first block would find nothing there.
        O(prompt blocks) lookups, deepest first, until every candidate has matched.
        """
        levels = []
        left = candidates
        for depth in range(len(hashes) - 1, -1, -1):
            found = left & self.holders(hashes[depth])
            if found:
                levels.append((depth + 1, found))
                left &= ~found
                if not left:
                    break
        return levels

    def matched_blocks(self, hashes: Sequence[int], num_slots: int) -> np.ndarray:
        """int64 [num_slots]: match_levels over every slot, as an array."""
        matched = np.zeros(num_slots, dtype=np.int64)
        for num_blocks, mask in self.match_levels(hashes, (1 << num_slots) - 1):
            matched[mask_slots(mask, num_slots)] = num_blocks
        return matched


class PrefixIndex(HashPostings):
    """Block hash -> the fleet slots whose published cached_prefix_hashes hold it.

    Algorithm: update() diffs a replica's new summary against its previous one
    (O(hashes) on a changed snapshot, O(1) when the tuple is the same object),
    so nothing is rebuilt per request; deepest_levels() looks the prompt's blocks up
    deepest first: O(prompt blocks) big-int operations, whatever the number of
    replicas holding them.
    Invariant: slot s is in posting(h) iff h is in held[s].
    Failure: none; memory is about 100 bytes per distinct (hash, holder) beyond
    the snapshots themselves.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, tuple[int, ...]] = {}  # slot -> its summary as published

    def update(self, slot: int, hashes: tuple[int, ...]) -> None:
        old = self.held.get(slot, ())
        if hashes is not old and hashes != old:
            old_set, new_set = set(old), set(hashes)
            for h in old_set - new_set:
                self.discard(h, slot)
            for h in new_set - old_set:
                self.add(h, slot)
        if hashes:
            self.held[slot] = hashes
        else:
            self.held.pop(slot, None)

    def remove(self, slot: int) -> None:
        self.update(slot, ())

    def move(self, from_slot: int, to_slot: int) -> None:
        """Renumber a replica (the fleet compacts its slots); to_slot must be empty."""
        hashes = self.held.get(from_slot, ())
        self.remove(from_slot)
        self.update(to_slot, hashes)
