"""Fleet: the router's table of replicas, one numpy column per number it ranks by."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replica.stats import SLOT_FORECAST_LEN, ReplicaStats
from router.load import num_waiting_blocks
from router.prefix_index import PrefixIndex
from router.tiebreak import replica_key

_DTYPES = {
    "total": np.int64,  # num_blocks_total
    "free": np.int64,  # num_blocks_free
    "cached": np.int64,  # num_blocks_cached
    "waiting": np.int64,  # blocks the waiting prompts need (router.load.num_waiting_blocks)
    "block_size": np.int64,
    "seqs": np.int64,  # num_running + num_waiting
    "max_seqs": np.int64,  # max_num_seqs (0: the snapshot does not say)
    "reserved": np.int64,  # this router's reserved blocks (set by router.Admission)
    "reserved_seqs": np.int64,  # this router's reserved requests (likewise)
    "waiting_tokens": np.int64,  # num_waiting_tokens: the queued prompts' tokens
    "drain_rate": np.float64,  # router.queue_wait.DrainRates.rate (NaN: unknown; Admission)
    "timestamp_s": np.float64,
    "slot_forecast_len": np.int64,  # len(slot_free_steps) (0: no forecast)
    "prefill_rate": np.float64,  # prefill_tokens_per_s
    "replica_key": np.uint64,  # router.tiebreak.replica_key
    "replica_id": object,  # ids again, so a ranking becomes tiers without a Python loop
}


def is_valid(stats: ReplicaStats) -> bool:
    """A snapshot the router can rank by (a replica still starting up publishes zeros)."""
    return stats.num_blocks_total > 0 and stats.block_size > 0


class Fleet:
    """The latest snapshot of every known replica, as columns indexed by slot.

    Algorithm: observe() writes one replica's columns (and its prefix summary
    into the PrefixIndex) when its snapshot object changes; decisions then read
    whole columns with numpy instead of walking Python objects per replica.
    Slots are dense, 0..len-1, in order of first observation; forget() moves
    the last replica into the freed slot.
    Invariant: ids[slot_of[r]] == r; row `slot` of every column describes
    stats[slot]; the prefix index holds stats[slot].cached_prefix_hashes at slot.
    Failure: none; a snapshot of a replica with no blocks is not kept (is_valid).
    """

    def __init__(self, with_prefix_index: bool = False) -> None:
        self.ids: list[str] = []
        self.stats: list[ReplicaStats] = []
        self.slot_of: dict[str, int] = {}
        self.prefix = PrefixIndex() if with_prefix_index else None
        self.changed: set[str] = set()  # replicas observed since drain_changed()
        self.version = 0  # bumped by every snapshot written and replica forgotten
        self._columns = {name: np.zeros(16, dtype=dtype) for name, dtype in _DTYPES.items()}
        # Row per slot: seconds after its snapshot at which its next slots free
        # (ReplicaStats.slot_free_steps x step_s), the last repeated past the forecast.
        self._columns["slot_free_s"] = np.zeros((16, SLOT_FORECAST_LEN))

    def __len__(self) -> int:
        return len(self.ids)

    def column(self, name: str) -> np.ndarray:
        """Column `name` (see _DTYPES) over the live slots; a view, not to be written."""
        return self._columns[name][: len(self.ids)]

    def observe(self, stats: ReplicaStats) -> None:
        """Take a replica's newer snapshot (a replica not seen before gets a slot)."""
        replica_id = stats.replica_id
        if not is_valid(stats):
            self.forget(replica_id)
            return
        slot = self.slot_of.get(replica_id)
        if slot is None:
            slot = self._append(replica_id, stats)
        elif self.stats[slot] is stats:
            return
        self.stats[slot] = stats
        c = self._columns
        c["total"][slot] = stats.num_blocks_total
        c["free"][slot] = stats.num_blocks_free
        c["cached"][slot] = stats.num_blocks_cached
        c["waiting"][slot] = num_waiting_blocks(stats)
        c["waiting_tokens"][slot] = stats.num_waiting_tokens
        c["block_size"][slot] = stats.block_size
        c["seqs"][slot] = stats.num_running + stats.num_waiting
        c["max_seqs"][slot] = stats.max_num_seqs
        c["timestamp_s"][slot] = stats.timestamp_s
        steps = stats.slot_free_steps[:SLOT_FORECAST_LEN]
        c["slot_forecast_len"][slot] = len(steps)
        c["prefill_rate"][slot] = stats.prefill_tokens_per_s
        if steps:
            row = c["slot_free_s"][slot]
            row[: len(steps)] = steps
            row[len(steps) :] = steps[-1]
            row *= stats.step_s
        if self.prefix is not None:
            self.prefix.update(slot, stats.cached_prefix_hashes)
        self.changed.add(replica_id)
        self.version += 1

    def forget(self, replica_id: str) -> None:
        slot = self.slot_of.pop(replica_id, None)
        if slot is None:
            return
        last = len(self.ids) - 1
        if self.prefix is not None:
            self.prefix.remove(slot)
        if slot != last:
            moved = self.ids[last]
            self.ids[slot], self.stats[slot] = moved, self.stats[last]
            self.slot_of[moved] = slot
            for column in self._columns.values():
                column[slot] = column[last]
            if self.prefix is not None:
                self.prefix.move(last, slot)
        self.ids.pop()
        self.stats.pop()
        self.version += 1

    def sync(self, stats: Sequence[ReplicaStats]) -> None:
        """Make the fleet exactly the valid snapshots in `stats` (replica ids unique).

        O(len(stats)) identity checks plus the cost of the snapshots that changed:
        a caller that hands over the same objects again pays almost nothing.
        """
        num_valid = 0
        slot_of, known = self.slot_of, self.stats
        for s in stats:
            slot = slot_of.get(s.replica_id)
            if slot is not None and known[slot] is s:  # kept, so valid
                num_valid += 1
                continue
            self.observe(s)
            num_valid += is_valid(s)
        if num_valid != len(self.ids):  # some replicas are gone
            keep = {s.replica_id for s in stats if is_valid(s)}
            for replica_id in [r for r in self.ids if r not in keep]:
                self.forget(replica_id)

    def set_reserved(self, replica_id: str, num_blocks: int, num_requests: int) -> None:
        slot = self.slot_of.get(replica_id)
        if slot is not None:
            self._columns["reserved"][slot] = num_blocks
            self._columns["reserved_seqs"][slot] = num_requests

    def set_drain_rate(self, replica_id: str, tokens_per_s: float | None) -> None:
        slot = self.slot_of.get(replica_id)
        if slot is not None:
            self._columns["drain_rate"][slot] = np.nan if tokens_per_s is None else tokens_per_s

    def drain_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed

    def _append(self, replica_id: str, stats: ReplicaStats) -> int:
        slot = len(self.ids)
        if slot == len(self._columns["total"]):
            self._columns = {
                name: np.concatenate([column, np.zeros_like(column)])
                for name, column in self._columns.items()
            }
        self.ids.append(replica_id)
        self.stats.append(stats)
        self.slot_of[replica_id] = slot
        self._columns["reserved"][slot] = 0
        self._columns["reserved_seqs"][slot] = 0
        self._columns["drain_rate"][slot] = np.nan
        self._columns["replica_key"][slot] = replica_key(replica_id)
        self._columns["replica_id"][slot] = replica_id
        return slot
