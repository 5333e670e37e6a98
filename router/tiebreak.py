"""Seeded tiebreak keys: equal loads split differently per request, reproducibly, for a whole fleet.

tiebreak(seed, request_id, replica_id) = mix64(replica_key(replica_id) ^ request_key(seed,
request_id)): both keys are 64-bit blake2b digests and mix64 is splitmix64's finalizer, a
bijection with full avalanche, so for one request the replicas get independent-looking
keys, and any two replicas swap order across requests about half the time. Why not one
blake2b per (request, replica): that is ~1 us of Python per replica per decision (1 ms at
1,000 replicas); this is one digest per request, one per replica id ever (cached), and
five integer operations that numpy applies to every replica at once (tiebreak_keys).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@functools.lru_cache(maxsize=1 << 16)
def replica_key(replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "little")


def request_key(seed: int, request_id: str) -> int:
    payload = f"{seed}\x00{request_id}".encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * _MIX1) & MASK64
    x ^= x >> 27
    x = (x * _MIX2) & MASK64
    return x ^ (x >> 31)


def tiebreak(seed: int, request_id: str, replica_id: str) -> int:
    """A stable pseudo-random key of (seed, request, replica); equals tiebreak_keys' entry."""
    return mix64(replica_key(replica_id) ^ request_key(seed, request_id))


def tiebreak_keys(replica_keys: np.ndarray, key_of_request: int) -> np.ndarray:
    """tiebreak() for many replicas at once: replica_keys is uint64 [num_replicas]."""
    x = replica_keys ^ np.uint64(key_of_request)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_MIX1)  # uint64 arrays wrap modulo 2**64, as the & MASK64 above
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MIX2)
    x ^= x >> np.uint64(31)
    return x
