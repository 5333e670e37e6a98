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
  holds the pending direction and since when, for the delays; it round-trips
  through a plain dict (to_dict / from_dict) for Serve's policy_state.
- The decision's num_replicas is within [min_replicas, max_replicas]; reason says
  which signal decided (for logs and tests).

KVAutoscalePolicy.decide(loads, ...) takes one ReplicaLoad per running replica
(KV usage counting its queue, the fraction of its sequence slots its running and
queued requests fill, queued prompt tokens, the prompt tokens it admits per second)
and computes fleet-wide:

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
Scale down, as Serve's rule does, as soon as the fleet is over-provisioned: to
the fewest replicas that keep the occupancy under the band's middle and the wait
under its threshold, when that is fewer than now (with occupancy under the
watermark and no wait to speak of). The band's middle sits well under the
watermark, so a scale-down never lands where a scale-up starts. Between the two
the target stands (a scale-up in progress is not undone). A direction is applied
only once it has been wanted continuously for upscale_delay_s / downscale_delay_s
(Serve's delay rule, so a short lull never removes a replica). A queue with no
measured rate (a replica that admitted nothing lately) reads as an infinite wait,
which adds one replica at a time.

ServeDefaultPolicy mirrors ray.serve.autoscaling_policy (Ray 2.60):
desired = total ongoing requests / target_ongoing_requests, damped by the up- and
downscaling factors, the same delays, then the bounds. kvfleet's carrier streams
count as ongoing requests on a real Serve, so this is for the simulator's
comparison, where only client requests count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    def kv_target(self) -> float:
        """The occupancy a proportional jump aims at: the middle of the band."""
        return (self.kv_low_threshold + self.kv_high_watermark) / 2

    def bound(self, num_replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, num_replicas))


@dataclass(frozen=True)
class ScaleState:
    """The direction wanted (UP, DOWN, 0) and since when (None: nothing pending)."""

    direction: int = 0
    since_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kvfleet_direction": self.direction, "kvfleet_since_s": self.since_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScaleState:
        return cls(d.get("kvfleet_direction", 0), d.get("kvfleet_since_s"))


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
        )


class KVAutoscalePolicy:
    """Scales on KV occupancy and the predicted queue wait (see the module docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config

    def desired(
        self, fleet: FleetLoad, current_replicas: int, target_replicas: int
    ) -> tuple[int, str]:
        """The count the signals ask for now, before the delays and bounds."""
        cfg = self.config
        n = current_replicas
        by_occupancy = math.ceil(n * fleet.occupancy / cfg.kv_target)
        if math.isinf(fleet.predicted_wait_s):
            by_wait = n + 1  # no rate to size a jump by: one more, then measure again
        else:
            by_wait = math.ceil(n * fleet.predicted_wait_s / cfg.upscale_wait_s)
        # Under pressure never below the current target: replicas still starting count.
        if fleet.predicted_wait_s > cfg.upscale_wait_s:
            return max(n + 1, by_wait, by_occupancy, target_replicas), "wait"
        if fleet.occupancy >= cfg.kv_high_watermark:
            return max(n + 1, by_wait, by_occupancy, target_replicas), "kv"
        fewer = max(by_occupancy, by_wait, 1)
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
        desired, reason = self.desired(FleetLoad.of(loads), current_replicas, target_replicas)
        num_replicas, state = apply_delay(
            cfg.bound(desired), cfg.bound(target_replicas), cfg, now_s, state
        )
        return ScaleDecision(num_replicas, state, reason)


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
