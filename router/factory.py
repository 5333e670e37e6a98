"""make_policy: RouterConfig.policy -> a RoutingPolicy."""

from __future__ import annotations

from router.base import RoutingPolicy
from router.config import RouterConfig
from router.kv import KVPolicy
from router.pow2 import Pow2Policy
from router.prefix import PrefixPolicy


def make_policy(config: RouterConfig) -> RoutingPolicy:
    if config.policy == "kv":
        return KVPolicy(seed=config.seed, balance_band=config.balance_band)
    if config.policy == "prefix":
        return PrefixPolicy(
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            seed=config.seed,
            balance_band=config.balance_band,
            affinity_tokens=config.prefix_affinity_tokens,
        )
    if config.policy == "pow2":
        return Pow2Policy(seed=config.seed)
    raise ValueError(f"policy: unknown {config.policy!r}")  # RouterConfig already refuses it
