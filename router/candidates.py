"""Candidates: the replicas one request may go to, as a policy ranks them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.stats import ReplicaStats
from router.fleet import Fleet
from router.prefix_index import mask_slots, slot_mask
from router.request import RouteRequest
from router.room import room_for
from router.tiebreak import request_key, tiebreak_keys


@dataclass(frozen=True)
class Candidates:
    """Replicas by position: fleet slots and the request's load on each, charged.

    Built by router.Admission from the replicas it admits (or by from_stats from
    plain snapshots); a policy reads it and returns tiers of replica ids. The
    fleet is shared and read-only here.
    """

    fleet: Fleet
    slots: np.ndarray  # int64 [num_candidates]: fleet slots
    loads: np.ndarray  # float64 [num_candidates]: load_fraction with the request
    matched: np.ndarray | None = None  # matched_blocks, when the caller already has it

    @classmethod
    def from_stats(cls, stats: Sequence[ReplicaStats], request: RouteRequest) -> Candidates:
        """Every valid snapshot as a candidate, uncharged (a policy called without admission)."""
        fleet = Fleet(with_prefix_index=any(s.cached_prefix_hashes for s in stats))
        for s in stats:
            fleet.observe(s)
        return cls(fleet, np.arange(len(fleet)), room_for(fleet, request).load)

    def __len__(self) -> int:
        return len(self.slots)

    def tiebreak(self, seed: int, request_id: str) -> np.ndarray:
        """uint64 [num_candidates]: router.tiebreak.tiebreak of each candidate."""
        keys = self.fleet.column("replica_key")[self.slots]
        return tiebreak_keys(keys, request_key(seed, request_id))

    def matched_blocks(self, request: RouteRequest) -> np.ndarray:
        """int64 [num_candidates]: leading prompt blocks each candidate has cached.

        Per block size present among the candidates: the prompt's chained hashes
        at that size, matched in the fleet's PrefixIndex against the candidates
        of that size, by the deepest block each publishes (PrefixIndex.deepest_levels).
        O(prompt blocks) plus numpy work over the candidates.
        """
        if self.matched is not None:
            return self.matched
        matched = np.zeros(len(self.slots), dtype=np.int64)
        index = self.fleet.prefix
        if index is None or not len(self.slots):
            return matched
        num_slots = len(self.fleet)
        block_sizes = self.fleet.column("block_size")[self.slots]
        by_slot = np.zeros(num_slots, dtype=np.int64)
        first = int(block_sizes[0])
        # One block size is the usual fleet; np.unique would sort every time.
        uniform = bool((block_sizes == first).all())
        for block_size in [first] if uniform else np.unique(block_sizes).tolist():
            hashes = request.prompt_block_hashes(block_size)
            if not hashes:
                continue
            members = np.zeros(num_slots, dtype=bool)
            members[self.slots[block_sizes == block_size]] = True
            for num_blocks, mask in index.deepest_levels(hashes, slot_mask(members)):
                by_slot[mask_slots(mask, num_slots)] = num_blocks
        return by_slot[self.slots]

    def tiers(self, order: np.ndarray) -> list[list[str]]:
        """One tier per candidate, in `order` (positions, best first)."""
        ids = self.fleet.column("replica_id")[self.slots[order]]
        return ids.reshape(-1, 1).tolist()
