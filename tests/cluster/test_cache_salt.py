"""The request router hashes a prompt as the replica's engine does, salts included, so
prefix affinity holds under a deployment's prefix_salt and a request's cache_salt."""

from __future__ import annotations

import pytest

from cluster import ClusterConfig
from cluster.app import with_prefix_salt
from cluster.messages import SubmitRequest
from cluster.openai_api import ChatCompletionRequest, CompletionRequest, parse
from cluster.request_router import route_group_from_call, route_request_from_call
from replica import EngineConfig, LLMEngine, SamplingParams
from replica.hashing import prefix_block_hashes

BLOCK_SIZE = 16
PROMPT = list(range(100, 150))  # three full blocks


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        model="gpt2-tiny", device="cpu", num_blocks=32, block_size=BLOCK_SIZE,
        max_num_seqs=4, max_model_len=128, prefix_salt="deployment-7",
    )  # fmt: skip
    return LLMEngine(config)


def engine_hashes(engine: LLMEngine, cache_salt: str | None) -> list[int]:
    request_id = f"r-{cache_salt}"
    params = SamplingParams(max_tokens=2, temperature=0.0, cache_salt=cache_salt)
    engine.add_request(request_id, PROMPT, params)
    engine.step()
    hashes = engine.requests[request_id].block_hashes[:3]
    engine.abort(request_id)
    return hashes


def wire(request_id: str, cache_salt: str | None) -> dict:
    params = SamplingParams(max_tokens=2, cache_salt=cache_salt).to_dict()
    return SubmitRequest(request_id, "caller", PROMPT, params).to_wire()


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_router_hashes_a_call_as_the_replica_does(engine, cache_salt):
    expected = engine_hashes(engine, cache_salt)
    assert len(expected) == 3
    call = route_request_from_call("r", (wire("r", cache_salt),), {}, "deployment-7")
    assert list(call.prompt_block_hashes(BLOCK_SIZE)) == expected
    group = route_group_from_call("g", [wire("g", cache_salt), wire("h", None)], "deployment-7")
    assert list(group.prompt_block_hashes(BLOCK_SIZE)) == expected  # the first request's
    # Without the deployment's salt, or under another cache_salt, nothing matches.
    unsalted = route_request_from_call("r", (wire("r", cache_salt),), {})
    other = route_request_from_call("r", (wire("r", "tenant-b"),), {}, "deployment-7")
    for request in (unsalted, other):
        assert not set(request.prompt_block_hashes(BLOCK_SIZE)) & set(expected)


def test_router_without_salts_hashes_as_before():
    call = route_request_from_call("r", (wire("r", None),), {})
    assert list(call.prompt_block_hashes(BLOCK_SIZE)) == prefix_block_hashes(PROMPT, BLOCK_SIZE)


def test_an_app_draws_a_random_prefix_salt_unless_given():
    config = ClusterConfig(model="gpt2-tiny")
    assert config.prefix_salt == ""
    first, second = with_prefix_salt(config), with_prefix_salt(config)
    assert len(first.prefix_salt) == 32 and first.prefix_salt != second.prefix_salt
    # The replicas' engines and the request routers get the same salt.
    assert first.engine.prefix_salt == first.router_config().prefix_salt == first.prefix_salt
    given = ClusterConfig(model="gpt2-tiny", prefix_salt="from-yaml")
    assert with_prefix_salt(given).prefix_salt == "from-yaml"
    assert "from-yaml" not in repr(given)


def test_both_openai_routes_carry_cache_salt_into_sampling_params():
    completion = parse(CompletionRequest, {"prompt": [1, 2], "cache_salt": "tenant-a"})
    assert completion.engine_params().cache_salt == "tenant-a"
    messages = [{"role": "user", "content": "hi"}]
    chat = parse(ChatCompletionRequest, {"messages": messages, "cache_salt": "tenant-b"})
    assert chat.engine_params().cache_salt == "tenant-b"
    assert parse(CompletionRequest, {"prompt": [1, 2]}).engine_params().cache_salt is None
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            parse(ChatCompletionRequest, {"messages": messages, "cache_salt": bad}).engine_params()
