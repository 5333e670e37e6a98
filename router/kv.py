"""kv policy: least KV work first."""

from __future__ import annotations

from collections.abc import Sequence

from replica.stats import ReplicaStats
from router.load import rank_by_load
from router.request import RouteRequest


class KVPolicy:
    """Ranks replicas by KV work: blocks in use plus blocks their waiting prompts need.

    Algorithm: load = (used blocks + ceil(waiting tokens / block_size) + this
    request's prompt blocks) / total blocks, where "used" already includes this
    router's reservations (charged by admission). Ascending load; equal loads
    are ordered by a hash of (seed, request id, replica id), so ties spread
    over requests yet repeat exactly for the same seed.
    Invariant: one replica per tier, so the caller tries them strictly in order.
    Failure: none; stale or missing stats are kept out by admission.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def choose_replicas(
        self, stats: Sequence[ReplicaStats], request: RouteRequest, now_s: float
    ) -> list[list[str]]:
        return [[s.replica_id] for s in rank_by_load(stats, request, self.seed)]
