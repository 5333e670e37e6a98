"""KV-occupancy autoscaling on Ray Serve: what a replica records, and the custom policy.

Each LLMServer replica answers Serve's `record_autoscaling_stats` with ReplicaMeter's
five metrics (KV usage counting its queue, the fraction of its sequence slots its
running and queued requests fill, queued prompt tokens, the rate its queue drains at,
and the prompt tokens it admitted per second lately, which the policy reads the
demand's trend from); Serve averages each over look_back_period_s per replica and
hands them to KVServePolicy in the controller, which decides with
router.autoscale.KVAutoscalePolicy, the same code the simulator runs.

Why a custom policy: Serve's default counts ongoing calls, and a kvfleet carrier stream
is an ongoing call for as long as its caller has requests on the replica, so one caller
with 200 requests in flight there counts as one ongoing request (plus its submits not
yet acked), and the count says nothing of the KV those requests hold. The KV policy carries its
own delays (router.autoscale.apply_delay) and its own demand history (the trend it
forecasts a rise by, kept in the policy_state Serve hands back each call, a point a
second), so the AutoscalingConfig built here sets
Serve's delays to 0 and its scaling factors to 1: Serve's wrapper then passes the
decision through to its min/max bounds.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from ray import cloudpickle
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

import replica.validate
import router.autoscale
from replica.stats import ReplicaStats
from router.autoscale import AutoscaleConfig, KVAutoscalePolicy, ReplicaLoad, ScaleState
from router.load import committed_fraction, seq_fraction
from router.queue_wait import DrainRates

KV_USAGE = "kvfleet_kv_usage"
WAITING_TOKENS = "kvfleet_waiting_tokens"
TOKENS_PER_S = "kvfleet_prompt_tokens_per_s"
SEQ_FRACTION = "kvfleet_seq_fraction"
ADMITTED_TOKENS_PER_S = "kvfleet_admitted_tokens_per_s"
# The window ReplicaMeter measures the admission rate over: the engine's own
# tokens_per_s window, long enough for a few steps' admissions.
RATE_WINDOW_S = 2.0
# Each replica records and pushes its metrics this many times per look-back period, so
# the average Serve takes over the period holds several points.
POINTS_PER_LOOK_BACK = 5


class ReplicaMeter:
    """A replica's autoscaling metrics from its ReplicaStats snapshots.

    The token rate is the rate its queue drains at, so that queued tokens over it is
    the wait a new request would see: the drain rate admission measures
    (router.queue_wait.DrainRates: prompt tokens admitted per second of backlogged
    time), so the policy's predicted wait and admission's expected wait agree. While
    that is unknown (too little backlog lately), the prompt tokens admitted per second
    over the last RATE_WINDOW_S (an idle replica's arrivals: lower than its capacity, so
    the wait reads longer); before two snapshots span any time, the engine's generated
    tokens/s. The admitted rate over the window is recorded on its own too, backlog or
    not (0 before two snapshots span any time): the arrivals' rate while the replica
    keeps up, whose trend forecasts the demand.
    """

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._drain_rates = DrainRates()

    def record(self, stats: ReplicaStats) -> dict[str, float]:
        self._drain_rates.observe(stats)
        window_rate = self._window_rate(stats)  # sampled every call
        rate = self._drain_rates.rate(stats.replica_id)
        if rate is None:
            rate = stats.tokens_per_s if window_rate is None else window_rate
        return {
            KV_USAGE: committed_fraction(stats),
            WAITING_TOKENS: float(stats.num_waiting_tokens),
            TOKENS_PER_S: float(rate),
            SEQ_FRACTION: seq_fraction(stats),
            ADMITTED_TOKENS_PER_S: float(window_rate or 0.0),
        }

    def _window_rate(self, stats: ReplicaStats) -> float | None:
        now_s = self._clock()
        samples = self._samples
        samples.append((now_s, stats.prefix_query_tokens))
        while len(samples) > 2 and samples[1][0] <= now_s - RATE_WINDOW_S:
            samples.popleft()
        (first_s, first_tokens), (last_s, last_tokens) = samples[0], samples[-1]
        if last_s > first_s:
            return max(0, last_tokens - first_tokens) / (last_s - first_s)
        return None


class KVServePolicy:
    """Serve's custom autoscaling policy (deployment scope): KVAutoscalePolicy over the
    metrics each running replica recorded. A replica with no metrics yet (just started)
    is left out of the averages but counted as running; with none at all the target
    stands. A replica that records no slot fraction counts by its KV usage alone, one
    that records no admitted rate adds nothing to the demand's trend."""

    def __init__(self, **config: Any) -> None:
        self.policy = KVAutoscalePolicy(AutoscaleConfig(**config))

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        columns = [metrics.get(name, {}) for name in (KV_USAGE, WAITING_TOKENS, TOKENS_PER_S)]
        seqs = metrics.get(SEQ_FRACTION, {})
        admitted = metrics.get(ADMITTED_TOKENS_PER_S, {})
        loads = [
            ReplicaLoad(
                kv, int(waiting), rate, seqs.get(replica_id, 0.0), admitted.get(replica_id, 0.0)
            )
            for replica_id in ctx.running_replicas
            if all(replica_id in column for column in columns)
            for kv, waiting, rate in [tuple(column[replica_id] for column in columns)]
        ]
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        decision = self.policy.decide(
            loads,
            ctx.current_num_replicas,
            ctx.target_num_replicas,
            now_s,
            ScaleState.from_dict(ctx.policy_state),
        )
        state = {**ctx.policy_state, **decision.state.to_dict(), "kvfleet_reason": decision.reason}
        return decision.num_replicas, state


def autoscaling_config(
    config: AutoscaleConfig, initial_replicas: int, look_back_s: float
) -> AutoscalingConfig:
    """The deployment's AutoscalingConfig running KVServePolicy with `config`."""
    return AutoscalingConfig(
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        initial_replicas=initial_replicas,
        # The KV policy applies the delays itself; Serve's would wait a second time.
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
        look_back_period_s=look_back_s,
        # Deprecated in 2.60 but still how often a replica records and pushes its
        # metrics; the env var that replaces it would be read once per Ray cluster.
        metrics_interval_s=look_back_s / POINTS_PER_LOOK_BACK,
        policy=kv_serve_policy(config),
    )


def kv_serve_policy(config: AutoscaleConfig) -> AutoscalingPolicy:
    """KVServePolicy as Serve's AutoscalingPolicy, pickled by value together with the
    pure modules it runs (router.autoscale, replica.validate), so that Serve's controller
    never imports kvfleet's packages: router/ and replica/ import torch through their
    __init__ (6-24 s and 270 MB more than Serve's own on the 2-core box), which would
    stall the controller's loop, and every deployment it manages, once per deploy.
    Nor does the controller's node then need kvfleet installed."""
    by_value = (router.autoscale, replica.validate)
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        # Serve pickles the policy here, with its own module (this one) by value.
        return AutoscalingPolicy(
            policy_function=f"{__name__}:KVServePolicy", policy_kwargs=dataclasses.asdict(config)
        )
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)
