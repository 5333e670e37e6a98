"""pow2 policy: power of two choices over KV occupancy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from replica.stats import ReplicaStats
from router.load import load_fraction, rank_by_load
from router.request import RouteRequest


class Pow2Policy:
    """Samples two replicas at random and prefers the one with less KV work.

    Algorithm: draw two distinct replicas from a random.Random(seed) stream;
    the one with the lower load_fraction (ties: the first drawn) is the first
    tier, the other the second; the remaining replicas follow in load order as
    fallback tiers.
    Invariant: the first tier is never the worse of the two sampled replicas;
    the same seed and the same call sequence give the same choices.
    Failure: none. Less herding than a strict argmin under stale stats, at the
    price of sometimes skipping the least loaded replica.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)

    def choose_replicas(
        self, stats: Sequence[ReplicaStats], request: RouteRequest, now_s: float
    ) -> list[list[str]]:
        if len(stats) <= 1:
            return [[s.replica_id] for s in stats]
        first, second = self.rng.sample(range(len(stats)), 2)
        pair = [stats[first], stats[second]]
        if load_fraction(pair[1], request) < load_fraction(pair[0], request):
            pair.reverse()
        sampled = {first, second}
        rest = [s for i, s in enumerate(stats) if i not in sampled]
        return [[s.replica_id] for s in pair + rank_by_load(rest, request, self.seed)]
