"""Serving metrics: the Prometheus text format, the replica's counters and histograms
fed by the fan-out, the Grafana dashboard's queries, and GET /metrics of a real local
Serve app (two replicas) against the usage its responses report."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster import fake_engine
from cluster import ClusterConfig, build_app
from cluster.deployment import LLMServer
from cluster.fan_out import FanOut
from cluster.messages import CarrierBatch, SubmitRequest, decode_message
from cluster.metrics import (
    HISTOGRAMS,
    CallerMetrics,
    Histogram,
    MetricsSnapshot,
    ReplicaMetrics,
    exposition,
)
from cluster.prometheus import CONTENT_TYPE, Family, histogram_samples, render
from replica.outputs import RequestOutput, StepOutputs
from replica.stats import ReplicaStats
from tests.cluster.local_ray import local_serve

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json"
APP_NAME = "kvfleet-metrics"
MODEL_NAME = "tiny"

# --- the text format -----------------------------------------------------------------


def test_render_writes_the_exposition_format_exactly() -> None:
    families = [
        Family("a:up", "gauge", 'line one\nback\\slash "q"', [("a:up", {}, 1)]),
        Family(
            "a:done_total",
            "counter",
            "Done.",
            [("a:done_total", {"reason": 'st"o\\p\n'}, 3), ("a:done_total", {"r": "x"}, 0.5)],
        ),
        Family("a:t_seconds", "histogram", "T.",
               histogram_samples("a:t_seconds", {"replica": "r1"}, [0.1, 1.0], [2, 0, 1], 2.25)),
    ]  # fmt: skip
    assert render(families) == (
        '# HELP a:up line one\\nback\\\\slash "q"\n'
        "# TYPE a:up gauge\n"
        "a:up 1\n"
        "# HELP a:done_total Done.\n"
        "# TYPE a:done_total counter\n"
        'a:done_total{reason="st\\"o\\\\p\\n"} 3\n'
        'a:done_total{r="x"} 0.5\n'
        "# HELP a:t_seconds T.\n"
        "# TYPE a:t_seconds histogram\n"
        'a:t_seconds_bucket{replica="r1",le="0.1"} 2\n'
        'a:t_seconds_bucket{replica="r1",le="1.0"} 2\n'
        'a:t_seconds_bucket{replica="r1",le="+Inf"} 3\n'
        'a:t_seconds_sum{replica="r1"} 2.25\n'
        'a:t_seconds_count{replica="r1"} 3\n'
    )
    assert render([]) == ""
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_bad_families_and_histograms_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kind"):
        Family("x", "summary", "")
    with pytest.raises(ValueError, match="name"):
        Family("x", "counter", "")
    with pytest.raises(ValueError, match="counts"):
        histogram_samples("x", {}, [1.0], [1], 0.0)
    with pytest.raises(ValueError, match="bounds"):
        Histogram([1.0, 1.0])


def test_histogram_puts_a_bound_in_its_own_bucket_and_round_trips() -> None:
    h = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(value)
    h.observe(0.2, n=4)  # one step's rows at once
    assert h.counts == [2, 6, 1] and h.count == 9
    assert math.isclose(h.sum, 0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 0.8)
    back = Histogram.from_wire(json.loads(json.dumps(h.to_wire())))
    assert (back.bounds, back.counts, back.sum) == (h.bounds, h.counts, h.sum)


# --- the replica's figures through the fan-out ----------------------------------------


def test_fan_out_feeds_counters_and_histograms_per_step() -> None:
    """Two requests (prompts of 5 and 7 tokens): a's tokens at t=1, 1.5, 2 ending by
    length; b's first at 1.5, ended by an abort. The same through rows (RequestOutputs)
    gives the same figures."""
    for by_rows in (False, True):
        metrics = ReplicaMetrics()
        fan_out = FanOut(metrics)
        fan_out.track("a", "c", 0.5, 5)
        fan_out.track("b", "c", 1.0, 7)
        steps = [
            (StepOutputs(("a",), [1]), 1.0),
            (StepOutputs(("a", "b"), [2, 3]), 1.5),
            (StepOutputs(("a",), [4], {0: ("length", 5, 0)}), 2.0),
        ]
        for outputs, now_s in steps:
            fan_out.step(list(outputs) if by_rows else outputs, now_s)
        assert fan_out.abort("b") == "c" and fan_out.abort("b") is None
        assert (metrics.prompt_tokens, metrics.generation_tokens) == (12, 4)
        assert dict(metrics.finished) == {"length": 1, "abort": 1}
        assert metrics.ttft_s.count == 2 and math.isclose(metrics.ttft_s.sum, 0.5 + 0.5)
        assert metrics.itl_s.count == 2 and math.isclose(metrics.itl_s.sum, 0.5 + 0.5)
        assert metrics.tpot_s.count == 1 and math.isclose(metrics.tpot_s.sum, 0.5)
        assert metrics.e2e_s.count == 1 and math.isclose(metrics.e2e_s.sum, 1.5)
        fan_out.track("c", "c", 3.0)
        fan_out.step([RequestOutput("c", [])], 3.5)  # a prefill chunk: nothing counted
        assert metrics.generation_tokens == 4
        fan_out.fail_all()
        assert metrics.finished["error"] == 1


def test_an_engine_process_ships_its_totals_to_the_replica() -> None:
    """With the engine in a child process, the replica's snapshot catches up with the
    child's counters within a stats period or so."""
    config = ClusterConfig(model="fake", device="cpu", stats_period_s=0.05, engine_process=True)
    server = LLMServer(config, 0.0, fake_engine, replica_id="r0", gil_switch_interval_s=None)

    async def run() -> MetricsSnapshot:
        params = {"max_tokens": 5}
        async for data in server.submit(SubmitRequest("a", "c0", [1, 2, 3], params).to_wire()):
            message = decode_message(data)
            if isinstance(message, CarrierBatch) and any(s.finishes for s in message.steps):
                break
        deadline = time.monotonic() + 10.0
        while True:
            snapshot = MetricsSnapshot.from_wire(await server.metrics_snapshot())
            if snapshot.finished or time.monotonic() > deadline:
                return snapshot
            await asyncio.sleep(0.02)

    try:
        snapshot = asyncio.run(run())
    finally:
        server.shutdown()
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (3, 5)
    assert snapshot.finished == {"length": 1}
    assert snapshot.histograms["ttft_s"].count == snapshot.histograms["e2e_s"].count == 1
    assert snapshot.histograms["itl_s"].count == 4


