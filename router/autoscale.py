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

Scale up too when the demand is forecast to pass the watermark, less the headroom
(below), by the time a replica asked for now would take requests. The demand is the
occupancy summed over the replicas (replicas' worth of load); its slope is read from the
arrivals: the median of the pairwise slopes of the fleet's admitted prompt-token rate
over the last trend_window_s (demand_trend; the points ride in the state), scaled to the
demand by Little's law (at a steady time in the replica the occupancy is proportional to
the arrival rate: demand slope = demand * rate slope / rate). The forecast extrapolates
a rise, never a fall, over trend_horizon_s (upscale_delay_s + replica_start_s). Such a
scale-up is sized, at the band's middle and with the headroom, for the demand
SIZING_HORIZONS (3) horizons ahead: these replicas land a horizon from now; then the
held and queued requests flush into them, so the admitted rate jumps and falls back and
its slope is unreadable for a window, and the next rise must hold for upscale_delay_s
before a scale-up that lands a horizon later (5 -> 80 req/s over 120 s from two
replicas at rest: sized for two horizons, four replicas landed at 113 s, the next step
was asked at 157 s and two requests missed the TTFT SLO at 174 s; for three, five
carried the ramp).
Why: a replica takes tens of seconds to start (36 s on the H200), so scaling on the
level alone brings capacity only after the load has passed it; in the simulator (5 ->
120 req/s over 60 s) the forecast started the scale-up at 11 s into the ramp instead of
22 s. A burst is no trend (the median ignores it), and a noisy flat load must read as
rising for upscale_delay_s without a break before anything starts.

