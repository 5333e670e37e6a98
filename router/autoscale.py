"""Replica-count policies: kvfleet's KV-occupancy policy and Ray Serve's default, both pure.

No Ray, no clock of its own: the same code decides inside Ray Serve's controller
(cluster.autoscale wraps it as a custom autoscaling policy), in tests with an
injected clock, and in the cluster simulator.

Interface (both policies):

    policy.decide(..., current_replicas, target_replicas, now_s, state) -> ScaleDecision

- current_replicas: replicas running now (the ones whose metrics are given);
  target_replicas: the count the autoscaler last asked for (>= current while a
  scale-up is starting replicas).
- state: the ScaleState the previous call returned (ScaleState() at first). It
  holds the pending direction and since when, for the delays, and the KV policy's
  recent demand, for its trend; it round-trips through a plain dict (to_dict /
  from_dict) for Serve's policy_state.
- The decision's num_replicas is within [min_replicas, max_replicas]; reason says
  which signal decided (for logs and tests).

KVAutoscalePolicy.decide(loads, ...) takes one ReplicaLoad per running replica
(KV usage counting its queue, the fraction of its sequence slots its running and
queued requests fill, queued prompt tokens, the rate its queue drains at and the
prompt tokens it admitted per second lately) and computes fleet-wide:

    predicted_wait_s = sum(num_waiting_tokens) / sum(tokens_per_s)
    occupancy        = mean(max(kv_usage, seq_fraction))

Occupancy is KV blocks or sequence slots, whichever is fuller (router.load's
load_fraction, what the kv router balances on): a replica whose max_num_seqs are
all taken queues every new request however many blocks are free, and with long
outputs and a large cache that is the resource that runs out (16 slots, 1,024
blocks and 1.5K-token requests: the slots fill at ~40% of the blocks).

Scale up (to at least current + 1) when predicted_wait_s passes upscale_wait_s
(upscale_wait_fraction * max_queue_wait_s: a queued request's wait is part of its
TTFT, so the trigger sits well under the admission bound), or when occupancy
reaches kv_high_watermark. It jumps proportionally: enough replicas that, at the
measured per-replica rate, the wait falls back to that threshold and the
occupancy to the middle of the band [kv_low_threshold, kv_high_watermark].

Scale up too when the demand is forecast to pass the watermark by the time a replica
asked for now would take requests. The demand is the occupancy summed over the
replicas (replicas' worth of load); its slope is read from the arrivals: the median of
the pairwise slopes of the fleet's admitted prompt-token rate over the last
trend_window_s (demand_trend; the points ride in the state), scaled to the demand by
Little's law (at a steady time in the replica the occupancy is proportional to the
arrival rate: demand slope = demand * rate slope / rate). The forecast extrapolates a
rise, never a fall, over trend_horizon_s (upscale_delay_s + replica_start_s). Such a
scale-up is sized, at the band's middle, for the demand one horizon further: while
these replicas start, the running ones fill and their demand stops rising, so the
next rise shows only once these take requests, and what is asked then lands a horizon
later. Why: a replica takes tens of seconds to start (36 s on the H200), so scaling on
the level alone brings capacity only after the load has passed it; in the simulator
(5 -> 120 req/s over 60 s) the forecast started the scale-up at 11 s into the ramp
instead of 22 s. A burst is no trend (the median ignores it), and a noisy flat load
must read as rising for upscale_delay_s without a break before anything starts.

Why the arrivals and not the occupancy's own slope: the occupancy counts the requests
in the replica, whose number a few long or short outputs move as much as the arrivals
do, so its slope is the noisier. In the simulator a lull hid a slow ramp's rise from
it for 10 s (5 -> 80 req/s over 120 s: the scale-up came at 24 s, not 11, and the SLO
attainment was 0.930 against 0.965 from the rate), and on one replica at a flat 10-18
req/s (12 runs of 570 s, replayed) it started 22 false trend scale-ups to the rate's
11. A saturated replica's admitted rate stops rising; the occupancy and wait rules act
then.

Scale down, as Serve's rule does, as soon as the fleet is over-provisioned: to the
fewest replicas that keep the occupancy (as measured, not forecast) under
the band's middle and the wait under its threshold, when that is fewer than now
(with occupancy under the watermark and no wait to speak of). The band's middle
sits well under the watermark, so a scale-down never lands where a scale-up
starts. Between the two the target stands (a scale-up in progress is not undone).
A direction is applied only once it has been wanted continuously for
upscale_delay_s / downscale_delay_s (Serve's delay rule, so a short lull never
removes a replica). A queue with no measured rate (a replica that admitted nothing
lately) reads as an infinite wait, which adds one replica at a time.

ServeDefaultPolicy mirrors ray.serve.autoscaling_policy (Ray 2.60):
desired = total ongoing requests / target_ongoing_requests, damped by the up- and
downscaling factors, the same delays, then the bounds. kvfleet's carrier streams
count as ongoing requests on a real Serve, so this is for the simulator's
comparison, where only client requests count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from replica.validate import number_in, positive_float, positive_int

UP = 1
DOWN = -1
# Serve's own tolerance for delay comparisons (float drift of time.time() differences).
_DELAY_EPS_S = 1e-6


@dataclass(frozen=True)
class ReplicaLoad:
    """What one replica reports for scaling: a subset of its ReplicaStats."""

    kv_usage: float  # fraction of KV blocks held or promised to its queue (may exceed 1)
    num_waiting_tokens: int  # prompt tokens queued, not yet scheduled
    # The rate its queue drains at: prompt tokens it admits per second, measured
    # (cluster.autoscale.ReplicaMeter; a simulator gives its model's prefill rate).
    tokens_per_s: float
    # (running + waiting) / max_num_seqs: can exceed 1 (requests waiting for a slot);
    # 0 where the replica does not say (max_num_seqs unknown).
    seq_fraction: float = 0.0
    # Prompt tokens it admitted per second over the last few seconds, backlog or not
    # (tokens_per_s is the drain rate while it has a queue): while it keeps up, the rate
    # its requests arrive at, which the demand's trend is read from. 0: not reported.
    admitted_tokens_per_s: float = 0.0

    @property
    def occupancy(self) -> float:
        """KV blocks or sequence slots, whichever is fuller (router.load.load_fraction)."""
        return max(self.kv_usage, self.seq_fraction)


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds, delays and thresholds of the replica-count policies; validated here."""

    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    max_queue_wait_s: float = 2.0  # the admission bound on a queued request's expected wait
    # 0.5 s at the 2-s bound: a queued request's wait is TTFT, so scale up while it is
    # still a fraction of the bound (and near a TTFT SLO such as 250 ms), not at its half.
    upscale_wait_fraction: float = 0.25
    kv_high_watermark: float = 0.85
    kv_low_threshold: float = 0.3
    # How long a replica takes from the scale-up to taking requests: a scale-up wanted now
    # brings capacity upscale_delay_s + this later, so the demand's rise is extrapolated
    # that far. 30 s: the order of a GPU replica's start (36 s for one gpt2 replica on
    # the H200, Serve's deploy included). 0 with upscale_delay_s 0: no forecast.
    replica_start_s: float = 30.0
    trend_window_s: float = 10.0  # the demand's slope is taken over this much history
    target_ongoing_requests: float = 2.0  # ServeDefaultPolicy only
    upscaling_factor: float = 1.0  # ServeDefaultPolicy only
    downscaling_factor: float = 1.0  # ServeDefaultPolicy only

    def __post_init__(self) -> None:
        positive_int("min_replicas", self.min_replicas)
        positive_int("max_replicas", self.max_replicas)
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        number_in("upscale_delay_s", self.upscale_delay_s, 0.0, math.inf)
        number_in("downscale_delay_s", self.downscale_delay_s, 0.0, math.inf)
        positive_float("max_queue_wait_s", self.max_queue_wait_s)
        number_in("upscale_wait_fraction", self.upscale_wait_fraction, 0.0, 1.0, low_open=True)
        number_in("kv_high_watermark", self.kv_high_watermark, 0.0, 1.0, low_open=True)
        number_in("kv_low_threshold", self.kv_low_threshold, 0.0, 1.0)
        number_in("replica_start_s", self.replica_start_s, 0.0, math.inf)
        positive_float("trend_window_s", self.trend_window_s)
        if not self.kv_low_threshold < self.kv_high_watermark:
            raise ValueError(
                f"kv_low_threshold ({self.kv_low_threshold}) must be < "
                f"kv_high_watermark ({self.kv_high_watermark})"
            )
        positive_float("target_ongoing_requests", self.target_ongoing_requests)
        positive_float("upscaling_factor", self.upscaling_factor)
        positive_float("downscaling_factor", self.downscaling_factor)

    @property
    def upscale_wait_s(self) -> float:
        return self.upscale_wait_fraction * self.max_queue_wait_s

    @property
    def trend_horizon_s(self) -> float:
        """How far ahead the demand's rise is extrapolated: until a replica asked for now
        would take requests."""
        return self.upscale_delay_s + self.replica_start_s

    @property
    def kv_target(self) -> float:
        """The occupancy a proportional jump aims at: the middle of the band."""
        return (self.kv_low_threshold + self.kv_high_watermark) / 2

    def bound(self, num_replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, num_replicas))


