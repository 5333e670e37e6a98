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
    number of prompt blocks the replica has cached (router.Candidates.matched_blocks:
    to the deepest block it publishes), most first, then by the prefix's affinity
    key: a rendezvous hash of the prompt's first affinity_tokens tokens (whole
    blocks) with each replica. So every router, whatever its view, sends requests
    sharing those tokens to the same replica while loads are balanced: a new prefix
    lands on one replica (its home), not on whichever looked lightest to each router
    before any replica published it, and a prefix cached on several replicas
    concentrates on one of them while the others' copies age out. Load does not
    order replicas that tie on cached blocks, as it would copy a prefix onto
    whichever of them looked lighter to each router. On its own this ordering did
    not tighten placement on 4 H200s (each prefix still ran on 3.97 replicas of 4);
    raising balance_abs_threshold from 0.1 to 0.5 did (cache hits 42% -> 63%, TTFT
    p50 197 -> 40 ms; docs/design.md, "Imbalance threshold"). The imbalance rule,
    and admission's room test, are what keep a hot prefix's home from taking more
    than it can. Prompts shorter than one block (or affinity_tokens 0) have no
    affinity key: replicas tied on cached blocks are ordered by load, with loads
    within balance_band of the least counting as equal, then per request.
    Cost: O(prompt blocks) in the fleet's PrefixIndex (updated per snapshot, not
    per request) plus numpy over the candidates; not O(replicas x hashes).
    Invariant: one replica per tier; with no match anywhere and no affinity key the
    order equals the kv policy's.
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
        affinity_tokens: int = 0,
    ) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.seed = seed
        self.balance_band = balance_band
        self.affinity_tokens = affinity_tokens

    def rank(self, candidates: Candidates, request: RouteRequest) -> list[list[str]]:
        loads = candidates.loads
        if not request.knows_prompt or is_imbalanced(
            loads, self.balance_abs_threshold, self.balance_rel_threshold
        ):
            ties = candidates.tiebreak(self.seed, request.request_id)
            return candidates.tiers(np.lexsort((ties, banded(loads, self.balance_band))))
        matched = candidates.matched_blocks(request)
        key = self.affinity_key(candidates, request)
        if key is None:
            ties = candidates.tiebreak(self.seed, request.request_id)
            return candidates.tiers(np.lexsort((ties, banded(loads, self.balance_band), -matched)))
        return candidates.tiers(np.lexsort((candidates.tiebreak(self.seed, key), -matched)))

    def affinity_key(self, candidates: Candidates, request: RouteRequest) -> str | None:
        """The prefix's key: the hash of the prompt's last full block within its first
        affinity_tokens tokens (at the candidates' smallest block size); None without one."""
        if not len(candidates) or self.affinity_tokens <= 0:
            return None
        block_size = int(candidates.fleet.column("block_size")[candidates.slots].min())
        block_hash = request.leading_block_hash(self.affinity_tokens, block_size)
        return None if block_hash is None else f"prefix\x00{block_hash}"
