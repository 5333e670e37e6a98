"""Chained block hashes shared by the block manager and the prefix router.

A full block is named by hash(parent block's hash, its token ids), so equal
hashes mean equal whole prefixes. The hash is stable across processes (no
Python hash randomization), which lets a router in another process match a
request's prompt against a replica's cached blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of token_ids, each chained over its parent."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
