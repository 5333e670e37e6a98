"""Prometheus metrics of the cluster, through ray.util.metrics.

Replica side (ReplicaMetrics): KV usage, running and waiting sequences (Gauges),
time to first token and time per output token (Histograms, engine-side: from
admission to first token, and between tokens). Caller side (CallerMetrics):
routing decisions per replica and admissions rejected (Counters).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from replica.stats import ReplicaStats

_LATENCY_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class ReplicaMetrics:
    def __init__(self, replica_id: str) -> None:
        self._tags = {"replica": replica_id}
        keys = ("replica",)
        self.kv_usage = Gauge("kvfleet_kv_usage", "KV blocks in use / total.", tag_keys=keys)
        self.num_running = Gauge("kvfleet_num_running", "Running sequences.", tag_keys=keys)
        self.num_waiting = Gauge("kvfleet_num_waiting", "Queued sequences.", tag_keys=keys)
        self.ttft_s = Histogram(
            "kvfleet_ttft_s",
            "Time from admission to first token, seconds.",
            boundaries=_LATENCY_BOUNDARIES_S,
            tag_keys=keys,
        )
        self.tpot_s = Histogram(
            "kvfleet_tpot_s",
            "Mean time per output token after the first, seconds.",
            boundaries=_LATENCY_BOUNDARIES_S,
            tag_keys=keys,
        )
        for metric in (self.kv_usage, self.num_running, self.num_waiting, self.ttft_s, self.tpot_s):
            metric.set_default_tags(self._tags)
        # Running totals of the TTFT histogram (LLMServer.serving_counters reports them).
        self.ttft_total_s = 0.0
        self.num_ttft = 0

    def observe_ttft(self, value_s: float) -> None:
        self.ttft_s.observe(value_s)
        self.ttft_total_s += value_s
        self.num_ttft += 1

    def record_stats(self, stats: ReplicaStats) -> None:
        self.kv_usage.set(stats.kv_usage)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)


class CallerMetrics:
    def __init__(self) -> None:
        self.routing_decisions = Counter(
            "kvfleet_routing_decisions",
            "Requests admitted, by the replica the router chose.",
            tag_keys=("replica",),
        )
        self.admissions_rejected = Counter(
            "kvfleet_admissions_rejected",
            "Requests refused by admission control (overload).",
        )
