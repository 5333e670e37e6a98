"""Fake ReplicaStats for router tests (no Ray, no clock)."""

from __future__ import annotations

from replica.stats import ReplicaStats

NOW_S = 1_000.0


def make_stats(
    replica_id: str,
    *,
    num_blocks_total: int = 100,
    num_blocks_used: int = 0,
    num_blocks_cached: int = 0,
    num_waiting_tokens: int = 0,
    num_waiting_blocks: int | None = None,
    num_running: int = 0,
    max_num_seqs: int = 64,
    block_size: int = 16,
    cached_prefix_hashes: tuple[int, ...] = (),
    timestamp_s: float = NOW_S,
) -> ReplicaStats:
    num_free = num_blocks_total - num_blocks_used - num_blocks_cached
    return ReplicaStats(
        replica_id=replica_id,
        num_blocks_total=num_blocks_total,
        num_blocks_free=num_free,
        num_blocks_cached=num_blocks_cached,
        kv_usage=num_blocks_used / num_blocks_total if num_blocks_total else 0.0,
        num_running=num_running,
        num_waiting=1 if num_waiting_tokens else 0,
        num_preempted_total=0,
        max_num_seqs=max_num_seqs,
        tokens_per_s=0.0,
        block_size=block_size,
        num_waiting_tokens=num_waiting_tokens,
        num_waiting_blocks=num_waiting_blocks,
        cached_prefix_hashes=cached_prefix_hashes,
        timestamp_s=timestamp_s,
    )
