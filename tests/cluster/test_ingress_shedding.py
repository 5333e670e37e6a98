"""An ingress replica sheds new completions while its own event loop runs late (issue 48).

Unit part (no Ray): the lag meter reads a loop busy on every pass over the bound, and an
idle one or one stall under it; its readings are the window's median lag and CPU share;
the shedder refuses a busy late loop with a Retry-After, not one late while its process
ran little (waiting for the host's CPU), and nothing when it is off; the config field is
validated and reaches the ingress; a request's client gone by the time its body is read
shows as disconnected (what the ingress checks before routing). Ray part, one app of a
model-free replica whose ingress reads its loop as late and busy: its completions and
chats get 503 + Retry-After at once, before their bodies are read, counted in /metrics,
while /health, /stats and /metrics answer.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request

from bench.cluster import fake_engine
from cluster import ClusterConfig, build_app
from cluster.ingress_load import PERIOD_S, WINDOW, LoopLagMeter, LoopLagShedder

BOUND_S = 0.1  # ClusterConfig.ingress_max_loop_lag_s's default


def test_a_loop_late_on_every_wake_up_reads_over_the_bound_and_one_stall_does_not() -> None:
    def spin(seconds: float) -> None:
        until_s = time.monotonic() + seconds
        while time.monotonic() < until_s:
            pass

    async def scenario() -> tuple[float, float, float, float]:
        meter = LoopLagMeter()
        meter.start()
        await asyncio.sleep(0.3)  # idle: ~15 wake-ups, each a little late at most
        idle_s = meter.lag_s()
        time.sleep(0.3)  # one stall: one wake-up late, the median of five is not
        await asyncio.sleep(0.1)
        stalled_s = meter.lag_s()
        for _ in range(WINDOW + 1):  # every pass 0.15 s of the loop's own work
            spin(0.15)
            await asyncio.sleep(0)
        busy_s, cores = meter.lag_s(), meter.busy_cores()
        meter.stop()
        return idle_s, stalled_s, busy_s, cores

    idle_s, stalled_s, busy_s, cores = asyncio.run(scenario())
    assert idle_s < BOUND_S / 2, idle_s
    assert stalled_s < BOUND_S / 2, stalled_s
    assert busy_s > BOUND_S, busy_s
    assert cores > 0.0, cores  # how much of a core the spinning got depends on the host


def test_the_readings_are_the_median_lag_and_the_cpu_share_of_the_window() -> None:
    meter = LoopLagMeter(window=3, clock=lambda: 0.0)
    meter.wakes.append((0.0, 0.0, 0.0))  # where start() anchors the window
    meter.observe(0.2, 0.2, 0.18)
    meter.observe(-0.001, 0.22, 0.19)  # a little early counts as on time
    assert (meter.lag_s(), meter.busy_cores()) == (0.0, 0.0)  # until the window is full
    meter.observe(0.3, 0.54, 0.5)
    assert meter.lag_s() == 0.2  # median of 0.2, 0, 0.3
    assert meter.busy_cores() == pytest.approx(0.5 / 0.54)
    meter.observe(0.25, 0.81, 0.52)  # the oldest wake-up leaves the window
    assert meter.lag_s() == 0.25
    assert meter.busy_cores() == pytest.approx((0.52 - 0.18) / (0.81 - 0.2))
    with pytest.raises(ValueError, match="period_s"):
        LoopLagMeter(period_s=0)


def _shed_at(lag_s: float, cores: float, bound_s: float | None) -> object:
    """The shedder's answer (and whether it started its meter) with the meter's window
    reading lag_s on every wake-up while the process ran `cores`."""

    async def scenario() -> object:
        meter = LoopLagMeter(clock=lambda: 0.0, cpu_clock=lambda: 0.0)
        shedder = LoopLagShedder(bound_s, meter)
        shedder.start()
        for i in range(1, WINDOW + 1):
            meter.observe(lag_s, i * (PERIOD_S + lag_s), cores * i * (PERIOD_S + lag_s))
        try:
            return shedder.check(), meter.timer is not None
        finally:
            meter.stop()

    return asyncio.run(scenario())


def test_the_shedder_refuses_a_busy_loop_past_the_bound_with_a_retry_after() -> None:
    assert _shed_at(0.05, 1.0, BOUND_S) == (None, True)
    refused, started = _shed_at(0.3, 0.9, BOUND_S)
    assert started and refused.retry_after_s == LoopLagShedder.RETRY_AFTER_S == 1.0
    assert "ingress_max_loop_lag_s" in refused.reason and "300 ms" in refused.reason
    assert "0.90 cores" in refused.reason
    # As late, but the process ran 0.2 cores: it waits for the host's CPU, not its work.
    assert _shed_at(0.3, 0.2, BOUND_S) == (None, True)
    assert _shed_at(10.0, 1.0, None) == (None, False)  # off: never measures, never sheds
    assert LoopLagShedder(None).loop_lag_s() is None  # nor shows a lag on /metrics
    with pytest.raises(ValueError, match="max_loop_lag_s"):
        LoopLagShedder(0.0)
    with pytest.raises(ValueError, match="min_busy_cores"):
        LoopLagShedder(0.1, min_busy_cores=-1)


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


class LateBusyLoop(LoopLagMeter):
    """A loop read as 1 s late while its process runs a whole core: an idle ingress's
    own reading is ~0.3 ms, or 0 where uvloop's millisecond timers fire early."""

    def lag_s(self) -> float:
        return 1.0

    def busy_cores(self) -> float:
        return 1.0


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
        app_name=APP_NAME,
    )
    app = build_app(config, engine_factory=functools.partial(fake_engine, step_s=0.002))
    app._bound_deployment.init_kwargs["loop_lag_meter_factory"] = LateBusyLoop
    with local_serve(num_cpus=4) as url:
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield url


def _shed_count(http: httpx.Client) -> float:
    """This ingress replica's refusals for its late loop (/metrics), after checking that
    /metrics shows the lag it measures, which is past the bound."""
    response = http.get("/metrics")
    assert response.status_code == 200
    text = response.text
    (lag,) = re.findall(r"^kvfleet:ingress_event_loop_lag_seconds\{.*\} (\S+)$", text, re.M)
    assert float(lag) == 1.0
    pattern = r'^kvfleet:admissions_rejected_total\{[^}]*stage="ingress"[^}]*\} (\S+)$'
    (value,) = re.findall(pattern, text, re.MULTILINE)
    return float(value)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_late_loop_sheds_completions_at_once_and_still_answers_health(base_url: str) -> None:
    """Completions and chats get 503 + Retry-After at once, a body that is not JSON too
    (400 without shedding: tests/cluster/test_bad_input), counted in /metrics; /health,
    /stats and /metrics answer. With shedding off the ingress never checks the lag
    (test_the_shedder_refuses_a_busy_loop_past_the_bound_with_a_retry_after), and every
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
