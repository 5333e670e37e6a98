"""prefix policy: cache affinity, unless the replicas are imbalanced."""

from __future__ import annotations

import numpy as np

from router.base import RoutingPolicy
from router.candidates import Candidates
from router.load import banded
from router.request import RouteRequest


def is_imbalanced(
    loads: np.ndarray, balance_abs_threshold: float, balance_rel_threshold: float
) -> bool:
    """SGLang's rule: both the absolute and the relative load gap are over threshold."""
    if len(loads) < 2:
        return False
    max_load, min_load = float(loads.max()), float(loads.min())
    return (
        max_load - min_load > balance_abs_threshold and max_load > balance_rel_threshold * min_load
    )


class PrefixPolicy(RoutingPolicy):
    """Routes to the replica caching the longest prefix of the prompt, while loads are balanced.

    Algorithm (SGLang cache-aware router, over published block hashes instead of
    a radix tree): take each candidate's load_fraction. If the candidates are
    imbalanced (max - min > balance_abs_threshold and max > balance_rel_threshold
    * min), rank by load alone, as the kv policy does. Otherwise rank by the
    number of leading prompt blocks found in the replica's cached_prefix_hashes,
    longest first, then by load, then by the seeded tiebreak. Loads within
    balance_band of the least count as equal, as in the kv policy.
    Cost: O(prompt blocks) in the fleet's PrefixIndex (updated per snapshot, not
    per request) plus numpy over the candidates; not O(replicas x hashes).
    Invariant: one replica per tier; with no match anywhere (or no prompt ids)
    the order equals the kv policy's.
    Failure: cached_prefix_hashes is a capped, slightly old summary, so a match
    can be evicted by the time the request lands; the cost is a recompute, never
    a wrong answer. Block hashes are computed per replica block_size.
    """

    needs_prefix_index = True

    def __init__(
        self,
        balance_abs_threshold: float,
        balance_rel_threshold: float,
        seed: int = 0,
        balance_band: float = 0.0,
    ) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.seed = seed
        self.balance_band = balance_band

    def rank(self, candidates: Candidates, request: RouteRequest) -> list[list[str]]:
        loads = candidates.loads
        ties = candidates.tiebreak(self.seed, request.request_id)
        if not request.knows_prompt or is_imbalanced(
            loads, self.balance_abs_threshold, self.balance_rel_threshold
        ):
            return candidates.tiers(np.lexsort((ties, banded(loads, self.balance_band))))
        matched = candidates.matched_blocks(request)
        return candidates.tiers(np.lexsort((ties, banded(loads, self.balance_band), -matched)))
