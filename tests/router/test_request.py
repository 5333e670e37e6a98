from __future__ import annotations

import pytest

from replica.hashing import prefix_block_hashes
from router import RouteRequest


def test_prompt_length_comes_from_token_ids() -> None:
    request = RouteRequest("r", [1, 2, 3], max_tokens=8)
    assert request.prompt_token_ids == (1, 2, 3)
    assert request.num_prompt_tokens == 3
    assert request.num_prompt_blocks(2) == 2


def test_length_only_request() -> None:
    request = RouteRequest("r", num_prompt_tokens=33)
    assert request.num_prompt_blocks(16) == 3
    assert request.prompt_block_hashes(16) == ()


def test_disagreeing_length_is_refused() -> None:
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        RouteRequest("r", (1, 2, 3), num_prompt_tokens=5)
    with pytest.raises(ValueError, match="max_tokens"):
        RouteRequest("r", max_tokens=-1)


def test_block_hashes_match_replica_hashing_and_are_cached() -> None:
    tokens = list(range(40))
    request = RouteRequest.from_tokens("r", tokens)
    hashes = request.prompt_block_hashes(16)
    assert hashes == tuple(prefix_block_hashes(tokens, 16))
    assert len(hashes) == 2
    assert request.prompt_block_hashes(16) is hashes
    assert len(request.prompt_block_hashes(8)) == 5


def test_leading_block_hash_names_the_prompts_first_tokens() -> None:
    tokens = list(range(40))  # 2 full blocks of 16
    hashes = prefix_block_hashes(tokens, 16)
    request = RouteRequest.from_tokens("r", tokens)
    assert request.leading_block_hash(64, 16) == hashes[1]  # the prompt is shorter than 64
    assert request.leading_block_hash(20, 16) == hashes[0]
    assert request.leading_block_hash(15, 16) is None  # no full block within 15 tokens
    assert RouteRequest("r", num_prompt_tokens=40).leading_block_hash(64, 16) is None
    by_hashes = RouteRequest.with_block_hashes("r", 40, 16, hashes)
    assert by_hashes.leading_block_hash(64, 16) == hashes[1]
    assert by_hashes.leading_block_hash(64, 8) is None  # known at block size 16 only