A surge skips that delay: when the lower end of the slope's one-sided confidence
interval (slope_lower_bound at surge_z, Sen's rank of the pairwise slopes) alone puts
the demand past the watermark plus the headroom within the horizon, the rise is no
noise and waiting only lets it outrun the replicas already running. From a rest at 5
req/s on two replicas (replayed, seeds 0-4), a rise to 120 req/s over 60 s surged 9-15 s
into the ramp; the delay held the trend to 13-16 s, and Serve's default scaled at 13-14
s. The bound treats the points as independent, which they are not (each averages a few
seconds of arrivals), so it is looser than z says; the headroom is its margin. Replayed
over flat 10-18 req/s (12 runs of 570 s) on the fleet the headroom holds (two replicas,
three at 18 req/s) it never surged; with no headroom, on one replica, 214 times.

Headroom: a fleet with load keeps headroom_replicas (headroom_rise_per_s over the trend
horizon) of demand spare under the watermark (at least ceil((demand + headroom) /
watermark) replicas; none at no load). A rise that
starts at rest is carried by the replicas running while it is detected, waited for and
started (~50 s), however early the forecast reads it: from a warm rest at 5 req/s (0.23
replicas' worth) on one replica, a rise to 80 req/s over 120 s filled it ~30 s into the
ramp, before any scale-up could land; two carried it to 56-72 s. The trend's trigger
leaves the headroom spare at the horizon for the same reason: on the forecast alone the
two scaled up 38-70 s into that ramp (seeds 0-4, replayed), mostly after they filled;
with the headroom, 17-31 s. A scale-up for the headroom alone (the headroom reason)
waits upscale_delay_s on a clock of its own (HEADROOM), so it never shortens a rise's
wait; a rise's wait goes on through headroom ticks.

Why the arrivals and not the occupancy's own slope: the occupancy counts the requests
in the replica, whose number a few long or short outputs move as much as the arrivals
do, so its slope is the noisier. In the simulator a lull hid a slow ramp's rise from
it for 10 s (5 -> 80 req/s over 120 s: the scale-up came at 24 s, not 11, and the SLO
attainment was 0.930 against 0.965 from the rate), and on one replica at a flat 10-18
req/s (12 runs of 570 s, replayed) it started 22 false trend scale-ups to the rate's
11. A saturated replica's admitted rate stops rising; the occupancy and wait rules act
then.

Scale down, as Serve's rule does, as soon as the fleet is over-provisioned: to the
fewest replicas that keep the occupancy (as measured, not forecast) under the band's
middle, the headroom spare and the wait under its threshold, when that is fewer than now
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
# An upscale for headroom alone (no rise, no pressure): it waits out upscale_delay_s on
# its own clock, so a rise that follows it still waits its own.
HEADROOM = 2
# A trend scale-up is sized for the demand this many trend horizons ahead (see desired).
SIZING_HORIZONS = 3
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
    # A rise whose forecast passes the watermark plus the headroom on the lower end of
    # its slope's one-sided confidence interval at this z (Theil-Sen, Sen's rank) needs
    # no upscale_delay_s (a surge). 0: off, every trend waits out the delay.
    surge_z: float = 1.64
    # The rise, in replicas' worth of demand a second, that a fleet with load keeps spare
    # capacity for (under the watermark) over one trend horizon: headroom_replicas. A
    # rise that starts at rest runs on the replicas it has while it is detected, waited
    # for and started. 0.025: one replica's worth at the default horizon (40 s), two
    # 16-slot gpt2 replicas at 5 req/s, where one fills ~30 s into a rise to 80 req/s
    # over 120 s; a replica that starts in 2 s needs little.
    headroom_rise_per_s: float = 0.025
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
        number_in("surge_z", self.surge_z, 0.0, math.inf)
        number_in("headroom_rise_per_s", self.headroom_rise_per_s, 0.0, math.inf)
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
    def headroom_replicas(self) -> float:
        """Spare capacity, in replicas' worth of demand, a fleet with load keeps."""
        return self.headroom_rise_per_s * self.trend_horizon_s

    @property
    def kv_target(self) -> float:
        """The occupancy a proportional jump aims at: the middle of the band."""
        return (self.kv_low_threshold + self.kv_high_watermark) / 2

    def bound(self, num_replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, num_replicas))


@dataclass(frozen=True)
class ScaleState:
    """The direction wanted (UP, HEADROOM, DOWN, 0) and since when (None: nothing
    pending), and the KV policy's recent demand as (time_s, admitted prompt tokens/s)
    points, oldest first (its trend)."""

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
    desired: int,
    target_replicas: int,
    config: AutoscaleConfig,
    now_s: float,
    state: ScaleState,
    headroom: bool = False,
) -> tuple[int, ScaleState]:
    """Serve's delay rule: move to `desired` only once that direction has been wanted
    continuously for its delay; a change of direction or a hold restarts the wait.
    headroom: an upscale for headroom only, on its own clock (HEADROOM) unless an UP is
    pending, whose wait it continues; an UP after a HEADROOM restarts the wait."""
    if desired == target_replicas:
        return target_replicas, ScaleState()
    direction = UP if desired > target_replicas else DOWN
    if headroom and direction == UP and state.direction != UP:
        direction = HEADROOM  # a pending rise's wait goes on through headroom ticks
    since_s = state.since_s if state.direction == direction and state.since_s is not None else now_s
    delay_s = config.downscale_delay_s if direction == DOWN else config.upscale_delay_s
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
    points, kept = _trend_points(history, now_s, demand, window_s)
    slopes = _pairwise_slopes(points, window_s)
    if not slopes:
        return 0.0, kept
    mid = len(slopes) // 2
    slope = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return slope, kept


def slope_lower_bound(
    history: tuple[tuple[float, float], ...], now_s: float, demand: float, window_s: float,
    z: float,
) -> float:  # fmt: skip
    """The lower end of the Theil-Sen slope's one-sided confidence interval at z over the
    points demand_trend reads (Sen 1968: the slopes' rank (N - z * sd(S)) / 2, S Kendall's
    statistic, sd(S)^2 = n(n-1)(2n+5)/18 for n points and N slopes); -inf when the points
    are too few for that rank (z 1.64: fewer than 5). The policy's points are ~1 s apart
    and each averages a few seconds of arrivals, so they are not independent and the
    bound is looser than z says; the false scale-ups on a flat load are what set z."""
    points, _ = _trend_points(history, now_s, demand, window_s)
    slopes = _pairwise_slopes(points, window_s)
    n = len(points)
    rank = math.floor((len(slopes) - z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)) / 2)
    return slopes[rank - 1] if slopes and rank >= 1 else -math.inf


def _trend_points(
    history: tuple[tuple[float, float], ...], now_s: float, demand: float, window_s: float
) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """(the points in the window with (now_s, demand) last, the history to keep)."""
    since_s = now_s - window_s
    kept = tuple(p for p in history if since_s < p[0] < now_s)
    points = (*kept, (now_s, demand))
    if not kept or now_s - kept[-1][0] >= window_s / 10:
        kept = points
    return points, kept


