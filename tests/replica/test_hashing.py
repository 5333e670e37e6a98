"""Chained block hashes: one definition, however they are computed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from replica.hashing import (
    ROOT_HASH,
    SUMMARY_STRIDE,
    hash_block,
    prefix_block_hashes,
    summarize,
)
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence


def chain(token_ids: list[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("length", [0, 5, 16, 17, 47, 48, 130])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_block_hashes_chain_hash_block(length, block_size):
    """Packed once or block by block, the hashes are the same (routers in other processes
    compare them), and only full blocks are hashed."""
    rng = random.Random(length)
    tokens = [rng.randrange(2**40) for _ in range(length)]
    assert prefix_block_hashes(tokens, block_size) == chain(tokens, block_size)
    assert prefix_block_hashes(tokens, block_size, 12345) == chain(tokens, block_size, 12345)
    assert len(prefix_block_hashes(tokens, block_size)) == length // block_size


def test_sequence_hashes_extend_as_tokens_arrive():
    tokens = list(range(100, 140))
    seq = Sequence("r", tokens[:20], SamplingParams(max_tokens=30), eos_token_id=None)
    assert seq.full_block_hashes(16) == chain(tokens[:20], 16)
    seq.token_ids += tokens[20:]
    assert seq.full_block_hashes(16, 35) == chain(tokens[:35], 16)  # bounded: 2 blocks
    assert seq.full_block_hashes(16) == chain(tokens, 16)
    # Within the prompt the hashes come from its int64 copy, from any block on.
    long = Sequence("p", tokens, SamplingParams(max_tokens=4), eos_token_id=None)
    assert long.full_block_hashes(16, 20) == chain(tokens[:20], 16)
    assert long.full_block_hashes(16) == chain(tokens, 16)
    assert long.prompt_ids.tolist() == tokens


@pytest.mark.parametrize("num_hashes", [0, 5, 16, 17, 100, 3000])
@pytest.mark.parametrize("limit", [1, 16, 64])
def test_summarize_keeps_the_newest_half_then_the_older_multiples_of_the_stride(num_hashes, limit):
    rng = random.Random(num_hashes * 131 + limit)
    newest_first = [rng.randrange(2**64) for _ in range(num_hashes)]
    for chunk in (1, 7, 4096):  # however the hashes come in chunks
        chunks = (
            np.array(newest_first[i : i + chunk], np.uint64) for i in range(0, num_hashes, chunk)
        )
        assert summarize(chunks, num_hashes, limit) == thinned(newest_first, limit)


def thinned(newest_first: list[int], limit: int) -> list[int]:
    if len(newest_first) <= limit:
        return newest_first
    dense = newest_first[: limit // 2]
    older = [h for h in newest_first[limit // 2 :] if h % SUMMARY_STRIDE == 0]
    return dense + older[: limit - len(dense)]
