"""Overload at the front door (issue 48): refused at once, typed, with a Retry-After.

Unit part (no Ray): the queue bounds' config, and Serve's BackPressureError as
OverloadedError (Client) and 503 + Retry-After (ingress). Ray part, one app whose single
replica serves 2 sequences at a time with 20 ms steps (a PacedEngine over gpt2-tiny, so
its queue is real): a client gone while its request was queued costs the engine no
prefill; a backlog past max_queue_wait_s refuses new requests at once, as 503 with a
Retry-After over HTTP and OverloadedError in Python, while every admitted request
completes, and the replica is idle again once the load stops.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from ray.serve.exceptions import BackPressureError

from bench.cluster import paced_engine
from cluster import Client, ClusterConfig, build_app
from cluster.client import Completion
from cluster.ingress import _error_response
from cluster.transport import _submit_error
from replica import SamplingParams
from router import OverloadedError

APP_NAME = "kvfleet-overload"
MAX_QUEUE_WAIT_S = 0.5
STEP_S = 0.02
MAX_TOKENS = 25  # 0.5 s a request: with 2 slots the replica takes 4 requests a second
PROMPT = list(range(100, 164))  # 64 tokens (gpt2-tiny has 512)


def test_queue_bounds_are_validated_and_reach_serve() -> None:
    for name in ("max_queued_requests", "ingress_max_queued_requests"):
        for bad in (0, -2, 1.5, True):
            with pytest.raises(ValueError, match=name):
                ClusterConfig(model="gpt2-tiny", **{name: bad})
    with pytest.raises(ValueError, match="ingress_max_ongoing_requests"):
        ClusterConfig(model="gpt2-tiny", ingress_max_ongoing_requests=0)
    with pytest.raises(ValueError, match="backpressure_retry_after_s"):
        ClusterConfig(model="gpt2-tiny", backpressure_retry_after_s=0)
    config = ClusterConfig(
        model="gpt2-tiny",
        http=True,
        max_queued_requests=-1,
        ingress_max_ongoing_requests=64,
        ingress_max_queued_requests=8,
        backpressure_retry_after_s=3.0,
    )
    ingress = build_app(config, num_gpus_in_cluster=0)._bound_deployment
    llm = ingress.init_args[0]._bound_deployment
    assert (ingress.max_ongoing_requests, ingress.max_queued_requests) == (64, 8)
    assert ingress.backpressure_config.retry_after_s == 3.0
    assert llm.max_queued_requests == -1 and llm.backpressure_config.retry_after_s == 3.0


def test_a_full_serve_queue_is_overloaded_not_a_failure() -> None:
    full = BackPressureError(num_queued_requests=9, max_queued_requests=8, retry_after_s=2.5)
    error = _submit_error(full, "r1")
    assert isinstance(error, OverloadedError) and error.retry_after_s == 2.5
    assert "max_queued_requests=8" in error.reason
    untimed = _submit_error(BackPressureError(9, 8), "r1")
    assert isinstance(untimed, OverloadedError) and untimed.retry_after_s == 1.0
    response = _error_response(full)  # one the Client did not map still is a 503
    assert response.status_code == 503 and response.headers["retry-after"] == "3"


@dataclass(frozen=True)
class App:
    client: Client
    base_url: str


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    import ray
    from ray import serve

    from tests.cluster.local_ray import free_port, init_local_ray

    config = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=1,
        num_blocks=256,
        max_num_seqs=2,
        max_model_len=256,
        device="cpu",
        http=True,
        ingress_replicas=1,
        max_queue_wait_s=MAX_QUEUE_WAIT_S,
        app_name=APP_NAME,
    )
    factory = functools.partial(paced_engine, min_step_s=STEP_S)
    init_local_ray(num_cpus=2)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config, engine_factory=factory), name=APP_NAME, route_prefix="/")
        yield App(Client(APP_NAME), f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _wait_idle(client: Client, timeout_s: float = 20.0) -> list:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        stats = client.stats()
        if stats and all(s.num_running + s.num_waiting == 0 for s in stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout_s} s: {client.stats()}")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_client_gone_while_queued_costs_no_prefill(app: App) -> None:
    """Both slots busy for 2 s; a streamed request queued behind them whose client hangs
    up never has its prompt computed (prefix_query_tokens counts every admitted prompt)."""
    before = _wait_idle(app.client)[0].prefix_query_tokens

    async def scenario() -> None:
        long = [
            asyncio.ensure_future(app.client.generate_async(PROMPT, _params(100))) for _ in range(2)
        ]
        await asyncio.sleep(0.3)  # both running
        async with httpx.AsyncClient(base_url=app.base_url, timeout=10.0) as http:
            body = {"prompt": list(range(300, 377)), "max_tokens": 8, "stream": True}
            # Queued: the slots free in ~1.7 s, and the response starts with the first
            # token, so the client hangs up before it has a status.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(http.post("/v1/completions", json=body), 0.3)
        # the client is gone (its connection closed); the long ones go on
        done = await asyncio.gather(*long)
        assert [len(d.token_ids) for d in done] == [100, 100]

    asyncio.run(scenario())
    after = _wait_idle(app.client)[0].prefix_query_tokens
    assert after - before == 2 * len(PROMPT)  # not + 77: it never reached a slot


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_backlog_past_the_bound_is_refused_at_once(app: App) -> None:
    """40 requests at 25/s from the Client and as many over HTTP (each caller has its own
    router), to a replica that serves 4/s: once its queue holds more than
    MAX_QUEUE_WAIT_S of work, requests are refused at once with a Retry-After past the
    bound; everything admitted completes; the replica is idle soon after."""

    async def offer_python() -> list[Completion | BaseException]:
        tasks = []
        for _ in range(40):
            tasks.append(asyncio.ensure_future(app.client.generate_async(PROMPT, _params())))
            await asyncio.sleep(0.04)
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def post(http: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        start_s = time.monotonic()
        response = await http.post("/v1/completions", json=body)
        return response, time.monotonic() - start_s

    async def offer_http() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60.0) as http:
            tasks = []
            for _ in range(40):
                tasks.append(asyncio.ensure_future(post(http)))
                await asyncio.sleep(0.04)
            return await asyncio.gather(*tasks)

    async def scenario() -> tuple[list, list]:
        return await asyncio.gather(offer_python(), offer_http())

    outcomes, answers = asyncio.run(scenario())
    refused = [o for o in outcomes if isinstance(o, OverloadedError)]
    completed = [o for o in outcomes if isinstance(o, Completion)]
    assert len(refused) + len(completed) == len(outcomes), outcomes  # nothing else, none lost
    assert refused and completed
    assert all(len(c.token_ids) == MAX_TOKENS for c in completed)
    assert all("max_queue_wait_s" in e.reason for e in refused)
    assert all(e.retry_after_s > MAX_QUEUE_WAIT_S for e in refused)
    statuses = [r.status_code for r, _ in answers]
    assert set(statuses) == {200, 503}, statuses
    for response, elapsed_s in answers:
        if response.status_code == 503:
            assert response.json()["error"]["type"] == "overloaded"
            assert int(response.headers["retry-after"]) >= 1
            assert elapsed_s < 2.0  # at once, not after a wait
    _wait_idle(app.client, timeout_s=5.0)
