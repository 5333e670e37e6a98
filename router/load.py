"""Load measures of one ReplicaStats snapshot, shared by the policies and admission.

The decision path computes the same measures for a whole fleet at once
(router.room); these scalar forms define them, word refusal messages, and are
what tests hold the column forms to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replica.stats import ReplicaStats
from router.request import RouteRequest


def num_waiting_blocks(stats: ReplicaStats) -> int:
    """Blocks the replica's queued (not yet scheduled) prompts will take: its own estimate,
    which leaves out prefixes it has cached or that queue more than once, else every
    queued prompt token's block."""
    if stats.num_waiting_blocks is not None:
        return stats.num_waiting_blocks
    return -(-stats.num_waiting_tokens // stats.block_size)


def num_available_blocks(stats: ReplicaStats, queue_fraction: float = 0.0) -> int:
    """Blocks a new sequence may take: free and evictable cached ones not promised to the
    queue, plus queue_fraction of the replica's blocks (RouterConfig.queue_fraction).

    The replica's waiting prompts take blocks before a newly arrived request does
    (its scheduler is first come, first served), so they are not room. Without
    this a request that reached the replica but is not scheduled yet would look
    like free room to every router once the snapshot showing it released their
    reservations. A waiting prompt's cached prefix blocks would be shared, not taken,
    so the replica leaves them out (num_waiting_blocks); counting whole prompts made a
    replica with a short queue of requests for one cached 4K-token prefix look full.
    """
    allowance = int(stats.num_blocks_total * queue_fraction)
    room = stats.num_blocks_free + stats.num_blocks_cached + allowance - num_waiting_blocks(stats)
    return max(0, room)


def committed_fraction(stats: ReplicaStats) -> float:
    """Fraction of the KV blocks held by sequences or promised to queued prompts.

    Cached blocks are not usage. Can exceed 1 when the queue is longer than the
    free blocks: the high watermark compares against this.
    """
    return (stats.num_blocks_used + num_waiting_blocks(stats)) / stats.num_blocks_total


def watermark_imbalanced(stats: Sequence[ReplicaStats], high_watermark: float) -> bool:
    """One replica committed (committed_fraction: used + queued prompts) at or over
    high_watermark while another uses under half its blocks: the imbalance the prefix
    policy's balance rule exists to prevent, per replica (bench.sim's
    watermark_imbalance_frac is the share of samples where this holds).

    Not SGLang's fleet-wide gap rule (max - min load over a threshold): that fires
    when one replica is at 0.6 and another at 0.1, where nothing waits."""
    valid = [s for s in stats if s.num_blocks_total > 0]
    if len(valid) < 2:
        return False
    fullest = max(committed_fraction(s) for s in valid)
    emptiest = min(s.num_blocks_used / s.num_blocks_total for s in valid)
    return imbalanced_at_watermark(fullest, emptiest, high_watermark)


def imbalanced_at_watermark(max_committed: float, min_used: float, high_watermark: float) -> bool:
    """The rule of watermark_imbalanced over fractions already taken (the fullest replica's
    committed, the emptiest's used), for callers that track replicas as something other
    than snapshots (bench.sim's fleet)."""
    return max_committed >= high_watermark and min_used < 0.5


def seq_fraction(stats: ReplicaStats, request: RouteRequest | None = None) -> float:
    """Sequence slots the replica's running and waiting requests fill (+ this request), as a
    fraction of its max_num_seqs; 0 for a snapshot that does not say (max_num_seqs 0).

    Can exceed 1: requests past max_num_seqs wait for a slot however many blocks are free.
    """
    if stats.max_num_seqs <= 0:
        return 0.0
    num_seqs = stats.num_running + stats.num_waiting + (request is not None)
    return num_seqs / stats.max_num_seqs


def load_fraction(stats: ReplicaStats, request: RouteRequest | None = None) -> float:
    """Work the replica has, as a fraction of its capacity: KV blocks or sequence slots,
    whichever is fuller.

    KV: used blocks + blocks its waiting prompts will take (+ this request's
    prompt, so replicas of different sizes compare by where the request would
    leave them). Slots: seq_fraction. A replica with a large cache runs out of
    sequence slots first; by blocks alone, one that has just taken a batch of
    short new requests looks lightest while every new request there must wait
    for a slot, and routers whose snapshots all say so herd onto it (on 4 H200s
    with 32,768 blocks and max_num_seqs 256 per replica, one replica held 256
    running and 200-370 waiting while the others ran 0-50; docs/design.md, "kv
    policy and the balance band"). Can exceed 1: waiting work is a queue, not a
    state.
    """
    num_blocks = stats.num_blocks_used + num_waiting_blocks(stats)
    if request is not None:
        num_blocks += request.num_prompt_blocks(stats.block_size)
    return max(num_blocks / stats.num_blocks_total, seq_fraction(stats, request))


def banded(loads: np.ndarray, band: float) -> np.ndarray:
    """loads with every value within band of the least one set to that least one, so
    the replicas it holds tie (RouterConfig.balance_band); the others keep their load."""
    if band <= 0 or len(loads) < 2:
        return loads
    least = loads.min()
    return np.where(loads <= least + band, least, loads)