# --- exposition and dashboard --------------------------------------------------------


def _snapshot(replica_id: str, metrics: ReplicaMetrics) -> MetricsSnapshot:
    stats = ReplicaStats(
        replica_id=replica_id, num_blocks_total=10, num_blocks_free=6, num_blocks_cached=1,
        kv_usage=0.3, num_running=2, num_waiting=1, num_preempted_total=4, max_num_seqs=8,
        tokens_per_s=0.0, prefix_query_tokens=40, prefix_hit_tokens=16,
    )  # fmt: skip
    return MetricsSnapshot.from_wire(MetricsSnapshot.of(stats, metrics).to_wire())


def _parse(text: str) -> dict[str, list]:
    """Sample name -> its samples, through prometheus_client's parser."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_exposition_has_vllm_names_per_replica_and_the_callers_routing() -> None:
    metrics = ReplicaMetrics()
    metrics.observe_first_token(0.02, 9)
    metrics.observe_step(1.0, 3, 0)
    metrics.observe_step(1.002, 3, 3)
    metrics.observe_finish("stop", 0.5, 0.002)
    caller = CallerMetrics()
    caller.routing_decisions.update({"r1": 3, "r2": 1})
    caller.admissions_rejected = 2
    text = exposition(
        [_snapshot("r2", ReplicaMetrics()), _snapshot("r1", metrics)], caller, "m", "i1"
    )
    samples = _parse(text)
    r1 = {"model_name": "m", "replica": "r1"}
    assert [s.labels for s in samples["vllm:num_requests_running"]] == [r1, {**r1, "replica": "r2"}]
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0.3
    assert samples["vllm:prompt_tokens_total"][0].value == 9
    assert samples["vllm:generation_tokens_total"][0].value == 6
    assert samples["vllm:prefix_cache_hits_total"][0].value == 16
    assert samples["vllm:num_preemptions_total"][0].value == 4
    (success,) = samples["vllm:request_success_total"]
    assert success.labels == {**r1, "finished_reason": "stop"} and success.value == 1
    itl = samples["vllm:inter_token_latency_seconds_bucket"]
    itl_buckets = [s for s in itl if s.labels["replica"] == "r1"]
    assert itl_buckets[-1].labels["le"] == "+Inf" and itl_buckets[-1].value == 3
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value == 1
    decisions = {s.labels["replica"]: s.value for s in samples["kvfleet:routing_decisions_total"]}
    assert decisions == {"r1": 3, "r2": 1}
    assert samples["kvfleet:admissions_rejected_total"][0].labels == {
        "model_name": "m",
        "ingress": "i1",
    }


def test_dashboard_queries_only_exported_metrics() -> None:
    """deploy/grafana-dashboard.json: a Prometheus datasource variable, and every metric
    its queries name (a histogram's by _bucket) is one /metrics exports."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(variables["model_name"]["definition"])
    assert len(dashboard["panels"]) >= 12 and all(exprs)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    caller = CallerMetrics()
    caller.routing_decisions["r1"] = 1
    metrics = ReplicaMetrics()
    metrics.observe_finish("stop", 1.0, None)
    exported = set(_parse(exposition([_snapshot("r1", metrics)], caller, "m", "i")))
    queried = {name for e in exprs for name in re.findall(r"(?:vllm|kvfleet):\w+", e)}
    assert queried and queried <= exported, queried - exported
    names = {name for name, _ in HISTOGRAMS.values()}
    assert {n for n in names if any(n + "_bucket" in e for e in exprs)} == names


# --- GET /metrics on a real app ------------------------------------------------------


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny",
        served_model_name=MODEL_NAME,
        num_replicas=2,
        ingress_replicas=1,  # the routing counters are one ingress replica's
        num_blocks=128,
        max_num_seqs=8,
        device="cpu",
        http=True,
        app_name=APP_NAME,
    )
    with local_serve(num_cpus=6) as url:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        yield url


