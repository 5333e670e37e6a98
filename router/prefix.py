"""prefix policy: cache affinity, unless the replicas are imbalanced."""

from __future__ import annotations

from collections.abc import Sequence

from replica.stats import ReplicaStats
from router.load import load_fraction, rank_by_load, tiebreak
from router.request import RouteRequest


def num_matched_blocks(stats: ReplicaStats, request: RouteRequest) -> int:
    """Leading prompt blocks whose chained hash the replica holds in its cache.

    Counted from the first block and stopped at the first miss, because a cached
    block is only reusable when every block before it is too.
    """
    cached = set(stats.cached_prefix_hashes)
    num_matched = 0
    for block_hash in request.prompt_block_hashes(stats.block_size):
        if block_hash not in cached:
            break
        num_matched += 1
    return num_matched


def is_imbalanced(
    loads: Sequence[float], balance_abs_threshold: float, balance_rel_threshold: float
) -> bool:
    """SGLang's rule: both the absolute and the relative load gap are over threshold."""
    if len(loads) < 2:
        return False
    max_load, min_load = max(loads), min(loads)
    return (
        max_load - min_load > balance_abs_threshold and max_load > balance_rel_threshold * min_load
    )


class PrefixPolicy:
    """Routes to the replica caching the longest prefix of the prompt, while loads are balanced.

    Algorithm (SGLang cache-aware router, over published block hashes instead of
    a radix tree): compute each replica's load_fraction. If the replicas are
    imbalanced (max - min > balance_abs_threshold and max > balance_rel_threshold
    * min), rank by load alone, as the kv policy does. Otherwise rank by the
    number of leading prompt blocks found in the replica's cached_prefix_hashes,
    longest first, then by load, then by the seeded tiebreak.
    Invariant: one replica per tier; with no match anywhere (or no prompt ids)
    the order equals the kv policy's.
    Failure: cached_prefix_hashes is a capped, slightly old summary, so a match
    can be evicted by the time the request lands; the cost is a recompute, never
    a wrong answer. Block hashes are computed per replica block_size.
    """

    def __init__(
        self, balance_abs_threshold: float, balance_rel_threshold: float, seed: int = 0
    ) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.seed = seed

    def choose_replicas(
        self, stats: Sequence[ReplicaStats], request: RouteRequest, now_s: float
    ) -> list[list[str]]:
        loads = {s.replica_id: load_fraction(s, request) for s in stats}
        if not request.prompt_token_ids or is_imbalanced(
            list(loads.values()), self.balance_abs_threshold, self.balance_rel_threshold
        ):
            return [[s.replica_id] for s in rank_by_load(stats, request, self.seed)]
        ranked = sorted(
            stats,
            key=lambda s: (
                -num_matched_blocks(s, request),
                loads[s.replica_id],
                tiebreak(self.seed, request.request_id, s.replica_id),
            ),
        )
        return [[s.replica_id] for s in ranked]