@dataclass(frozen=True)
class ScaleState:
    """The direction wanted (UP, DOWN, 0) and since when (None: nothing pending), and the
    KV policy's recent demand as (time_s, admitted prompt tokens/s) points, oldest first
    (its trend)."""

    direction: int = 0
    since_s: float | None = None
    history: tuple[tuple[float, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvfleet_direction": self.direction,
            "kvfleet_since_s": self.since_s,
            "kvfleet_demand": [list(point) for point in self.history],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScaleState:
        history = tuple((float(t), float(v)) for t, v in d.get("kvfleet_demand", ()))
        return cls(d.get("kvfleet_direction", 0), d.get("kvfleet_since_s"), history)


@dataclass(frozen=True)
class ScaleDecision:
    num_replicas: int
    state: ScaleState = field(default_factory=ScaleState)
    reason: str = ""


def apply_delay(
    desired: int, target_replicas: int, config: AutoscaleConfig, now_s: float, state: ScaleState
) -> tuple[int, ScaleState]:
    """Serve's delay rule: move to `desired` only once that direction has been wanted
    continuously for its delay; a change of direction or a hold restarts the wait."""
    if desired == target_replicas:
        return target_replicas, ScaleState()
    direction = UP if desired > target_replicas else DOWN
    since_s = state.since_s if state.direction == direction and state.since_s is not None else now_s
    delay_s = config.upscale_delay_s if direction == UP else config.downscale_delay_s
    if now_s - since_s + _DELAY_EPS_S >= delay_s:
        return desired, ScaleState()
    return target_replicas, ScaleState(direction, since_s)


@dataclass(frozen=True)
class FleetLoad:
    """The fleet-wide signals the KV policy decides on."""

    kv_usage: float
    predicted_wait_s: float
    occupancy: float  # mean over replicas of max(kv_usage, seq_fraction)
    num_replicas: int = 1
    admitted_tokens_per_s: float = 0.0  # summed over the replicas

    @property
    def demand(self) -> float:
        """Occupancy summed over the replicas: the load in replicas' worth (per replica
        this is arrivals x time in the replica / capacity, Little's law)."""
        return self.occupancy * self.num_replicas

    @classmethod
    def of(cls, loads: Sequence[ReplicaLoad]) -> FleetLoad:
        waiting = sum(load.num_waiting_tokens for load in loads)
        rate = sum(load.tokens_per_s for load in loads)
        if waiting == 0:
            wait_s = 0.0
        else:
            wait_s = waiting / rate if rate > 0 else math.inf
        n = len(loads)
        return cls(
            sum(load.kv_usage for load in loads) / n,
            wait_s,
            sum(load.occupancy for load in loads) / n,
            n,
            sum(load.admitted_tokens_per_s for load in loads),
        )


def demand_trend(
    history: tuple[tuple[float, float], ...], now_s: float, demand: float, window_s: float
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """A series' slope (per second) over the last window_s, with (now_s, demand) as the
    newest point, and the history to keep. The policy passes the fleet's admitted
    prompt-token rate (the demand as it arrives).

    The slope is Theil-Sen's, the median of the slopes between every two points: one
    burst moves a least-squares fit as much as a rise does (a 1-s spike early in the
    window reads as a rise for half a window after it), not the median. It is 0 until
    the points span a tenth of the window (two points a second apart): the first
    slopes are noisy, but a scale-up needs the forecast for upscale_delay_s without a
    break, over a window that fills meanwhile.
    Points are kept at least a tenth of the window apart, so a caller that decides
    every 0.1 s (Serve's controller) keeps ~10, and the state it round-trips stays small.
    """
    since_s = now_s - window_s
    kept = tuple(p for p in history if since_s < p[0] < now_s)
    points = (*kept, (now_s, demand))
    if not kept or now_s - kept[-1][0] >= window_s / 10:
        kept = points
    if now_s - points[0][0] < window_s / 10 - 1e-9:  # float drift of time differences
        return 0.0, kept
    slopes = sorted(
        (d2 - d1) / (t2 - t1)
        for i, (t1, d1) in enumerate(points)
        for t2, d2 in points[i + 1 :]
        if t2 > t1
    )
    mid = len(slopes) // 2
    slope = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return slope, kept


class KVAutoscalePolicy:
    """Scales on KV occupancy, its trend and the predicted queue wait (see the module
    docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config

    def desired(
        self, fleet: FleetLoad, current_replicas: int, target_replicas: int, slope: float = 0.0
    ) -> tuple[int, str]:
        """The count the signals ask for now, before the delays and bounds; slope: the
        demand's trend in replicas' worth per second (decide reads it from the admitted
        rate's, demand_trend)."""
        cfg = self.config
        n = current_replicas
        # The demand when replicas asked for now would arrive, if it keeps rising so;
        # a falling trend is not extrapolated (scale-down waits for the load itself).
        rise = max(0.0, slope)
        ahead = fleet.demand + rise * cfg.trend_horizon_s
        # Replicas asked for now carry the load until the next scale-up could take
        # requests. While they start, the running replicas fill and their demand stops
        # rising (a full replica shows no trend: on a 5 -> 80 req/s ramp the slope read
        # 0.006/s for a true ~0.02), so the next trend shows once these take requests,
        # and a scale-up asked then lands a horizon later: size for that.
        sized_for = ahead + rise * cfg.trend_horizon_s
        by_occupancy = math.ceil(sized_for / cfg.kv_target - 1e-9)
        if math.isinf(fleet.predicted_wait_s):
            by_wait = n + 1  # no rate to size a jump by: one more, then measure again
        else:
            by_wait = math.ceil(n * fleet.predicted_wait_s / cfg.upscale_wait_s)
        # Under pressure never below the current target: replicas still starting count.
        if fleet.predicted_wait_s > cfg.upscale_wait_s:
            return max(n + 1, by_wait, by_occupancy, target_replicas), "wait"
        if fleet.occupancy >= cfg.kv_high_watermark:
            return max(n + 1, by_wait, by_occupancy, target_replicas), "kv"
        if ahead >= cfg.kv_high_watermark * max(n, target_replicas):
            return max(by_occupancy, target_replicas), "trend"
        # Down on the demand as it is: a trend is noisy, and a step (a burst of requests
        # that then stays) reads as a rise for half a window; the downscale delay, not
        # the forecast, guards against removing what a continuing rise would need.
        fewer = max(math.ceil(fleet.demand / cfg.kv_target - 1e-9), by_wait, 1)
        if fewer < n:
            return fewer, "low"
        return target_replicas, "hold"

    def decide(
        self,
        loads: Sequence[ReplicaLoad],
        current_replicas: int,
        target_replicas: int,
        now_s: float,
        state: ScaleState,
    ) -> ScaleDecision:
        cfg = self.config
        if not loads or current_replicas == 0:
            # No running replica reported: nothing to measure, keep what was asked for.
            return ScaleDecision(cfg.bound(target_replicas), ScaleState(), "no-metrics")
        fleet = FleetLoad.of(loads)
        rate = fleet.admitted_tokens_per_s
        rate_slope, history = demand_trend(state.history, now_s, rate, cfg.trend_window_s)
        # Little's law: at a steady time in the replica, occupancy follows the arrival rate.
        slope = fleet.demand * rate_slope / rate if rate > 0 else 0.0
        desired, reason = self.desired(fleet, current_replicas, target_replicas, slope)
        num_replicas, state = apply_delay(
            cfg.bound(desired), cfg.bound(target_replicas), cfg, now_s, state
        )
        return ScaleDecision(num_replicas, replace(state, history=history), reason)


class ServeDefaultPolicy:
    """Ray Serve 2.60's default: ongoing requests against target_ongoing_requests."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config

    def decide(
        self,
        total_ongoing_requests: float,
        current_replicas: int,
        target_replicas: int,
        now_s: float,
        state: ScaleState,
    ) -> ScaleDecision:
        cfg = self.config
        if current_replicas == 0:
            # Serve's cold start: straight up, no delay.
            if total_ongoing_requests > 0:
                up = max(math.ceil(cfg.upscaling_factor), target_replicas)
                return ScaleDecision(cfg.bound(up), state, "cold-start")
            return ScaleDecision(cfg.bound(target_replicas), state, "no-replicas")
        desired = total_ongoing_requests / cfg.target_ongoing_requests
        delta = desired - current_replicas
        factor = cfg.upscaling_factor if delta > 0 else cfg.downscaling_factor
        scaled = math.ceil(current_replicas + factor * delta)
        if math.ceil(desired) < current_replicas and scaled == current_replicas:
            scaled -= 1  # Serve's rule: a damped downscale that rounds to no change still moves 1
        # Serve keeps >= 1 replica on every downscale but 1 -> 0 (min_replicas >= 1 here).
        num_replicas, state = apply_delay(max(1, scaled), target_replicas, cfg, now_s, state)
        return ScaleDecision(cfg.bound(num_replicas), state, "ongoing")
