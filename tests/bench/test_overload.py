"""bench.overload against a local aiohttp server that streams, refuses (503) or hangs, and
whose /stats says busy for a while: every request is accounted for, the time to idle is
measured, and the step's figures and the targets' verdicts follow from the records."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.common import percentile
from bench.front import rss_mb
from bench.load_metrics import RequestRecord
from bench.overload import (
    HEADER,
    _row,
    front_cpu_fractions,
    generator_behind,
    main,
    measure_capacity,
    open_loop_step,
    step_summary,
    verdicts,
)
from bench.overload_generators import GeneratorPool, Workload, default_num_procs
from tests.bench.test_load_http import FakeIngress


class FakeServer(FakeIngress):
    """Request i: a 503 when i % 3 == 1, no answer at all when i == 2, else a stream;
    /stats: busy for the first `busy_polls` polls."""

    def __init__(self, busy_polls: int) -> None:
        super().__init__()
        self.num_requests = 0
        self.busy_polls = busy_polls

    async def completions(self, request: web.Request) -> web.StreamResponse:
        i, self.num_requests = self.num_requests, self.num_requests + 1
        self.script = "503" if i % 3 == 1 else "ok"
        if i == 2:
            await asyncio.sleep(60)
        return await super().completions(request)

    async def stats(self, request: web.Request) -> web.Response:
        self.busy_polls -= 1
        busy = int(self.busy_polls > 0)
        return web.json_response({"replicas": [{"num_running": busy, "num_waiting": 0}]})


async def _serving(server: FakeServer, *steps: Callable[[str], Awaitable]) -> list:
    """Run each step (given the server's URL) in turn against the server; their results."""
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/stats", server.stats)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    try:
        url = str(test_server.make_url("")).rstrip("/")
        return [await step(url) for step in steps]
    finally:
        await test_server.close()


def test_an_open_loop_step_accounts_for_every_request() -> None:
    server = FakeServer(busy_polls=6)
    workload = Workload(input_len=8, output_len=4, vocab_size=100, timeout_s=1.0)
    # This process stands in for an ingress replica: it sends the requests (pool None).
    front = {"ingress": [os.getpid()], "proxy": []}
    step = partial(
        open_loop_step, workload=workload, rate=40.0, duration_s=0.5, seed=1, headers={},
        front=front,
    )  # fmt: skip
    (result,) = asyncio.run(_serving(server, step))
    records, samples = result.records, result.samples
    idle_after_load_s, idle_after_last_s = result.idle_after_load_s, result.idle_after_last_s
    assert samples and set(samples) <= {(0, 0), (1, 0)}
    assert len(records) == server.num_requests > 6  # ~20 Poisson arrivals
    summary = step_summary(records, 0.5, ttft_slo_ms=1000.0)
    assert summary["lost"] == 1 and "client timeout" in records[2].error_message
    assert summary["rejected"] == len(range(1, len(records), 3))
    assert summary["completed"] == len(records) - summary["rejected"] - 1
    assert summary["goodput_rps"] == summary["completed"] / 0.5
    assert 0 < summary["reject_p50_ms"] <= summary["reject_p99_ms"] < 1000
    assert server.busy_polls <= 0  # idle only once /stats said so
    assert idle_after_load_s is not None and idle_after_load_s >= 0.05  # polled until idle
    assert idle_after_last_s is not None and idle_after_last_s <= idle_after_load_s
    assert 0 < result.generator_cpu_max < 2 and result.generator_cpu_s > 0
    (ingress_cpu,) = result.front_cpu["ingress"]
    assert 0 < ingress_cpu < os.cpu_count() and result.front_cpu["proxy"] == []


def test_front_cpu_is_each_process_share_of_a_core_and_shows_in_the_table() -> None:
    before = {"ingress": [10.0, 20.0], "proxy": [5.0]}
    after = {"ingress": [10.5, 21.8], "proxy": [5.2]}
    assert front_cpu_fractions(before, after, 2.0) == {
        "ingress": [0.25, pytest.approx(0.9)],
        "proxy": [pytest.approx(0.1)],
    }
    step = {
        "scale": 2.0, "rate_rps": 80.0, "offered": 160, "completed": 100, "rejected": 60,
        "errors": 0, "lost": 0, "goodput_rps": 50.0, "ttft_p50_ms": 30.0, "ttft_p99_ms": 90.0,
        "reject_p99_ms": 20.0, "idle_after_load_s": 0.5, "idle_after_last_response_s": 0.1,
        "generator_cpu_max": 0.3, "send_lag_p99_ms": 2.0, "ingress_cpu": [0.25, 0.9],
    }  # fmt: skip
    assert _row(step).split()[-1] == "0.25/0.90" and HEADER.endswith("ingress cpu")
    assert _row({**step, "ingress_cpu": []}).split()[-1] == "-"  # attached from elsewhere


def test_two_generator_processes_split_the_load_and_account_for_every_request() -> None:
    """The capacity loop and then an open-loop step on one pool of two processes: the
    merged records hold every arrival of the step once, each sent on time, at the step's
    Poisson rate, each with an outcome; the processes outlive a share."""
    server = FakeServer(busy_polls=3)
    workload = Workload(input_len=8, output_len=4, vocab_size=100, timeout_s=1.0)
    rate, duration_s = 120.0, 1.0

    async def capacity(url: str) -> tuple[float, float]:
        return await measure_capacity(url, workload, 4, 0.6, seed=2, pool=pool)

    async def step(url: str):
        server.num_requests = 0  # the step's third request to arrive hangs: lost
        return await open_loop_step(url, workload, rate, duration_s, 5, {}, pool=pool)

    pool = GeneratorPool(2)
    try:
        (capacity_rps, capacity_cpu_max), result = asyncio.run(_serving(server, capacity, step))
        assert all(proc.is_alive() for proc in pool.procs)  # the same processes did both
    finally:
        pool.close()
    assert capacity_rps > 5 and 0 < capacity_cpu_max < 2
    records = result.records
    assert [r.index for r in records] == list(range(len(records)))
    assert len(records) == server.num_requests
    summary = step_summary(records, duration_s, ttft_slo_ms=1000.0)
    outcomes = ("completed", "rejected", "errors", "lost")
    assert summary["offered"] == sum(summary[k] for k in outcomes)
    assert summary["lost"] == 1 and summary["errors"] == 0 and summary["rejected"] > 10
    # Poisson: 120 expected arrivals, a standard deviation of 11.
    assert abs(len(records) - rate * duration_s) < 4 * math.sqrt(rate * duration_s)
    lags_s = [r.sent_s - r.scheduled_s for r in records]
    assert min(lags_s) > -1e-3 and percentile(lags_s, 50) < 0.05  # never early, mostly on time
    assert max(r.sent_s for r in records) < duration_s + 0.1
    assert 0 < result.generator_cpu_max < 2 and result.generator_cpu_s > 0


def test_generator_processes_follow_the_offered_rate_within_the_host() -> None:
    assert default_num_procs(None, 16) == 14  # capacity not yet known: as many as allowed
    assert default_num_procs(1100.0, 16) == 8  # one per 150 req/s
    assert default_num_procs(1100.0, 4) == 2  # two cores left to the server
    assert default_num_procs(20.0, 2) == default_num_procs(None, 1) == 1
    with pytest.raises(ValueError, match="num_procs"):
        main(["--num-procs", "0", "--capacity", "10"])
    with pytest.raises(ValueError, match="capacity"):
        main(["--capacity", "0"])


def test_a_generator_is_flagged_when_it_saturates_its_core_or_sends_late() -> None:
    def step(cpu: float, lag_ms: float) -> dict:
        return {"generator_cpu_max": cpu, "send_lag_p99_ms": lag_ms}

    assert not generator_behind(step(0.5, 5.0))
    assert generator_behind(step(0.8, 5.0))  # a core's worth of work: its loop falls behind
    assert generator_behind(step(0.2, 900.0))  # no core to be had: late at a low CPU fraction


def _record(index: int, outcome: str, ttft_s: float = math.nan) -> RequestRecord:
    record = RequestRecord(index, 8, 4, 0.0, sent_s=1.0, end_s=1.02, outcome=outcome)
    if outcome == "ok":
        record.chunk_times_s, record.chunk_num_tokens = [ttft_s, ttft_s + 0.1], [1, 3]
    return record


def test_goodput_counts_only_completions_within_the_ttft_slo() -> None:
    records = [_record(0, "ok", 0.1), _record(1, "ok", 3.0), _record(2, "rejected")]
    records += [_record(3, "error"), _record(4, "lost")]
    summary = step_summary(records, 2.0, ttft_slo_ms=2000.0)
    assert (summary["completed"], summary["rejected"], summary["errors"]) == (2, 1, 1)
    assert summary["lost"] == 1 and summary["goodput_rps"] == 0.5
    assert summary["reject_p99_ms"] == summary["reject_p50_ms"] == pytest.approx(20.0)


def test_verdicts_hold_the_steps_to_the_issue_targets() -> None:
    def step(scale: float, goodput: float, reject_ms: float, lost: int, idle_s: float) -> dict:
        return {
            "scale": scale, "goodput_rps": goodput, "reject_p99_ms": reject_ms, "lost": lost,
            "idle_after_last_response_s": idle_s, "rss_mb": {"ingress": 110.0, "proxy": 100.0},
        }  # fmt: skip

    baseline = {"ingress": 100.0, "proxy": 100.0}
    good = [step(1, 40, math.nan, 0, 1.0), step(3, 37, 20, 0, 1.5), step(5, 36.5, 40, 0, 2.0)]
    assert all(verdicts(good, baseline).values())
    bad = [step(1, 40, math.nan, 0, 1.0), step(3, 30, 80, 2, 3.0)]
    bad[1]["rss_mb"]["ingress"] = 130.0
    assert not any(verdicts(bad, baseline).values())


def test_rss_reads_this_process_and_nothing_for_a_gone_one() -> None:
    assert rss_mb(os.getpid()) > 10
    assert rss_mb(2**22 + 7) == 0  # above Linux's default pid_max
