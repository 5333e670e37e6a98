"""Load measures over ReplicaStats shared by the policies and admission."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from replica.stats import ReplicaStats
from router.request import RouteRequest


def num_waiting_blocks(stats: ReplicaStats) -> int:
    """Blocks the replica's queued (not yet scheduled) prompt tokens will need."""
    return -(-stats.num_waiting_tokens // stats.block_size)


def num_available_blocks(stats: ReplicaStats) -> int:
    """Blocks a new sequence may take: free ones and evictable cached ones."""
    return stats.num_blocks_free + stats.num_blocks_cached


def usage_fraction(stats: ReplicaStats) -> float:
    """Fraction of the KV blocks held by sequences (cached blocks are not usage)."""
    return stats.num_blocks_used / stats.num_blocks_total


def load_fraction(stats: ReplicaStats, request: RouteRequest | None = None) -> float:
    """KV work the replica has, as a fraction of its blocks.

    Used blocks + blocks its waiting prompts will take (+ this request's
    prompt, so replicas of different sizes compare by where the request would
    leave them). Can exceed 1: waiting work is a queue, not a state.
    """
    num_blocks = stats.num_blocks_used + num_waiting_blocks(stats)
    if request is not None:
        num_blocks += request.num_prompt_blocks(stats.block_size)
    return num_blocks / stats.num_blocks_total


def tiebreak(seed: int, request_id: str, replica_id: str) -> int:
    """A stable pseudo-random key: equal loads split differently per request, reproducibly."""
    payload = f"{seed}\x00{request_id}\x00{replica_id}".encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def rank_by_load(
    stats: Sequence[ReplicaStats], request: RouteRequest, seed: int
) -> list[ReplicaStats]:
    """Replicas by ascending load_fraction, ties broken by tiebreak()."""
    return sorted(
        stats,
        key=lambda s: (load_fraction(s, request), tiebreak(seed, request.request_id, s.replica_id)),
    )
