"""Serving metrics, as plain numbers, and their Prometheus text with vLLM's names.

Replica side: ReplicaMetrics, fed by the engine thread's fan-out (cluster.fan_out) once
per engine step with counts, never an object per token. A replica answers a
MetricsSnapshot of it beside its latest ReplicaStats' gauges (LLMServer.metrics_snapshot).
Caller side: CallerMetrics, what one Client routed and had refused. `exposition`
renders both for GET /metrics (cluster.ingress): names follow vLLM's where one exists,
so dashboards built for vLLM carry over (docs/design.md, "Metrics"). Ray's metrics
exporter (ray.util.metrics) is no longer fed: it duplicated these on a port of its own.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.prometheus import Family, histogram_samples, render
from replica.stats import ReplicaStats

# vLLM's buckets, each histogram's own. The ITL and TPOT ones get three below vLLM's
# first (10 ms): a decode step here takes ~1 ms at 256 sequences (~1,000 steps/s on an
# H200), which vLLM's would put all in one bucket.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                 7680.0)  # fmt: skip

# Histogram name in ReplicaMetrics -> (exposed name, help).
HISTOGRAMS = {
    "ttft_s": (
        "vllm:time_to_first_token_seconds",
        "Time from the request's admission to the engine to its first token.",
    ),
    "itl_s": (
        "vllm:inter_token_latency_seconds",
        "Time between two tokens of a request (one observation per request per step).",
    ),
    "tpot_s": (
        "vllm:time_per_output_token_seconds",
        "Per request: the mean time between its tokens after the first.",
    ),
    "e2e_s": (
        "vllm:e2e_request_latency_seconds",
        "Time from the request's admission to the engine to its end (stop or length).",
    ),
}


class Histogram:
    """Bucket counts and the sum of observations: counts[i] holds those in
    (bounds[i-1], bounds[i]], counts[-1] those above every bound. One bucket search per
    observe, whatever its weight n."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be strictly increasing, got {bounds!r}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def to_wire(self) -> list:
        return [list(self.bounds), list(self.counts), self.sum]

    @classmethod
    def from_wire(cls, wire: list) -> Histogram:
        bounds, counts, total = wire
        histogram = cls(bounds)
        if len(counts) != len(histogram.counts):
            raise ValueError(f"counts: need {len(histogram.counts)}, got {len(counts)}")
        histogram.counts, histogram.sum = list(counts), float(total)
        return histogram


