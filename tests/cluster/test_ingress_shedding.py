"""An ingress replica sheds new completions while its own event loop runs late (issue 48).

Unit part (no Ray): the lag meter reads a loop blocked by time.sleep over the bound and an
idle one under it; its average weighs a wake-up by the time it covers; the shedder's
Retry-After follows the lag and nothing is shed when it is off; the config field is
validated and reaches the ingress; a request's client gone by the time its body is read
shows as disconnected (what the ingress checks before routing). Ray part, one app of a
model-free replica whose bound (1 us) every measured lag is past: its completions and
chats get 503 + Retry-After at once, before their bodies are read, counted in /metrics,
while /health, /stats and /metrics answer.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request

from bench.cluster import fake_engine
from cluster import ClusterConfig, build_app
from cluster.ingress_load import LoopLagMeter, LoopLagShedder

BOUND_S = 0.1  # ClusterConfig.ingress_max_loop_lag_s's default


def test_a_blocked_loop_reads_over_the_bound_and_an_idle_one_under_it() -> None:
    async def scenario() -> tuple[float, float, float]:
        meter = LoopLagMeter()
        meter.start()
        await asyncio.sleep(0.3)  # idle: ~15 wake-ups, each a little late at most
        idle_s = meter.lag_s()
        time.sleep(0.3)  # the loop is stuck: the pending wake-up is overdue by now
        overdue_s = meter.lag_s()
        await asyncio.sleep(0.02)  # the late wake-up has been observed
        smoothed_s = meter.smoothed_lag_s
        meter.stop()
        return idle_s, overdue_s, smoothed_s

    idle_s, overdue_s, smoothed_s = asyncio.run(scenario())
    assert idle_s < BOUND_S / 2, idle_s
    assert overdue_s >= 0.28, overdue_s
    # One 0.3-s stall moves the average by 1 - exp(-0.32 / TAU_S) = 0.47 of itself.
    assert BOUND_S < smoothed_s < 0.3, smoothed_s


def test_the_average_weighs_each_wake_up_by_the_time_it_covers() -> None:
    meter = LoopLagMeter(clock=lambda: 0.0)
    meter.observe(0.3, 0.31)
    assert meter.smoothed_lag_s == pytest.approx(0.3 * (1 - math.exp(-0.62)))
    for _ in range(100):  # 2 s of prompt wake-ups: back near 0
        meter.observe(0.0001, 0.0201)
    assert meter.smoothed_lag_s < 0.005
    meter.observe(-0.001, 0.009)  # a wake-up a little early counts as on time
    assert meter.smoothed_lag_s >= 0.0
    with pytest.raises(ValueError, match="period_s"):
        LoopLagMeter(period_s=0)


def _shed_at(lag_s: float, bound_s: float | None) -> object:
    """The shedder's answer with the meter reading lag_s (its wake-up not yet overdue)."""

    async def scenario() -> object:
        meter = LoopLagMeter(clock=lambda: 0.0)
        shedder = LoopLagShedder(bound_s, meter)
        shedder.start()
        meter.smoothed_lag_s = lag_s
        try:
            return shedder.check(), meter.timer is not None
        finally:
            meter.stop()

    return asyncio.run(scenario())


def test_the_shedder_refuses_past_the_bound_with_a_retry_after_from_the_lag() -> None:
    assert _shed_at(0.05, BOUND_S) == (None, True)
    refused, started = _shed_at(0.3, BOUND_S)
    assert started and refused.retry_after_s == 1.0  # decays in 0.5 ln 3 = 0.55 s: at least 1
    assert "ingress_max_loop_lag_s" in refused.reason and "300 ms" in refused.reason
    refused, _ = _shed_at(10.0, BOUND_S)  # 100x the bound: 0.5 ln 100 = 2.3 s
    assert refused.retry_after_s == pytest.approx(0.5 * 4.605, rel=1e-3)
    assert _shed_at(10.0, None) == (None, False)  # off: never measures, never sheds
    assert LoopLagShedder(None).loop_lag_s() is None  # nor shows a lag on /metrics
    with pytest.raises(ValueError, match="max_loop_lag_s"):
        LoopLagShedder(0.0)


