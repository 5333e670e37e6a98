"""router.autoscale: the KV policy (signals, delays, bounds) and the mirror of Serve's default."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from router.autoscale import (
    HEADROOM,
    UP,
    AutoscaleConfig,
    FleetLoad,
    KVAutoscalePolicy,
    ReplicaLoad,
    ScaleState,
    ServeDefaultPolicy,
    apply_delay,
    demand_trend,
    slope_lower_bound,
)

# The occupancy, wait and trend rules alone; the headroom and the surge (a trend scale-up
# without the delay) have tests of their own, with HEADROOM_CFG and SURGE_CFG.
CFG = AutoscaleConfig(
    min_replicas=1,
    max_replicas=4,
    upscale_delay_s=5.0,
    downscale_delay_s=20.0,
    max_queue_wait_s=2.0,
    upscale_wait_fraction=0.5,
    kv_high_watermark=0.8,
    kv_low_threshold=0.2,
    surge_z=0.0,
    headroom_rise_per_s=0.0,
)


def load(kv: float, waiting: int = 0, rate: float = 1000.0, admitted: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(
        kv_usage=kv, num_waiting_tokens=waiting, tokens_per_s=rate, admitted_tokens_per_s=admitted
    )


def run(policy, loads_at, target: int, times):
    """Calls decide at each time with the loads of that time; returns the targets."""
    state = ScaleState()
    out = []
    for t in times:
        loads = loads_at(t)
        decision = policy.decide(loads, len(loads), target, t, state)
        target, state = decision.num_replicas, decision.state
        out.append(target)
    return out


def test_fleet_load_predicts_wait_from_queued_tokens_and_rate():
    fleet = FleetLoad.of([load(0.5, 3000, 1000.0, 700.0), load(0.3, 1000, 1000.0, 500.0)])
    assert fleet.predicted_wait_s == pytest.approx(2.0)
    assert fleet.kv_usage == pytest.approx(0.4)
    assert fleet.admitted_tokens_per_s == pytest.approx(1200.0)  # summed: the fleet's arrivals
    assert FleetLoad.of([load(0.1, 10, 0.0)]).predicted_wait_s == math.inf
    assert FleetLoad.of([load(0.1, 0, 0.0)]).predicted_wait_s == 0.0


def test_scales_up_before_the_wait_reaches_the_admission_bound():
    policy = KVAutoscalePolicy(CFG)
    # 1.5 s of queue against a 2 s bound: past the 1 s threshold, below the bound.
    loads = [load(0.4, 1500, 1000.0)]
    first = policy.decide(loads, 1, 1, 100.0, ScaleState())
    assert first.num_replicas == 1 and first.reason == "wait"  # waiting out upscale_delay_s
    second = policy.decide(loads, 1, 1, 105.0, first.state)
    assert second.num_replicas == 2


def test_a_proportional_scale_up_is_capped_by_max_replicas():
    policy = KVAutoscalePolicy(CFG)
    loads = [load(0.4, 100_000, 1000.0)]  # 100 s of queue
    d = policy.decide(loads, 1, 1, 0.0, ScaleState())
    assert policy.decide(loads, 1, 1, 5.0, d.state).num_replicas == 4


def slots(seq_fraction: float, kv: float) -> ReplicaLoad:
    """A replica whose sequence slots are seq_fraction full, kv of its blocks."""
    return ReplicaLoad(kv_usage=kv, num_waiting_tokens=0, tokens_per_s=1000.0,
                       seq_fraction=seq_fraction)  # fmt: skip


# (replica loads, running, target, expected (count, reason)); CFG's band is [0.2, 0.8],
# its middle 0.5, its wait threshold 1 s.
DESIRED = {
    "kv near the watermark, no queue: up to 2 * 0.875 / 0.5": (
        [load(0.9), load(0.85)], 2, 2, (4, "kv")),
    "under the watermark: hold": ([load(0.7)], 1, 1, (1, "hold")),
    # 16 of 16 slots taken and 4 more queued, 30% of the blocks: the slots bind, as the
    # kv router counts them (the fuller of the two).
    "full sequence slots scale up however many blocks are free": (
        [slots(1.25, 0.3)] * 2, 2, 2, (5, "kv")),
    "without a slot fraction the blocks decide": ([load(0.3)] * 2, 2, 2, (2, "hold")),
    # 0.35 on 4 is over kv_low_threshold, yet 3 would hold 0.47, under the middle:
    # over-provisioned, so down to 3 (Serve's rule too).
    "down once fewer keep occupancy under the middle": ([load(0.35)] * 4, 4, 4, (3, "low")),
    "3 would hold 0.53, over the middle: hold": ([load(0.4)] * 4, 4, 4, (4, "hold")),
    "the slot fraction counts on the way down too": ([slots(0.45, 0.05)] * 4, 4, 4, (4, "hold")),
    "down to the fewest that keep the middle: 4 * 0.15 / 0.5": (
        [load(0.15)] * 4, 4, 4, (2, "low")),
    "low occupancy but 0.9 s of wait: 4 keep it under 1 s": (
        [load(0.1, 900, 1000.0)] * 4, 4, 4, (4, "hold")),
    # One running, three asked for: a wait one more would cure still asks for the three.
    "pressure never undoes a scale-up in progress": ([load(0.4, 1500)], 1, 3, (3, "wait")),
    "3 s of queue: 3 replicas bring it to 1 s": ([load(0.4, 3000, 1000.0)], 1, 1, (3, "wait")),
    "a queue with no measured rate: one more": ([load(0.0, 10, 0.0)], 1, 1, (2, "wait")),
}  # fmt: skip


@pytest.mark.parametrize("case", DESIRED)
def test_desired_count_and_reason(case):
    loads, running, target, expected = DESIRED[case]
    assert KVAutoscalePolicy(CFG).desired(FleetLoad.of(loads), running, target) == expected


def test_slot_fraction_is_the_occupancy_when_fuller():
    fleet = FleetLoad.of([slots(1.25, 0.3)] * 2)
    assert fleet.kv_usage == pytest.approx(0.3) and fleet.occupancy == pytest.approx(1.25)
    assert fleet.demand == pytest.approx(2.5)


def test_scales_down_only_after_occupancy_stays_low_for_the_delay():
    policy = KVAutoscalePolicy(CFG)

    def loads_at(t: float):
        kv = 0.9 if 28.0 <= t < 29.0 else 0.05
        return [load(kv)] * 3

    targets = run(policy, loads_at, 3, [float(t) for t in range(0, 60)])
    # Low from 0: down to 1 at 20 s, the fewest that keep 3 * 0.05 under the band's middle.
    assert targets[19] == 3 and targets[20] == 1
    policy2 = KVAutoscalePolicy(CFG)
    # A spike at 28 s restarts the downscale wait, so a fleet held at 3 stays at 3 until 49 s.
    targets = run(policy2, lambda t: loads_at(t + 10.0), 3, [float(t) for t in range(0, 60)])
    assert targets[17] == 3 and targets[18] == 3 and targets[38] == 3 and targets[39] == 1


def test_bounds_and_no_metrics():
    cfg = AutoscaleConfig(
        min_replicas=2, max_replicas=3, upscale_delay_s=0.0, downscale_delay_s=0.0
    )
    policy = KVAutoscalePolicy(cfg)
    assert policy.decide([load(0.01)] * 2, 2, 2, 0.0, ScaleState()).num_replicas == 2
    assert policy.decide([load(0.99, 10**6)] * 2, 2, 2, 0.0, ScaleState()).num_replicas == 3
    held = policy.decide([], 0, 3, 0.0, ScaleState())
    assert held.num_replicas == 3 and held.reason == "no-metrics"


def test_delay_resets_when_the_direction_changes():
    n, s = apply_delay(3, 2, CFG, 0.0, ScaleState())
    assert n == 2 and s == ScaleState(1, 0.0)
    n, s = apply_delay(1, 2, CFG, 3.0, s)  # now down: the up wait is lost
    assert n == 2 and s == ScaleState(-1, 3.0)
    n, s = apply_delay(3, 2, CFG, 6.0, s)
    assert n == 2 and s == ScaleState(1, 6.0)
    n, s = apply_delay(3, 2, CFG, 11.0, s)
    assert n == 3 and s == ScaleState()
    assert ScaleState.from_dict(ScaleState(-1, 7.5).to_dict()) == ScaleState(-1, 7.5)


def test_serve_default_matches_rays_policy(monkeypatch):
    import ray.serve.autoscaling_policy as rsp
    from ray.serve._private.common import DeploymentID
    from ray.serve.autoscaling_policy import _apply_autoscaling_config, default_autoscaling_policy
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    cfg = AutoscaleConfig(
        min_replicas=1,
        max_replicas=8,
        upscale_delay_s=3.0,
        downscale_delay_s=7.0,
        target_ongoing_requests=4.0,
        upscaling_factor=0.5,
        downscaling_factor=0.5,
    )
    ray_cfg = AutoscalingConfig(
        min_replicas=1,
        max_replicas=8,
        upscale_delay_s=3.0,
        downscale_delay_s=7.0,
        target_ongoing_requests=4.0,
        upscaling_factor=0.5,
        downscaling_factor=0.5,
    )
    ray_policy = _apply_autoscaling_config(default_autoscaling_policy)
    ours = ServeDefaultPolicy(cfg)
    ongoing = [0, 5, 30, 30, 30, 30, 30, 9, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0] * 2 + [0] * 30
    current = target = 1
    ray_state: dict = {}
    state = ScaleState()
    seen = []
    for step, total in enumerate(ongoing):
        now = float(step)
        ctx = AutoscalingContext(
            deployment_id=DeploymentID(name="d", app_name="a"),
            deployment_name="d",
            app_name="a",
            current_num_replicas=current,
            target_num_replicas=target,
            running_replicas=[],
            total_num_requests=float(total),
            total_queued_requests=0.0,
            aggregated_metrics={},
            raw_metrics={},
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8,
            policy_state=ray_state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=ray_cfg,
        )
        # Serve's delay rule reads time.time(); give it this step's clock.
        monkeypatch.setattr(rsp.time, "time", lambda now=now: now)
        ray_n, ray_state = ray_policy(ctx)
        monkeypatch.undo()
        ray_n = max(1, min(8, ray_n))
        decision = ours.decide(float(total), current, target, now, state)
        state = decision.state
        assert decision.num_replicas == ray_n, f"step {step}: ongoing {total}"
        current = target = ray_n
        seen.append(ray_n)
    # The trace exercised both directions and the damping.
    assert max(seen) >= 4 and seen[-1] == 1 and len(set(seen)) >= 3


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"min_replicas": 0}, "min_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"upscale_delay_s": -1.0}, "upscale_delay_s"),
        ({"max_queue_wait_s": 0.0}, "max_queue_wait_s"),
        ({"kv_high_watermark": 1.5}, "kv_high_watermark"),
        ({"kv_low_threshold": 0.9, "kv_high_watermark": 0.8}, "kv_low_threshold"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
        ({"replica_start_s": -1.0}, "replica_start_s"),
        ({"trend_window_s": 0.0}, "trend_window_s"),
        ({"surge_z": -1.0}, "surge_z"),
        ({"headroom_rise_per_s": -0.1}, "headroom_rise_per_s"),
    ],
)
def test_config_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AutoscaleConfig(**kwargs)


def test_demand_trend_is_the_median_slope_over_the_window():
    history: tuple = ()
    slopes = []
    for step in range(40):  # decided every 0.25 s, demand rising 0.1/s
        t = step * 0.25
        slope, history = demand_trend(history, t, 0.5 + 0.1 * t, window_s=4.0)
        slopes.append(slope)
    assert slopes[1] == 0.0  # 0.25 s of points: under a tenth of the window, no trend yet
    assert slopes[2] == pytest.approx(0.1)
    assert slopes[-1] == pytest.approx(0.1)
    # Points at least a tenth of the window apart, none older than the window.
    times = [t for t, _ in history]
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.4 - 1e-9
    assert times[0] > 9.75 - 4.0
    # One burst in a flat window is no trend (least squares would read a rise after it).
    flat = tuple((float(t), 2.0 if t == 5 else 0.5) for t in range(10))
    assert demand_trend(flat, 10.0, 0.5, window_s=10.0)[0] == 0.0


def test_a_rising_demand_scales_up_before_occupancy_reaches_the_watermark():
    config = replace(CFG, max_replicas=8)
    # CFG's horizon: upscale_delay_s 5 + replica_start_s 30 = 35 s.
    assert config.trend_horizon_s == 35.0
    times = [float(t) for t in range(0, 12)]

    # One replica filling 3% a second: from 1 s (a tenth of the 10-s window) the trend
    # puts it past the watermark (0.8) within 35 s; after the 5-s delay, at 6 s, the
    # occupancy is 0.38 and the count is sized for the demand three horizons ahead,
    # 0.38 + 105 * 0.03 = 3.53, at the band's middle (0.5): 8. On occupancy alone it
    # would wait for 0.8, at 20 s, then 5 s more. Its arrivals rise with it (Little's law).
    def filling(rise: float):
        return lambda t: [load(0.2 + rise * t, admitted=5000.0 * (0.2 + rise * t))]

    targets = run(KVAutoscalePolicy(config), filling(0.03), 1, times)
    assert targets[5] == 1 and targets[6] == 8, targets
    # 0.5% a second stays under the watermark over the horizon: no scale-up.
    targets = run(KVAutoscalePolicy(config), filling(0.005), 1, times)
    assert targets == [1] * len(times)
    # A falling trend is not extrapolated: down waits for the load itself.
    policy = KVAutoscalePolicy(config)
    assert policy.desired(FleetLoad.of([load(0.7)]), 1, 1, -0.05) == (1, "hold")


def test_the_trend_is_read_from_the_arrivals_not_the_occupancy():
    config = replace(CFG, max_replicas=8)
    times = [float(t) for t in range(0, 12)]
    # Arrivals rising by a tenth of the first rate a second while the occupancy sits at
    # 0.3 (a lull: short outputs finishing as the rise comes in). By Little's law the
    # demand rises 0.3 * 100 / rate a second: at 6 s, 0.019/s puts it at 0.96 within the
    # 35-s horizon, past the watermark (0.8) since 1 s; sized for 0.3 + 105 * 0.019 at
    # the band's middle (0.5): 5. The occupancy's own slope is 0: no scale-up.
    rising = run(
        KVAutoscalePolicy(config), lambda t: [load(0.3, admitted=1000 + 100 * t)], 1, times
    )
    assert rising[5] == 1 and rising[6] == 5, rising
    # The occupancy rising 3% a second with the arrivals flat (the requests in the
    # replica staying longer, not more coming): no forecast; the level rules act at the
    # watermark, which 0.2 + 0.03 * 11 is not.
    filling = run(
        KVAutoscalePolicy(config), lambda t: [load(0.2 + 0.03 * t, admitted=1000)], 1, times
    )
    assert filling == [1] * len(times)
    # Nothing admitted (no rate reported): no trend to read.
    idle = run(KVAutoscalePolicy(config), lambda t: [load(0.2 + 0.03 * t)], 1, times)
    assert idle == [1] * len(times)


def test_slope_lower_bound_is_sens_confidence_rank():
    # On a line every pairwise slope is the slope, and so is the bound.
    line = tuple((float(t), 2.0 * t) for t in range(10))
    assert slope_lower_bound(line, 10.0, 20.0, window_s=10.5, z=1.64) == pytest.approx(2.0)
    # Five points, ten slopes (-1, 0, 1/3, 0.5, then six of 1): at z 1.64 the rank is
    # floor((10 - 1.64 * sqrt(5 * 4 * 15 / 18)) / 2) = 1, the smallest; at z 0 the 5th.
    bent = ((0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (3.0, 3.0))
    assert slope_lower_bound(bent, 4.0, 2.0, window_s=10.0, z=1.64) == pytest.approx(-1.0)
    assert slope_lower_bound(bent, 4.0, 2.0, window_s=10.0, z=0.0) == pytest.approx(1.0)
    # Four points are too few for a rank at 1.64: no bound.
    assert slope_lower_bound(bent[:3], 3.0, 3.0, window_s=10.0, z=1.64) == -math.inf
    # The window's tenth applies as to the slope: no bound from points 0.5 s apart.
    assert slope_lower_bound(((9.5, 1.0),), 10.0, 2.0, window_s=10.0, z=0.0) == -math.inf


SURGE_CFG = replace(CFG, max_replicas=16, surge_z=1.64)


def test_a_significant_rise_scales_up_without_the_delay():
    times = [float(t) for t in range(0, 12)]

    # Arrivals rising by a fifth of the first rate a second, the occupancy with them
    # (Little's law): the demand rises 0.2 * 0.2 = 0.04/s, and 35 s ahead it is past the
    # watermark from 1 s. The points lie on a line, so from five of them (4 s: Sen's
    # rank needs five at z 1.64) the lower bound is the slope itself: at 4 s the count is
    # sized for 0.36 + 105 * 0.04 at the band's middle (0.5), 10, without waiting out the
    # 5-s delay (the trend alone would land at 6 s, sized for 0.44 + 4.2: 10).
    def rising(noise: float):
        def loads_at(t: float):
            rate = 1.0 + 0.2 * t + (noise if int(t) % 2 else -noise)
            return [load(0.2 * rate, admitted=1000.0 * rate)]

        return loads_at

    policy = KVAutoscalePolicy(SURGE_CFG)
    targets = run(policy, rising(0.0), 1, times)
    assert targets[3] == 1 and targets[4] == 10, targets
    trend_only = run(KVAutoscalePolicy(replace(SURGE_CFG, surge_z=0.0)), rising(0.0), 1, times)
    assert trend_only[5] == 1 and trend_only[6] == 10, trend_only
    # The same rise with every other point 0.3 of the first rate off the line: the
    # median slope is the same, but its lower bound stays under the watermark's need
    # until the delay has run, so the trend waits it out.
    noisy = run(KVAutoscalePolicy(SURGE_CFG), rising(0.3), 1, times)
    assert noisy[5] == 1 and noisy[6] > 1, noisy
    decision = KVAutoscalePolicy(SURGE_CFG).desired(FleetLoad.of([load(0.3)]), 1, 1, 0.04, 0.04)
    assert decision == (9, "surge")  # 0.3 + 105 * 0.04 at 0.5
    assert KVAutoscalePolicy(SURGE_CFG).desired(FleetLoad.of([load(0.3)]), 1, 1, 0.04, 0.0)[1] == (
        "trend"
    )


HEADROOM_CFG = replace(CFG, headroom_rise_per_s=1.0 / 35)  # 1 over the 35-s horizon


def test_a_fleet_with_load_keeps_a_replicas_worth_of_headroom():
    times = [float(t) for t in range(0, 8)]
    # 0.2 on one replica: 0.6 under the watermark (0.8), less than the headroom's 1;
    # two replicas keep 1.4. The upscale waits out upscale_delay_s (5 s).
    targets = run(KVAutoscalePolicy(HEADROOM_CFG), lambda t: [load(0.2, admitted=100.0)], 1, times)
    assert targets == [1] * 5 + [2] * 3, targets
    policy = KVAutoscalePolicy(HEADROOM_CFG)
    decision = policy.decide([load(0.2, admitted=100.0)], 1, 1, 0.0, ScaleState())
    assert decision.reason == "headroom" and decision.state.direction == HEADROOM
    # No load at all: no headroom to keep (min_replicas decides).
    assert run(KVAutoscalePolicy(HEADROOM_CFG), lambda t: [load(0.0)], 1, times) == [1] * 8
    # Two at 0.1 would be one at 0.2 by the band's middle, but the headroom holds two.
    assert policy.desired(FleetLoad.of([load(0.1)] * 2), 2, 2) == (2, "hold")
    assert KVAutoscalePolicy(CFG).desired(FleetLoad.of([load(0.1)] * 2), 2, 2) == (1, "low")
    assert HEADROOM_CFG.headroom_replicas == pytest.approx(1.0)
    # 0.7 on one: 2 at the band's middle, 3 to keep 1 spare under 0.8.
    assert policy.desired(FleetLoad.of([load(0.7)]), 1, 1) == (3, "headroom")
    # Pressure is sized at the band's middle alone (the headroom follows on its clock).
    assert policy.desired(FleetLoad.of([load(0.9)]), 1, 1) == (2, "kv")
    # 3 * 0.15 = 0.45 on three: one spare replica's worth needs two, not three.
    assert policy.desired(FleetLoad.of([load(0.15)] * 3), 3, 3) == (2, "low")


def test_the_headroom_waits_on_its_own_clock():
    # Wanted for headroom from 0 s, then for a rise from 3 s: the rise's scale-up waits
    # its own 5 s (to 8 s), as without the headroom, not the 5 s the headroom started.
    n, s = apply_delay(2, 1, CFG, 0.0, ScaleState(), headroom=True)
    assert n == 1 and s == ScaleState(HEADROOM, 0.0)
    n, s = apply_delay(3, 1, CFG, 3.0, s)
    assert n == 1 and s == ScaleState(UP, 3.0)
    n, s = apply_delay(3, 1, CFG, 7.0, s)
    assert n == 1
    assert apply_delay(3, 1, CFG, 8.0, s)[0] == 3
    # And the headroom alone lands after its own delay.
    n, s = apply_delay(2, 1, CFG, 0.0, ScaleState(), headroom=True)
    assert apply_delay(2, 1, CFG, 5.0, s, headroom=True)[0] == 2
    # A rise pending since 3 s goes on waiting through a headroom tick: lands at 8 s.
    n, s = apply_delay(2, 1, CFG, 6.0, ScaleState(UP, 3.0), headroom=True)
    assert n == 1 and s == ScaleState(UP, 3.0)
    assert apply_delay(2, 1, CFG, 8.0, s, headroom=True)[0] == 2
