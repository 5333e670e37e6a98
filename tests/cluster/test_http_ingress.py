"""The HTTP path: several ingress replicas, Serve's HAProxy in front of them, and the SSE
events written without pydantic (cluster.sse)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from cluster import ClusterConfig, build_app
from cluster.app import (
    HAPROXY_CLIENT_TIMEOUT_ENV,
    HAPROXY_ENV,
    HAPROXY_RETRY_ON_ENV,
    INGRESS_NUM_CPUS,
    THROUGHPUT_ENV,
    app_builder,
    check_http_proxy,
)
from cluster.openai_api import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from cluster.sse import ChatDeltas, CompletionChunks
from tests.cluster.haproxy_env import wait_for_ingress_replicas_up
from tests.cluster.local_ray import free_port, init_local_ray

APP_NAME = "kvfleet-ingress"
DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
TEXTS = ["", "plain", 'say "hi"\\n', "naïve café ✓ 日本", "tab\tnew\nline \x01", "😀 \\u00e9"]


def _data(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: ") : -2])


# --- without Ray -----------------------------------------------------------------------


def test_config_fields() -> None:
    config = ClusterConfig()
    assert (config.ingress_replicas, config.http_proxy) == (2, "haproxy")
    for bad in ({"ingress_replicas": 0}, {"ingress_replicas": 1.5}, {"http_proxy": "nginx"}):
        (name,) = bad
        with pytest.raises(ValueError, match=name):
            ClusterConfig(**bad)
    from cluster.__main__ import _parser, serve_config

    args = ["serve", "--ingress-replicas", "3", "--http-proxy", "serve"]
    config = serve_config(_parser().parse_args(args))
    assert (config.ingress_replicas, config.http_proxy) == (3, "serve")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--http-proxy", "nginx"])


@pytest.mark.parametrize("replicas", [1, 3])
def test_build_app_sizes_the_ingress(replicas: int) -> None:
    config = ClusterConfig(http=True, num_replicas=2, ingress_replicas=replicas)
    ingress = build_app(config, num_gpus_in_cluster=0)._bound_deployment
    assert ingress.name == "Ingress" and ingress.num_replicas == replicas
    assert ingress.ray_actor_options["num_cpus"] == INGRESS_NUM_CPUS == 0
    (llm,) = ingress.init_args[:1]
    assert llm._bound_deployment.num_replicas == 2  # the LLM replicas stay as asked


def test_check_http_proxy() -> None:
    with pytest.raises(ValueError, match=f"http_proxy.*{HAPROXY_ENV}=1"):
        check_http_proxy(ClusterConfig(http=True), cluster_haproxy=False)
    check_http_proxy(ClusterConfig(http=True), cluster_haproxy=True)
    check_http_proxy(ClusterConfig(http=True, http_proxy="serve"), cluster_haproxy=False)
    check_http_proxy(ClusterConfig(http=False), cluster_haproxy=False)  # no HTTP, no proxy


def test_app_builder_checks_the_cluster_env() -> None:
    """app_builder runs where Serve builds the app, on the cluster: its constants are the
    cluster's. A fresh interpreter, since Serve reads the variable once, at import."""
    code = (
        "from cluster.app import app_builder\n"
        "try:\n    app_builder({'http': True})\nexcept ValueError as e:\n    print('refused', e)\n"
        "else:\n    print('built')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (HAPROXY_ENV, THROUGHPUT_ENV)}
    for value, expected in (("0", "refused http_proxy"), ("1", "built")):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env | {HAPROXY_ENV: value},
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout  # fmt: skip
        assert out.startswith(expected), out
    assert app_builder({"http": True, "http_proxy": "serve"}) is not None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(
    ("finish_reason", "token_ids"), [(None, [5]), ("stop", [1, 2, 3]), ("length", [])]
)
def test_fast_completion_event_equals_pydantic(
    text: str, finish_reason: str | None, token_ids: list[int]
) -> None:
    head = CompletionResponse(id="cmpl-1", model='m "q" ✓', choices=[])
    fast = CompletionChunks(head).event(3, text, finish_reason, token_ids)
    choice = CompletionChoice(index=3, text=text, finish_reason=finish_reason, token_ids=token_ids)
    model = head.model_copy(update={"choices": [choice], "usage": None})
    assert _data(fast) == json.loads(model.model_dump_json())


@pytest.mark.parametrize("text", TEXTS[1:])
def test_fast_chat_event_equals_pydantic(text: str) -> None:
    head = ChatCompletionChunk(id="chatcmpl-1", model="tiny", choices=[])
    fast = ChatDeltas(head).event(1, text)
    choice = ChatChunkChoice(index=1, delta=ChatDelta(content=text))
    model = head.model_copy(update={"choices": [choice], "usage": None})
    assert _data(fast) == json.loads(model.model_dump_json())


# --- a local Ray: two ingress replicas behind HAProxy ----------------------------------


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A local Ray whose Serve runs HAProxy (the variables are set before Ray starts, as
    `python -m cluster serve` does), and an app with two ingress replicas."""
    import ray
    from ray import serve

    from cluster.app import cluster_runs_haproxy, set_ray_env

    config = ClusterConfig(
        model="gpt2-tiny", num_replicas=1, num_blocks=128, max_num_seqs=16, device="cpu",
        http=True, ingress_replicas=2, app_name=APP_NAME,
    )  # fmt: skip
    # An ingress replica drains 30 s by default before it stops, which Serve's shutdown
    # at the end of the module would wait out; HAProxy's stats and metrics ports are fixed
    # by default (8404, 9101), and a second Ray with HAProxy on this host would take them.
    test_env = {DRAINING_ENV: "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}  # fmt: skip
    # set_ray_env also sets HAProxy's client timeout and retry policy: put them back too.
    names = (HAPROXY_ENV, THROUGHPUT_ENV, HAPROXY_CLIENT_TIMEOUT_ENV, HAPROXY_RETRY_ON_ENV)
    saved = {k: os.environ.get(k) for k in (*names, *test_env)}
    set_ray_env(config)
    os.environ.update(test_env)
    try:
        init_local_ray(num_cpus=2)  # the LLM replica takes 1: each ingress asks for none
        try:
            assert cluster_runs_haproxy()
            check_http_proxy(config, cluster_runs_haproxy())
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stream(base_url: str, max_tokens: int) -> tuple[list[int], str, str | None]:
    """One streamed completion on a connection of its own (HAProxy balances connections)."""
    body = {"prompt": [46, 329, 31], "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    token_ids, text, finish = [], "", None
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        (choice,) = json.loads(line[len("data: ") :])["choices"]
        token_ids += choice["token_ids"]
        text += choice["text"]
        finish = choice["finish_reason"] or finish
    return token_ids, text, finish


def _admitted_by_ingress(base_url: str) -> dict[str, float]:
    """Requests each ingress replica's router admitted, from /metrics scraped on fresh
    connections until every ingress replica has answered one (or 20 tries)."""
    admitted: dict[str, float] = {}
    for _ in range(20):
        text = httpx.get(f"{base_url}/metrics", timeout=30.0).text
        for line in text.splitlines():
            if line.startswith("kvfleet:routing_decisions_total{"):
                ingress = line.split('ingress="')[1].split('"')[0]
                admitted[ingress] = float(line.split()[-1])  # one line: one LLM replica
        if len(admitted) == 2:
            break
    return admitted


def test_two_ingress_replicas_behind_haproxy(base_url: str) -> None:
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments["Ingress"]
    assert status.replica_states.get("RUNNING") == 2
    wait_for_ingress_replicas_up(APP_NAME, 2)
    assert httpx.get(f"{base_url}/health", timeout=30.0).json() == {"status": "ok"}
    runs = [_stream(base_url, 8) for _ in range(6)]
    # Greedy: every stream is the same, whichever ingress replica wrote its events.
    assert all(run == runs[0] for run in runs)
    token_ids, text, finish = runs[0]
    assert len(token_ids) == 8 and finish == "length" and text == ""  # gpt2-tiny: no tokenizer
    admitted = _admitted_by_ingress(base_url)
    assert len(admitted) == 2 and all(n > 0 for n in admitted.values()), admitted
    assert sum(admitted.values()) == 6
    body = {"prompt": [46], "max_tokens": 4, "stream": True, "logprobs": 1, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60.0) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    # Logprobs take the pydantic path beside the fast one: one per token.
    logprobs = [json.loads(e[6:])["choices"][0]["logprobs"] for e in events]
    assert sum(len(lp["tokens"]) for lp in logprobs) == 4
