"""pow2 policy: power of two choices over KV occupancy."""

from __future__ import annotations

import numpy as np

from router.base import RoutingPolicy
from router.candidates import Candidates
from router.request import RouteRequest
from router.tiebreak import mix64, request_key


class Pow2Policy(RoutingPolicy):
    """Samples two replicas at random and prefers the one with less KV work.

    Algorithm: draw two distinct candidates from a 64-bit key mixed from (seed,
    request id, number of calls so far); the one with the lower load_fraction
    (ties: the first drawn) is the first tier, the other the second; the
    remaining replicas follow in load order (ties by router.tiebreak) as
    fallback tiers. Keyed by the request, not a random.Random(seed) stream:
    every Serve handle and proxy runs its own router with the same seed, and
    identical streams would make their k-th requests sample the same pair.
    Invariant: the first tier is never the worse of the two sampled replicas;
    the same seed and the same call sequence give the same choices.
    Failure: none. Less herding than a strict argmin under stale stats, at the
    price of sometimes skipping the least loaded replica.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.num_calls = 0  # a request asked for again (Serve retries) draws anew

    def rank(self, candidates: Candidates, request: RouteRequest) -> list[list[str]]:
        n = len(candidates)
        if n <= 1:
            return candidates.tiers(np.arange(n))
        key = mix64(request_key(self.seed, request.request_id) ^ self.num_calls)
        self.num_calls += 1
        first, second = key % n, (key >> 32) % (n - 1)
        second += second >= first  # distinct from first, uniform over the others
        loads = candidates.loads
        if loads[second] < loads[first]:
            first, second = second, first
        rest = np.ones(n, dtype=bool)
        rest[[first, second]] = False
        others = np.flatnonzero(rest)
        ties = candidates.tiebreak(self.seed, request.request_id)[others]
        order = others[np.lexsort((ties, loads[others]))]
        return candidates.tiers(np.concatenate(([first, second], order)))
