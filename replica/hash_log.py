"""HashLog: the resident prefix-cache blocks in recency order, packed for the summary.

A replica publishes its most recently used block hashes every stats period
(ReplicaStats.cached_prefix_hashes, replica.hashing.summarize). Walking an OrderedDict of
~2K hashes for that, mostly cache misses on nodes and ints scattered over the heap, made
a full snapshot take 0.61-0.79 ms of an H200 host's engine thread, so a step ran late
once a period; read from this log, it took 0.27-0.37 ms in the same runs. Here each use
of a hashed block appends its block, its hash and a stale flag to flat arrays, and the
walk reads them newest first in numpy chunks.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

# Entries read per numpy pass, newest first. A summary of 2,048 hashes thinned 1 in 8
# past its newest half reads ~9K current entries.
_CHUNK = 4096


class HashLog:
    """Append-only log of (block, hash) uses; an entry is current until its block is used
    again or evicted, which marks it stale (stale: a flag per entry, so a reader takes
    the current entries from contiguous memory; positions[block] is the block's current one).

    Invariant: the current entries, newest first, are the resident hashed blocks in
    most-recently-used-first order, one entry per block (BlockManager.check_invariants
    compares them with its hash_to_block). Entries that are no longer current are
    dropped once they outnumber the current ones by slack (compact): amortized, a few
    array moves per touch.
    """

    def __init__(self, num_blocks: int, slack: int = 4096) -> None:
        self.slack = slack
        self.blocks = array("q")
        self.hashes = array("Q")  # chained block hashes are unsigned 64-bit
        self.stale = array("b")
        self.positions = array("q", [-1]) * num_blocks  # -1: the block holds no hash
        self.num_current = 0

    def touch(self, blocks: list[int], hashes: list[int]) -> None:
        """The blocks, holding these hashes, were registered or reused (in this order):
        they are now the newest. One call a batch (a prompt's blocks go in together)."""
        positions, stale = self.positions, self.stale
        position = len(stale)
        self.blocks.fromlist(blocks)
        self.hashes.fromlist(hashes)
        stale.frombytes(bytes(len(blocks)))
        num_new = 0
        for block in blocks:
            old = positions[block]
            positions[block] = position
            position += 1
            if old < 0:
                num_new += 1
            else:
                stale[old] = 1
        self.num_current += num_new
        if position > 2 * self.num_current + self.slack:
            self.compact()

    def forget(self, block: int) -> None:
        """The block was evicted: its hash is no longer resident."""
        old = self.positions[block]
        if old >= 0:
            self.stale[old] = 1
            self.positions[block] = -1
            self.num_current -= 1

    def newest_first(self) -> Iterator[np.ndarray]:
        """The current hashes, most recently used first, in uint64 chunks (each newest
        first). Lazy: a reader that stops early reads only the newest entries."""
        end = len(self.blocks)
        while end > 0:
            start = max(0, end - _CHUNK)
            yield self._current(start, end)  # a copy: no view of the log outlives the call
            end = start

    def _current(self, start: int, end: int) -> np.ndarray:
        """The current hashes among entries [start, end), newest first."""
        current = np.frombuffer(self.stale, np.int8)[start:end] == 0
        return np.frombuffer(self.hashes, np.uint64)[start:end][current][::-1]

    def compact(self) -> None:
        """Keep the current entries alone, in order."""
        current = np.frombuffer(self.stale, np.int8) == 0
        kept_blocks = np.frombuffer(self.blocks, np.int64)[current]
        kept_hashes = np.frombuffer(self.hashes, np.uint64)[current]
        positions = np.frombuffer(self.positions, np.int64)
        positions[kept_blocks] = np.arange(len(kept_blocks))
        del current, positions  # no view of an array outlives the call
        self.blocks = array("q", kept_blocks.tobytes())
        self.hashes = array("Q", kept_hashes.tobytes())
        self.stale = array("b", bytes(len(kept_blocks)))
