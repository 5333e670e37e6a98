"""cache_salt and prefix_salt: prompts share cached blocks only under the same salts."""

from __future__ import annotations

import random

import pytest

from replica import EngineConfig, LLMEngine, SamplingParams
from replica.hashing import ROOT_HASH, prefix_block_hashes, root_hash
from replica.sampling_params import MAX_CACHE_SALT_CHARS

BLOCK_SIZE = 16
PROMPT = random.Random(48).choices(range(500), k=3 * BLOCK_SIZE + 5)  # three full blocks


def make_engine(prefix_salt: str = "") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", num_blocks=64, block_size=BLOCK_SIZE,
            max_num_seqs=8, max_model_len=256, prefix_salt=prefix_salt,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def greedy(cache_salt: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, cache_salt=cache_salt)


def test_root_hash_is_the_unsalted_root_without_salts_and_tells_salts_apart():
    assert root_hash() == root_hash("", None) == ROOT_HASH
    roots = [
        root_hash("", "a"),
        root_hash("a", None),
        root_hash("a", "a"),
        root_hash("", "b"),
        root_hash("ab", None),
        root_hash("a", "b"),
        root_hash("", "\ud800"),  # a lone surrogate, as JSON may carry, hashes too
    ]
    assert ROOT_HASH not in roots
    assert len(set(roots)) == len(roots)
    assert root_hash("a", "b") == root_hash("a", "b")  # stable: router and replica agree


def test_two_cache_salts_share_no_blocks_and_the_same_salt_hits(engine):
    outs = engine.generate([PROMPT, PROMPT], [greedy("tenant-a"), greedy("tenant-b")])
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[0].token_ids == outs[1].token_ids  # the salt changes caching, not tokens
    engine.add_request("a-again", PROMPT, greedy("tenant-a"))
    engine.add_request("b-again", PROMPT, greedy("tenant-b"))
    engine.add_request("c", PROMPT, greedy("tenant-c"))
    engine.add_request("unsalted", PROMPT, greedy())
    engine.step()
    seqs = {rid: engine.requests[rid] for rid in ("a-again", "b-again", "c", "unsalted")}
    assert seqs["a-again"].num_cached_tokens == 3 * BLOCK_SIZE
    assert seqs["b-again"].num_cached_tokens == 3 * BLOCK_SIZE
    assert seqs["c"].num_cached_tokens == 0
    assert seqs["unsalted"].num_cached_tokens == 0
    # Running side by side, the salts' prompts sit in blocks of their own.
    blocks = [set(seq.block_ids) for seq in seqs.values()]
    assert sum(map(len, blocks)) == len(set().union(*blocks))
    assert seqs["a-again"].block_hashes[:3] == prefix_block_hashes(
        PROMPT, BLOCK_SIZE, root_hash("", "tenant-a")
    )
    while engine.requests:
        engine.step()
    engine.check_invariants()


def test_prefix_salt_changes_every_block_hash_as_the_router_computes_it():
    """The replica's block hashes are prefix_block_hashes from root_hash(prefix_salt,
    cache_salt): what router.RouteRequest computes from the same salts."""
    salted = make_engine("deployment-1")
    for cache_salt in (None, "tenant-a"):
        salted.add_request(f"r-{cache_salt}", PROMPT, greedy(cache_salt))
        salted.step()
        hashes = salted.requests[f"r-{cache_salt}"].block_hashes[:3]
        assert hashes == prefix_block_hashes(
            PROMPT, BLOCK_SIZE, root_hash("deployment-1", cache_salt)
        )
        assert not set(hashes) & set(prefix_block_hashes(PROMPT, BLOCK_SIZE))
    while salted.requests:
        salted.step()
    (again,) = salted.generate([PROMPT], greedy())
    assert again.num_cached_tokens == 3 * BLOCK_SIZE  # a deployment salt alone still hits


@pytest.mark.parametrize("bad", ["", 7, b"salt", "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_bad_cache_salt_names_the_field(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=bad)


def test_cache_salt_round_trips_the_wire_dict():
    params = SamplingParams(cache_salt="tenant-a")
    assert SamplingParams.from_dict(params.to_dict()) == params