def test_the_bound_is_validated_and_reaches_the_ingress() -> None:
    for bad in (-0.1, float("inf"), True, "fast"):
        with pytest.raises(ValueError, match="ingress_max_loop_lag_s"):
            ClusterConfig(model="gpt2-tiny", ingress_max_loop_lag_s=bad)
    for value, expected in ((None, None), (0, 0), (0.25, 0.25)):
        config = ClusterConfig(model="gpt2-tiny", http=True, ingress_max_loop_lag_s=value)
        ingress = build_app(config, num_gpus_in_cluster=0)._bound_deployment
        assert ingress.init_kwargs["max_loop_lag_s"] == expected
    assert ClusterConfig(model="gpt2-tiny").ingress_max_loop_lag_s == BOUND_S


def _request(messages: list[dict]) -> Request:
    """A starlette Request whose receive hands out messages, then waits for ever."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()  # nothing more from a client still there
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_a_client_gone_by_the_time_its_body_is_read_shows_as_disconnected() -> None:
    body = {"type": "http.request", "body": b"{}", "more_body": False}

    async def scenario(messages: list[dict]) -> tuple[bytes, bool]:
        request = _request(messages)
        return await request.body(), await request.is_disconnected()

    assert asyncio.run(scenario([body, {"type": "http.disconnect"}])) == (b"{}", True)
    assert asyncio.run(scenario([body])) == (b"{}", False)  # still there: no wait, no loss


# --- one app on a local Ray -----------------------------------------------------------

APP_NAME = "kvfleet-shed"
COMPLETION = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    from ray import serve

    from tests.cluster.local_ray import local_serve

    config = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=1,
        max_num_seqs=8,
        device="cpu",
        http=True,
        ingress_replicas=1,
        # 1 us: every lag the meter measures (each wake-up is ~0.05-1 ms late) is past it.
        ingress_max_loop_lag_s=1e-6,
        app_name=APP_NAME,
    )
    factory = functools.partial(fake_engine, step_s=0.002)
    with local_serve(num_cpus=4) as url:
        serve.run(build_app(config, engine_factory=factory), name=APP_NAME, route_prefix="/")
        yield url


def _shed_count(http: httpx.Client) -> float:
    """This ingress replica's refusals for its late loop (/metrics), after checking that
    /metrics shows the lag it measures, which is past the bound."""
    response = http.get("/metrics")
    assert response.status_code == 200
    text = response.text
    (lag,) = re.findall(r"^kvfleet:ingress_event_loop_lag_seconds\{.*\} (\S+)$", text, re.M)
    assert float(lag) > 1e-6
    pattern = r'^kvfleet:admissions_rejected_total\{[^}]*stage="ingress"[^}]*\} (\S+)$'
    (value,) = re.findall(pattern, text, re.MULTILINE)
    return float(value)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_late_loop_sheds_completions_at_once_and_still_answers_health(base_url: str) -> None:
    """Completions and chats get 503 + Retry-After at once, a body that is not JSON too
    (400 without shedding: tests/cluster/test_bad_input), counted in /metrics; /health,
    /stats and /metrics answer. With shedding off the ingress never checks the lag
    (test_the_shedder_refuses_past_the_bound_with_a_retry_after_from_the_lag), and every
    other HTTP test runs at the default bound, under which its requests are served."""
    with httpx.Client(base_url=base_url, timeout=30.0) as http:
        assert http.get("/health").status_code == 200
        before = _shed_count(http)
        answers = []
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            start_s = time.monotonic()
            answers.append((http.post(path, json=body), time.monotonic() - start_s))
        answers.append((http.post("/v1/completions", content=b"{not json"), 0.0))
        for response, elapsed_s in answers:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "overloaded" and "ingress_max_loop_lag_s" in error["message"]
            assert int(response.headers["retry-after"]) >= 1
            assert elapsed_s < 2.0  # at once, not after a wait
        assert http.get("/health").status_code == 200
        assert http.get("/stats").status_code == 200
        assert _shed_count(http) - before == len(answers)