def _scrape(http: httpx.Client) -> dict[str, list]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    return _parse(response.text)


def _total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, []) if labels.items() <= s.labels.items())


def _complete(http: httpx.Client, body: dict) -> tuple[list[int], str, dict]:
    """A streamed completion's token ids, finish reason and usage (its last chunk)."""
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    token_ids: list[int] = []
    reason, usage = "", {}
    with http.stream("POST", "/v1/completions", json=stream) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event["choices"]:
                token_ids += choice["token_ids"]
                reason = choice["finish_reason"] or reason
            usage = event.get("usage") or usage
    return token_ids, reason, usage


def test_metrics_endpoint_counts_what_responses_report(base_url: str) -> None:
    """Completions ended by length and by a stop token: the token counters equal the
    summed usage, TTFT and end-to-end histograms count every request (TPOT those with a
    second token, ITL every token after a first), gauges exist per replica; then a stream
    whose client disconnects counts as one abort."""
    prompt = list(range(100, 120))
    body = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}
    usages, reasons = [], []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        tokens, reason, usage = _complete(http, {**body, "prompt": prompt, "max_tokens": 6})
        usages.append(usage)
        reasons.append(reason)
        stop = {"stop_token_ids": [tokens[0]]}  # ends at its first token
        for request in [
            {"prompt": list(range(200, 205)), "max_tokens": 4},
            {"prompt": prompt, "max_tokens": 6, **stop},
        ]:
            _, reason, usage = _complete(http, {**body, **request})
            usages.append(usage)
            reasons.append(reason)
        assert reasons == ["length", "length", "stop"]
        assert [u["completion_tokens"] for u in usages] == [6, 4, 1]
        samples = _scrape(http)
        prompt_tokens = sum(u["prompt_tokens"] for u in usages)
        generated = sum(u["completion_tokens"] for u in usages)
        assert _total(samples, "vllm:prompt_tokens_total") == prompt_tokens
        assert _total(samples, "vllm:generation_tokens_total") == generated
        for reason in ("length", "stop"):
            count = _total(samples, "vllm:request_success_total", finished_reason=reason)
            assert count == reasons.count(reason), reason
        for name in ("time_to_first_token", "e2e_request_latency"):
            assert _total(samples, f"vllm:{name}_seconds_count") == 3, name
        # TPOT: the requests with a token after their first.
        assert _total(samples, "vllm:time_per_output_token_seconds_count") == 2
        assert _total(samples, "vllm:inter_token_latency_seconds_count") == generated - 3
        replicas = {s.labels["replica"] for s in samples["vllm:num_requests_running"]}
        assert len(replicas) == 2
        for gauge in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert {s.labels["replica"] for s in samples[gauge]} == replicas
            assert all(s.labels["model_name"] == MODEL_NAME for s in samples[gauge])
        assert _total(samples, "vllm:prefix_cache_queries_total") > 0
        assert _total(samples, "kvfleet:routing_decisions_total") == 3
        assert _total(samples, "kvfleet:admissions_rejected_total") == 0

        long = {**body, "prompt": list(range(300, 310)), "max_tokens": 400, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        # Leaving the block closed the connection mid-stream: its request is aborted.
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            samples = _scrape(http)
            if _total(samples, "vllm:request_success_total", finished_reason="abort") == 1:
                break
            time.sleep(0.1)
        assert _total(samples, "vllm:request_success_total", finished_reason="abort") == 1
        assert _total(samples, "vllm:prompt_tokens_total") == prompt_tokens + 10
        assert _total(samples, "vllm:time_to_first_token_seconds_count") == 4
        assert _total(samples, "vllm:e2e_request_latency_seconds_count") == 3
        assert _total(samples, "kvfleet:routing_decisions_total") == 4
