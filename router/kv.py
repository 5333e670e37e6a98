"""kv policy: least KV work first."""

from __future__ import annotations

import numpy as np

from router.base import RoutingPolicy
from router.candidates import Candidates
from router.load import banded
from router.request import RouteRequest


class KVPolicy(RoutingPolicy):
    """Ranks replicas by work: KV blocks or sequence slots, whichever is fuller.

    Algorithm: load = max((used blocks + ceil(waiting tokens / block_size) + this
    request's prompt blocks) / total blocks, (running + waiting + 1) / max_num_seqs)
    (router.load.load_fraction), where "used" and "waiting" already include this
    router's reservations (charged by admission). Ascending load, loads within
    balance_band of the least counting as equal (router.load.banded); equal loads
    are ordered by router.tiebreak (seed, request id, replica id), so ties
    spread over requests yet repeat exactly for the same seed.
    Invariant: one replica per tier, so the caller tries them strictly in order.
    Cost: numpy over the candidates, O(n log n) in C.
    Failure: none; stale or missing stats are kept out by admission.
    """

    def __init__(self, seed: int = 0, balance_band: float = 0.0) -> None:
        self.seed = seed
        self.balance_band = balance_band

    def rank(self, candidates: Candidates, request: RouteRequest) -> list[list[str]]:
        ties = candidates.tiebreak(self.seed, request.request_id)
        loads = banded(candidates.loads, self.balance_band)
        return candidates.tiers(np.lexsort((ties, loads)))
