"""RoutingPolicy: the interface every routing policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from replica.stats import ReplicaStats
from router.request import RouteRequest


class RoutingPolicy(Protocol):
    """Ranks replicas for one request.

    Algorithm: policy-specific (kv.py, prefix.py, pow2.py).
    Invariant: the result is a list of non-empty tiers of replica ids, best tier
    first; every id comes from `stats`, appears at most once, and every replica
    in `stats` appears in some tier (so a caller that finds the first tiers busy
    can fall back to the rest). Empty `stats` gives an empty list.
    Failure: a policy never raises for load; it ranks whatever it is given.
    Admission (which replicas may be ranked at all, reservations, staleness,
    overload) is done before the policy by router.admission, which hands it
    only admissible replicas with this router's reservations already charged.
    """

    def choose_replicas(
        self, stats: Sequence[ReplicaStats], request: RouteRequest, now_s: float
    ) -> list[list[str]]: ...
