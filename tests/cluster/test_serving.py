"""A real local Ray + Serve app of 2 gpt2-tiny replicas on CPU, through Client and HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from cluster import Client
from replica import LLMEngine, SamplingParams

if TYPE_CHECKING:
    from tests.cluster.conftest import RunningApp

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

PROMPTS = [[464, 329, 318], [40, 88], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(running_app: RunningApp) -> list[list[int]]:
    """The same model generated offline in this process: what the cluster must reproduce."""
    config = running_app.config.engine_config("offline", num_gpus=0)
    engine = LLMEngine(config)
    return [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]


async def _collect(client: Client, prompt: list[int], params: SamplingParams) -> list:
    return [chunk async for chunk in client.stream(prompt, params)]


def test_generate_equals_offline(running_app: RunningApp, offline: list[list[int]]) -> None:
    for prompt, expected in zip(PROMPTS, offline):
        done = running_app.client.generate(prompt, GREEDY)
        assert done.token_ids == expected
        assert done.finish_reason == "length"
        assert done.prompt_token_ids == prompt


@pytest.mark.parametrize("serve_grpc", [True, False], ids=["grpc", "actor-calls"])
def test_concurrent_streams_in_order_and_complete(
    running_app: RunningApp, offline: list[list[int]], serve_grpc: bool
) -> None:
    """Both of Serve's paths to a replica: its gRPC server (the default), Ray actor calls."""
    client = Client(running_app.client.app_name, serve_grpc=serve_grpc)

    async def burst() -> list[list]:
        jobs = [_collect(client, p, GREEDY) for p in PROMPTS * 4]
        return await asyncio.gather(*jobs)

    results = asyncio.run(burst())
    replicas = set()
    for chunks, expected in zip(results, offline * 4):
        assert [t for c in chunks for t in c.token_ids] == expected
        assert [c.finish_reason for c in chunks][-1] == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])
        replicas.add(chunks[-1].replica_id)
    assert replicas  # every chunk names the replica that served it


def test_http_completions_equal_offline(running_app: RunningApp, offline: list[list[int]]) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=running_app.base_url, timeout=60) as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == offline[0]
        assert choice["finish_reason"] == "length"

        events = []
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert [t for c in chunks for t in c["token_ids"]] == offline[0]
        assert chunks[-1]["finish_reason"] == "length"

        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["data"][0]["id"] == "gpt2-tiny"
        assert len(http.get("/stats").json()["replicas"]) == 2


def test_bad_input_is_a_typed_error_while_others_are_served(
    running_app: RunningApp, offline: list[list[int]]
) -> None:
    client = running_app.client

    async def scenario() -> list:
        good = asyncio.create_task(_collect(client, PROMPTS[2], GREEDY))
        for prompt, field in (([], "prompt_token_ids"), ([10**6], "prompt_token_ids[0]")):
            with pytest.raises(ValueError, match=field.replace("[", r"\[")):
                await _collect(client, prompt, GREEDY)
        with pytest.raises(ValueError, match="max_tokens"):
            await _collect(client, [1, 2], SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="prompt: text prompts need a model with a tokenizer"):
            await _collect(client, "hello", GREEDY)
        return await good

    chunks = asyncio.run(scenario())
    assert [t for c in chunks for t in c.token_ids] == offline[2]

    with httpx.Client(base_url=running_app.base_url, timeout=60) as http:
        for body, field in (
            ({"prompt": [], "max_tokens": 4}, "prompt_token_ids"),
            ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
            ({"prompt": [1, 2], "top_p": 2.0}, "top_p"),
            ({"prompt": [1, 2], "stop": "x"}, "stop"),  # gpt2-tiny has no tokenizer
        ):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400, response.text
            assert field in response.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
    assert running_app.client.generate(PROMPTS[1], GREEDY).token_ids == offline[1]


def test_stats_fresh_and_one_per_replica(running_app: RunningApp) -> None:
    stats = running_app.client.stats()
    assert len(stats) == 2
    assert len({s.replica_id for s in stats}) == 2
    now_s = time.time()
    for s in stats:
        assert abs(now_s - s.timestamp_s) < 1.0
        assert s.num_blocks_total == running_app.config.num_blocks


def _all_idle(client: Client) -> bool:
    return all(
        s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0 for s in client.stats()
    )


def test_client_abort_frees_blocks(running_app: RunningApp) -> None:
    client = running_app.client
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def start_then_abandon() -> float:
        chunks = client.stream(list(range(1, 65)), long)
        await chunks.__anext__()
        # Stats are as fresh as the stats period: wait for a snapshot taken mid-request.
        busy = 0.0
        deadline_s = time.monotonic() + 10
        while busy == 0 and time.monotonic() < deadline_s:
            await chunks.__anext__()
            busy = max(s.kv_usage for s in await client.stats_async())
        await chunks.aclose()  # the caller walks away mid-request
        return busy

    assert asyncio.run(start_then_abandon()) > 0
    deadline_s = time.monotonic() + 10
    while not _all_idle(client):
        assert time.monotonic() < deadline_s, client.stats()
        time.sleep(0.1)
