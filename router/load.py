"""Load measures over ReplicaStats shared by the policies and admission."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from replica.stats import ReplicaStats
from router.request import RouteRequest


def num_waiting_blocks(stats: ReplicaStats) -> int:
    """Blocks the replica's queued (not yet scheduled) prompt tokens will need."""
    return -(-stats.num_waiting_tokens // stats.block_size)


def num_available_blocks(stats: ReplicaStats) -> int:
    """Blocks a new sequence may take: free and evictable cached ones not promised to the queue.

    The replica's waiting prompts take blocks before a newly arrived request does
    (its scheduler is first come, first served), so they are not room. Without
    this a request that reached the replica but is not scheduled yet would look
    like free room to every router once the snapshot showing it released their
    reservations. Counting its whole prompt is conservative: a waiting prompt's
    cached prefix blocks would be shared, not taken.
    """
    room = stats.num_blocks_free + stats.num_blocks_cached - num_waiting_blocks(stats)
    return max(0, room)


def committed_fraction(stats: ReplicaStats) -> float:
    """Fraction of the KV blocks held by sequences or promised to queued prompts.

    Cached blocks are not usage. Can exceed 1 when the queue is longer than the
    free blocks: the high watermark compares against this.
    """
    return (stats.num_blocks_used + num_waiting_blocks(stats)) / stats.num_blocks_total


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


def tiebreaker(seed: int, request_id: str) -> Callable[[str], int]:
    """tiebreak(seed, request_id, replica_id) as a function of replica_id, prefix hashed once."""
    prefix = hashlib.blake2b(f"{seed}\x00{request_id}\x00".encode(), digest_size=8)

    def key(replica_id: str) -> int:
        h = prefix.copy()
        h.update(replica_id.encode())
        return int.from_bytes(h.digest(), "little")

    return key


def order_with_tiebreak(
    keys: Sequence[Hashable], replica_ids: Sequence[str], seed: int, request_id: str
) -> list[int]:
    """Indices i sorted by (keys[i], tiebreak(seed, request_id, replica_ids[i])).

    The tiebreak hash is computed only for keys that occur more than once,
    since it cannot change the order of a key that is unique.
    """
    counts = Counter(keys)
    if len(counts) == len(keys):
        return sorted(range(len(keys)), key=keys.__getitem__)
    key = tiebreaker(seed, request_id)
    full_keys = [
        (k, key(replica_id) if counts[k] > 1 else 0)
        for k, replica_id in zip(keys, replica_ids, strict=True)
    ]
    return sorted(range(len(keys)), key=full_keys.__getitem__)


def rank_by_load(
    stats: Sequence[ReplicaStats], request: RouteRequest, seed: int
) -> list[ReplicaStats]:
    """Replicas by ascending load_fraction, ties broken by tiebreak()."""
    loads = [load_fraction(s, request) for s in stats]
    order = order_with_tiebreak(loads, [s.replica_id for s in stats], seed, request.request_id)
    return [stats[i] for i in order]
