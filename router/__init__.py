"""Routing and admission policies: pure functions over ReplicaStats and a request.

No Ray, no I/O, no clock of its own (now_s is passed in): the same code runs
inside Ray Serve (cluster.request_router), in tests, and in the simulator.
"""

from __future__ import annotations

from router.admission import Admission, Decision, refusal
from router.base import RoutingPolicy
from router.candidates import Candidates
from router.config import RouterConfig
from router.errors import OverloadedError
from router.factory import make_policy
from router.kv import KVPolicy
from router.pow2 import Pow2Policy
from router.prefix import PrefixPolicy
from router.request import RouteRequest
from router.reservations import ReservationBook

__all__ = [
    "Admission",
    "Candidates",
    "Decision",
    "KVPolicy",
    "OverloadedError",
    "Pow2Policy",
    "PrefixPolicy",
    "ReservationBook",
    "RouteRequest",
    "RouterConfig",
    "RoutingPolicy",
    "make_policy",
    "refusal",
]