class ReplicaMetrics:
    """One replica's engine-side totals since it started; written by the engine thread
    alone (cluster.fan_out), read by the replica's loop (a snapshot may lag a step).

    Times are engine-side, from the request's admission to the engine. Prompt tokens
    count at a request's first token (its prefill done, as vLLM counts them), generation
    tokens as delivered. Inter-token latency: each step observes, once, the time since
    the last step that gave tokens, weighted by its rows that continue a request; a
    request resumed after a preemption shows its gap as that one step's interval (its
    TPOT and end-to-end latency still hold the gap). Aborts and engine failures count in
    `finished` only, without latencies.
    """

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft_s = Histogram(TTFT_BUCKETS_S)
        self.itl_s = Histogram(ITL_BUCKETS_S)
        self.tpot_s = Histogram(ITL_BUCKETS_S)
        self.e2e_s = Histogram(E2E_BUCKETS_S)
        self.last_step_s: float | None = None  # the last step that gave tokens

    def observe_step(self, now_s: float, num_tokens: int, num_continuing: int) -> None:
        """A step delivered num_tokens, in num_continuing rows past a request's first."""
        self.generation_tokens += num_tokens
        if num_continuing and self.last_step_s is not None:
            self.itl_s.observe(now_s - self.last_step_s, num_continuing)
        self.last_step_s = now_s

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft_s.observe(ttft_s)
        self.prompt_tokens += num_prompt_tokens

    def observe_finish(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        """A request the engine ended (stop, length); tpot_s: None under two tokens."""
        self.finished[reason] += 1
        self.e2e_s.observe(e2e_s)
        if tpot_s is not None:
            self.tpot_s.observe(tpot_s)

    def count_ended(self, reason: str, n: int = 1) -> None:
        """Requests ended outside the engine's steps (abort, error): no latencies."""
        self.finished[reason] += n

    def load(self, other: ReplicaMetrics) -> None:
        """Take other's totals (an engine process's, shipped to its replica)."""
        self.prompt_tokens, self.generation_tokens = other.prompt_tokens, other.generation_tokens
        self.finished = other.finished
        self.ttft_s, self.itl_s, self.tpot_s = other.ttft_s, other.itl_s, other.tpot_s
        self.e2e_s, self.last_step_s = other.e2e_s, other.last_step_s


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one replica answers for /metrics: its gauges and totals at one instant."""

    replica_id: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]
    histograms: dict[str, Histogram]  # keyed as HISTOGRAMS

    @classmethod
    def of(cls, stats: ReplicaStats, metrics: ReplicaMetrics) -> MetricsSnapshot:
        return cls(
            replica_id=stats.replica_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            num_preemptions=stats.num_preempted_total,
            prefix_query_tokens=stats.prefix_query_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prompt_tokens=metrics.prompt_tokens,
            generation_tokens=metrics.generation_tokens,
            finished=dict(metrics.finished),
            histograms={key: getattr(metrics, key) for key in HISTOGRAMS},
        )

    def to_wire(self) -> dict[str, Any]:
        wire = {name: getattr(self, name) for name in self.__dataclass_fields__}
        wire["histograms"] = {key: h.to_wire() for key, h in self.histograms.items()}
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> MetricsSnapshot:
        histograms = {key: Histogram.from_wire(h) for key, h in wire["histograms"].items()}
        return cls(**{**wire, "histograms": histograms})


class CallerMetrics:
    """One Client's routing outcomes: requests admitted, by the replica the router chose,
    and requests refused by admission control; for the Client of an HTTP ingress replica,
    also the requests that replica shed before routing them (ingress_shed: its event loop
    ran late, cluster.ingress_load)."""

    def __init__(self) -> None:
        self.routing_decisions: collections.Counter[str] = collections.Counter()
        self.admissions_rejected = 0
        self.ingress_shed = 0


def exposition(
    snapshots: Iterable[MetricsSnapshot],
    caller: CallerMetrics,
    model_name: str,
    ingress_id: str,
    loop_lag_s: float | None = None,
) -> str:
    """The Prometheus text of the replicas' snapshots (labels replica, model_name) and
    of one caller's routing, its requests only (label ingress: ingress_id, so that the
    counts of the ingress replicas a scrape lands on in turn stay separate series);
    loop_lag_s: that ingress replica's event-loop lag (cluster.ingress_load), None when
    it does not measure it (shedding off)."""
    snapshots = sorted(snapshots, key=lambda s: s.replica_id)

    def family(name: str, kind: str, help_: str, value: Any) -> Family:
        samples = [
            (name, {"model_name": model_name, "replica": s.replica_id}, value(s)) for s in snapshots
        ]
        return Family(name, kind, help_, samples)

    families = [
        family("vllm:num_requests_running", "gauge", "Requests in the running batch.",
               lambda s: s.num_running),
        family("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               lambda s: s.num_waiting),
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache blocks in use (1 = all).",
               lambda s: s.kv_usage),
        family("vllm:num_preemptions_total", "counter", "Preemptions of running requests.",
               lambda s: s.num_preemptions),
        family("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.",
               lambda s: s.prompt_tokens),
        family("vllm:generation_tokens_total", "counter", "Tokens generated.",
               lambda s: s.generation_tokens),
        family("vllm:prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_query_tokens),
        family("vllm:prefix_cache_hits_total", "counter",
               "Prompt tokens found in the prefix cache.", lambda s: s.prefix_hit_tokens),
    ]  # fmt: skip
    success = Family("vllm:request_success_total", "counter", "Requests ended, by finish reason.")
    for s in snapshots:
        for reason, count in sorted(s.finished.items()):
            labels = {"model_name": model_name, "replica": s.replica_id, "finished_reason": reason}
            success.samples.append((success.name, labels, count))
    families.append(success)
    for key, (name, help_) in HISTOGRAMS.items():
        histogram = Family(name, "histogram", help_)
        for s in snapshots:
            h = s.histograms[key]
            labels = {"model_name": model_name, "replica": s.replica_id}
            histogram.samples.extend(histogram_samples(name, labels, h.bounds, h.counts, h.sum))
        families.append(histogram)
    caller_labels = {"model_name": model_name, "ingress": ingress_id}
    decisions = Family(
        "kvfleet:routing_decisions_total",
        "counter",
        "This ingress replica's requests admitted, by the replica the router chose.",
        [
            ("kvfleet:routing_decisions_total", {**caller_labels, "replica": r}, n)
            for r, n in sorted(caller.routing_decisions.items())
        ],
    )
    # One family, so that a dashboard's sum over it counts every 503 for overload; the
    # ingress's own refusals (its loop running late) carry stage="ingress".
    rejected = Family(
        "kvfleet:admissions_rejected_total",
        "counter",
        "This ingress replica's requests refused for overload: by admission control, or "
        '(stage="ingress") by the ingress itself before routing, its event loop running late.',
        [
            ("kvfleet:admissions_rejected_total", caller_labels, caller.admissions_rejected),
            (
                "kvfleet:admissions_rejected_total",
                {**caller_labels, "stage": "ingress"},
                caller.ingress_shed,
            ),
        ],
    )
    families += [decisions, rejected]
    if loop_lag_s is not None:
        name = "kvfleet:ingress_event_loop_lag_seconds"
        help_ = (
            "How late this ingress replica's event loop runs callbacks (median of its last "
            "5 timer wake-ups); past ingress_max_loop_lag_s, while busy, it sheds new "
            "completions."
        )
        families.append(Family(name, "gauge", help_, [(name, caller_labels, loop_lag_s)]))
    return render(families)
