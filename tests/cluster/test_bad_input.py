"""Bad input at the cluster's entries (Client, raw submit wire, HTTP) while others are served.

Each bad request must fail with a clear error naming the field (ValueError in Python,
HTTP 400 with the field in the message, 413 for an oversized body), and a good stream
running concurrently must complete with exactly the offline engine's tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from cluster import Client, ClusterConfig, build_app
from cluster.ingress import MAX_BODY_BYTES
from cluster.transport import CallerTransport
from replica import LLMEngine, SamplingParams
from tests.cluster.local_ray import free_port, init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP_NAME = "kvfleet-bad-input"
MAX_MODEL_LEN = 256
GOOD_PROMPT = [464, 329, 318, 40, 88, 17]
GOOD = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class App:
    client: Client
    base_url: str
    expected: list[int]  # GOOD_PROMPT's tokens from an offline engine


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    import ray
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=1,
        num_blocks=64,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        device="cpu",
        http=True,
        app_name=APP_NAME,
    )
    engine = LLMEngine(config.engine_config("offline", num_gpus=0))
    expected = engine.generate([GOOD_PROMPT], GOOD)[0].token_ids
    del engine
    init_local_ray(num_cpus=2)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        yield App(Client(APP_NAME), f"http://127.0.0.1:{port}", expected)
    finally:
        serve.shutdown()
        ray.shutdown()


BAD_PROMPTS = [
    ([], "prompt_token_ids must not be empty"),
    ([1] * MAX_MODEL_LEN, "max_model_len"),
    ([1] * 10_000, "max_model_len"),  # longer than any replica's cache: not "overloaded"
    ([1, -1], r"prompt_token_ids\[1\]"),
    ([1, 512], r"prompt_token_ids\[1\]"),
    ([1, True], r"prompt_token_ids\[1\]"),
    ([1, 2.0], r"prompt_token_ids\[1\]"),
    ([1, "2"], r"prompt_token_ids\[1\]"),
    ([[1, 2]], r"prompt_token_ids\[0\]"),
    ("hello", "prompt: text prompts need a model with a tokenizer"),
    (None, "prompt: must be a string or a list of token ids"),
    ({"ids": [1]}, "prompt: must be a string or a list of token ids"),
]


async def _good_stream(client: Client) -> list[int]:
    return [t async for chunk in client.stream(GOOD_PROMPT, GOOD) for t in chunk.token_ids]


def test_client_bad_input_is_named_while_a_stream_runs(app: App) -> None:
    client = app.client

    async def scenario() -> list[int]:
        good = asyncio.create_task(_good_stream(client))
        for prompt, match in BAD_PROMPTS:
            with pytest.raises(ValueError, match=match):
                await client.generate_async(prompt, GOOD)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_tokens"):
            await client.generate_async([1, 2], SamplingParams(max_tokens=MAX_MODEL_LEN))
        with pytest.raises(ValueError, match="max_tokens"):
            await client.generate_async([1] * 200, SamplingParams(max_tokens=57))
        with pytest.raises(ValueError, match="params: must be SamplingParams"):
            await client.generate_async([1, 2], {"max_tokens": 4})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="request_id"):
            await anext(client.stream([1, 2], GOOD, request_id=""))
        return await good

    assert asyncio.run(scenario()) == app.expected


BAD_WIRE_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"seed": 2**64}, "seed"),  # past torch's range: would fail every step of the replica
    ({"top_k": 2**63}, "top_k"),
    ({"bogus": 1}, "bogus"),
]


def test_raw_submit_wire_is_validated_by_the_replica(app: App) -> None:
    """A caller bypassing Client (any handle user) still gets named errors, not a dead engine."""
    from ray import serve

    from cluster.client import LLM_DEPLOYMENT

    handle = serve.get_deployment_handle(LLM_DEPLOYMENT, APP_NAME)

    async def scenario() -> list[int]:
        good = asyncio.create_task(_good_stream(app.client))
        transport = CallerTransport(handle)
        for i, (fields, match) in enumerate(BAD_WIRE_PARAMS):
            params = SamplingParams(max_tokens=4).to_dict() | fields
            with pytest.raises(ValueError, match=match):
                await transport.submit(f"wire-{i}", [1, 2, 3], params)
        submit = handle.options(method_name="submit", stream=True)
        for wire, match in (
            ({"prompt_token_ids": [1]}, "request_id"),
            ({"request_id": "x", "caller_id": "c", "params": []}, "params"),
            ("not a dict", "request: must be a dict"),
        ):
            from cluster.transport import decode_message

            ack = decode_message(await anext(submit.remote(wire)))
            assert ack.error is not None and match in ack.error
        assert transport.num_in_flight == 0
        return await good

    assert asyncio.run(scenario()) == app.expected
    deadline_s = time.monotonic() + 5.0  # stats trail the engine by a stats period
    while (stats := app.client.stats()[0]).num_running or stats.num_waiting:
        assert time.monotonic() < deadline_s, stats
        time.sleep(0.05)
    assert stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks_total


def _bad_http_bodies() -> list[tuple[bytes, int, str]]:
    def body(**fields: object) -> bytes:
        return json.dumps({"prompt": [1, 2, 3], "max_tokens": 4} | fields).encode()

    return [
        (body(prompt=[]), 400, "prompt_token_ids"),
        (body(prompt=[1] * 300), 400, "max_model_len"),
        (body(prompt=[1, -5]), 400, "prompt_token_ids[1]"),
        (body(prompt=[1, 99999]), 400, "prompt_token_ids[1]"),
        (body(prompt=[1, True]), 400, "prompt_token_ids[1]"),
        (body(prompt=[1, 2.5]), 400, "prompt_token_ids[1]"),
        (body(prompt=[1, "x"]), 400, "prompt_token_ids[1]"),
        (body(prompt="hello"), 400, "prompt"),  # gpt2-tiny has no tokenizer
        (body(prompt=[[1], "x"]), 400, "prompt"),  # a list of prompts mixes kinds
        (body(prompt=None), 400, "prompt"),
        (body(max_tokens=0), 400, "max_tokens"),
        (body(max_tokens=-1), 400, "max_tokens"),
        (body(max_tokens="5"), 400, "max_tokens"),
        (body(max_tokens=1.5), 400, "max_tokens"),
        (body(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
        (body(temperature=-1), 400, "temperature"),
        (b'{"prompt": [1, 2], "temperature": NaN}', 400, "temperature"),
        (b'{"prompt": [1, 2], "temperature": Infinity}', 400, "temperature"),
        (body(top_p=0), 400, "top_p"),
        (body(top_p=1.5), 400, "top_p"),
        (body(top_k=-5), 400, "top_k"),
        (body(top_k="x"), 400, "top_k"),
        (body(seed=2**64), 400, "seed"),
        (body(stop_token_ids=[-1]), 400, "stop_token_ids"),
        (body(ignore_eos="yes"), 400, "ignore_eos"),
        (body(stream="yes"), 400, "stream"),
        (body(n=0), 400, "n"),
        (body(n=2, best_of=1), 400, "best_of"),
        (body(model="other-model"), 400, "model"),
        (body(stop=[1]), 400, "stop"),
        (body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        (body(logprobs=21), 400, "logprobs"),
        (body(suffix="x"), 400, "suffix"),  # known, not supported
        (body(stream_options={"include_usage": "x"}), 400, "stream_options"),
        (b'{"prompt": [1, 2', 400, "JSON"),
        (b"\xff\xfe not utf-8", 400, "JSON"),
        (b"[1, 2, 3]", 400, "JSON object"),
        (b"", 400, "JSON"),
        (b'{"prompt": [' + b"1, " * (MAX_BODY_BYTES // 3) + b"1]}", 413, "limit"),
    ]


def test_http_bad_input_is_400_naming_the_field_while_a_stream_runs(app: App) -> None:
    good_body = {
        "prompt": GOOD_PROMPT,
        "max_tokens": GOOD.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def good_sse(http: httpx.AsyncClient) -> list[int]:
        tokens: list[int] = []
        async with http.stream("POST", "/v1/completions", json=good_body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line.removeprefix("data: "))
                    assert "error" not in event, event
                    tokens += event["choices"][0]["token_ids"]
        return tokens

    async def bad(http: httpx.AsyncClient, content: bytes, status: int, field: str) -> None:
        headers = {"content-type": "application/json"}
        response = await http.post("/v1/completions", content=content, headers=headers)
        assert response.status_code == status, (content[:80], response.text)
        assert field in response.json()["error"]["message"], (content[:80], response.text)

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as http:
            good = asyncio.create_task(good_sse(http))
            await asyncio.gather(*(bad(http, *case) for case in _bad_http_bodies()))
            return await good

    assert asyncio.run(scenario()) == app.expected
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        response = http.post("/v1/completions", json={"prompt": GOOD_PROMPT, "max_tokens": 4})
        assert response.status_code == 200