def _pairwise_slopes(points: tuple[tuple[float, float], ...], window_s: float) -> list[float]:
    """Every two points' slope, sorted; none until the points span a tenth of the window."""
    if points[-1][0] - points[0][0] < window_s / 10 - 1e-9:  # float drift of time differences
        return []
    return sorted(
        (d2 - d1) / (t2 - t1)
        for i, (t1, d1) in enumerate(points)
        for t2, d2 in points[i + 1 :]
        if t2 > t1
    )


class KVAutoscalePolicy:
    """Scales on KV occupancy, its trend and the predicted queue wait (see the module
    docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config

    def spared(self, demand: float) -> int:
        """The fewest replicas that keep headroom_replicas of spare capacity under the
        watermark over `demand` (replicas' worth); none for no demand."""
        cfg = self.config
        if demand <= 0:
            return 0
        return math.ceil((demand + cfg.headroom_replicas) / cfg.kv_high_watermark - 1e-9)

    def needed(self, demand: float) -> int:
        """The fewest replicas that hold `demand` at the band's middle, with the headroom."""
        return max(math.ceil(demand / self.config.kv_target - 1e-9), self.spared(demand))

    def desired(
        self,
        fleet: FleetLoad,
        current_replicas: int,
        target_replicas: int,
        slope: float = 0.0,
        sure_slope: float = -math.inf,
    ) -> tuple[int, str]:
        """The count the signals ask for now, before the delays and bounds; slope: the
        demand's trend in replicas' worth per second (decide reads it from the admitted
        rate's, demand_trend), sure_slope the lower bound of its confidence interval."""
        cfg = self.config
        n = current_replicas
        # The demand when replicas asked for now would arrive, if it keeps rising so;
        # a falling trend is not extrapolated (scale-down waits for the load itself).
        rise = max(0.0, slope)
        ahead = fleet.demand + rise * cfg.trend_horizon_s
        # Replicas asked for now carry the load until the next scale-up could take
        # requests. While they start, the running replicas fill and their demand stops
        # rising (a full replica shows no trend: on a 5 -> 80 req/s ramp the slope read
        # 0.006/s for a true ~0.02); once they land, the held requests flush into them
        # and the rate's slope is unreadable for a window; then the next rise must hold
        # for the delay and start: size for SIZING_HORIZONS horizons (module docstring).
        sized_for = fleet.demand + rise * SIZING_HORIZONS * cfg.trend_horizon_s
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
        capacity = cfg.kv_high_watermark * max(n, target_replicas)
        spare = cfg.headroom_replicas if fleet.demand > 0 else 0.0
        short = self.spared(fleet.demand) > max(n, target_replicas)  # no headroom left
        # A rise: the forecast passes the watermark, or eats a headroom the fleet still
        # has (the rise runs on it while the scale-up it triggers is waited for and
        # started).
        if ahead >= capacity or (not short and ahead + spare >= capacity):
            # Past the watermark plus the headroom even at the slope's lower bound: the
            # rise is no noise, and the delay would only let it outrun the replicas
            # running (decide skips it).
            sure = fleet.demand + max(0.0, sure_slope) * cfg.trend_horizon_s >= capacity + spare
            return max(self.needed(sized_for), target_replicas), "surge" if sure else "trend"
        if short:
            return max(self.needed(sized_for), target_replicas), "headroom"
        # Down on the demand as it is: a trend is noisy, and a step (a burst of requests
        # that then stays) reads as a rise for half a window; the downscale delay, not
        # the forecast, guards against removing what a continuing rise would need.
        fewer = max(self.needed(fleet.demand), by_wait, 1)
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
        window_s = cfg.trend_window_s
        rate_slope, history = demand_trend(state.history, now_s, rate, window_s)
        # Little's law: at a steady time in the replica, occupancy follows the arrival rate.
        per_rate = fleet.demand / rate if rate > 0 else 0.0
        sure_slope = -math.inf
        if cfg.surge_z > 0 and per_rate > 0:
            sure_slope = per_rate * slope_lower_bound(
                state.history, now_s, rate, window_s, cfg.surge_z
            )
        desired, reason = self.desired(
            fleet, current_replicas, target_replicas, per_rate * rate_slope, sure_slope
        )
        if reason == "surge":
            num_replicas, state = cfg.bound(desired), ScaleState()
        else:
            num_replicas, state = apply_delay(
                cfg.bound(desired), cfg.bound(target_replicas), cfg, now_s, state,
                headroom=reason == "headroom",
            )  # fmt: skip
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
