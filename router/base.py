"""RoutingPolicy: the interface every routing policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from replica.stats import ReplicaStats
from router.candidates import Candidates
from router.request import RouteRequest


class RoutingPolicy(ABC):
    """Ranks replicas for one request: a pure function of (candidates, request).

    Algorithm: policy-specific (kv.py, prefix.py, pow2.py).
    Invariant: the result is a list of non-empty tiers of replica ids, best tier
    first; every candidate appears in exactly one tier (so a caller that finds
    the first tiers busy can fall back to the rest). No candidates: [].
    Failure: a policy never raises for load; it ranks whatever it is given.
    Admission (which replicas may be ranked at all, reservations, staleness,
    overload) is done before the policy by router.admission, which hands it
    only admissible replicas with this router's reservations already charged.
    needs_prefix_index: whether rank() reads cached prefix hashes, so the
    caller's Fleet keeps a PrefixIndex.
    """

    needs_prefix_index = False

    @abstractmethod
    def rank(self, candidates: Candidates, request: RouteRequest) -> list[list[str]]: ...

    def choose_replicas(
        self, stats: Sequence[ReplicaStats], request: RouteRequest, now_s: float
    ) -> list[list[str]]:
        """rank() over plain snapshots, every one a candidate (no admission, no charging)."""
        return self.rank(Candidates.from_stats(stats, request), request)
