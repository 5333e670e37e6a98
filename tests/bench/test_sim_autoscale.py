"""bench.sim_autoscale: the simulated fleet starts, drains and counts replicas as asked."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bench import sim
from bench.sim_autoscale import (
    RUNNING,
    AutoscaleFleet,
    FleetConfig,
    parse_policy,
    parse_rate_profile,
    profile_arrivals,
    run_autoscaled,
)
from bench.sim_core import SimConfig
from bench.sim_model import default_cost_model
from bench.sim_replica import ReplicaSimConfig
from bench.sim_workload import Workload, WorkloadConfig
from router import RouterConfig
from router.autoscale import AutoscaleConfig, ScaleDecision

COST = default_cost_model()
# Small replicas (16 sequences) so a few hundred requests/s need several of them.
SIM = SimConfig(replica=ReplicaSimConfig(num_blocks=1024, max_num_seqs=16))
# No headroom: the fleet's mechanics (scale to the load and back to one); the headroom has
# its own test.
CONFIG = AutoscaleConfig(
    min_replicas=1, max_replicas=4, upscale_delay_s=1.0, downscale_delay_s=3.0,
    kv_high_watermark=0.7, headroom_rise_per_s=0.0,
)  # fmt: skip


class Scripted:
    """A policy that asks for the counts given, one per control tick (then the last)."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.calls: list[tuple[int, int]] = []  # (current, target) as the fleet reported

    def decide(self, _signal, current: int, target: int, now_s: float, state) -> ScaleDecision:
        self.calls.append((current, target))
        return ScaleDecision(self.targets[min(len(self.calls), len(self.targets)) - 1], state)


def ramp(peak: float, seed: int = 0) -> Workload:
    """Rises to `peak` req/s over 4 s, holds 4 s, falls back, then 8 s of a trickle."""
    points = [(0.0, 20.0), (4.0, peak), (8.0, peak), (12.0, 20.0), (20.0, 20.0)]
    arrival_s = profile_arrivals(points, seed)
    workload = Workload(WorkloadConfig(num_requests=len(arrival_s), rate=peak, seed=seed))
    workload.arrival_s = arrival_s
    return workload


def scripted_run(targets, workload, router="kv", start_s=2.0, watch=None):
    fleet = AutoscaleFleet("kv", CONFIG, FleetConfig(replica_start_s=start_s, period_s=1.0))
    fleet.policy = Scripted(targets)
    if watch is not None:
        watch(fleet)
    from bench.sim_core import simulate

    result = simulate(router, workload, SIM, COST, keep_times=True, fleet=fleet)
    return fleet, result


def test_routers_see_only_running_replicas_and_a_drain_cuts_nothing():
    # 1 -> 3 replicas at t=0 (routable at 2 s), back to 1 at t=9: two drain under load.
    routed = []

    def watch(fleet):
        make = fleet.make_router

        def make_router(*args):
            router = make(*args)
            route = router.route

            def checked(rid, now_s, attempt, held_since_s):
                replica, delay = route(rid, now_s, attempt, held_since_s)
                if replica >= 0:
                    routed.append((now_s, replica, fleet.state[replica], rid))
                return replica, delay

            router.route = checked
            return router

        fleet.make_router = make_router

    for router in ("kv", "serve_pow2"):
        routed.clear()
        workload = ramp(250)
        fleet, result = scripted_run([3] * 9 + [1], workload, router=router, watch=watch)
        assert result["num_completed"] + result["num_rejected"] == len(workload)
        assert result["num_rejected"] == 0 or router == "kv"
        assert all(state == RUNNING for _, _, state, _ in routed), router
        early = {replica for t, replica, _, _ in routed if t < 2.0}
        assert early == {0}, router  # the two started at 0 take nothing before 2 s
        assert {replica for t, replica, _, _ in routed if 2.5 < t < 9.0} == {0, 1, 2}, router
        drained = [i for t, kind, i in fleet.events if kind == "drain"]
        assert len(drained) == 2 and {i for t, kind, i in fleet.events if t == 9.0} == set(drained)
        (kept,) = {0, 1, 2} - set(drained)
        assert {replica for t, replica, _, _ in routed if t > 9.0} == {kept}, router
        # Each drained replica stopped only after the last request it carried finished.
        finish = np.array(result["finish_s"])
        for slot in drained:
            (stop_s,) = [t for t, kind, i in fleet.events if i == slot and kind == "stop"]
            mine = [rid for _, replica, _, rid in routed if replica == slot]
            assert mine and np.all(finish[mine] > 0) and stop_s >= finish[mine].max()


def test_start_takes_replica_start_s_and_a_cancelled_start_counts_until_cancelled():
    workload = ramp(100)
    fleet, result = scripted_run([2, 2, 1], workload, start_s=5.0)
    events = [(t, kind, i) for t, kind, i in fleet.events if i == 1]
    assert events == [(0.0, "start", 1), (2.0, "cancel", 1)]  # never became routable
    assert all(s[1] == 0 for s in fleet.timeline[3:])  # nothing starting after the cancel
    # Replica 0 ran throughout; replica 1 held a GPU for the 2 s it was starting.
    end_s = float(workload.arrival_s[0]) + result["sim_s"]
    assert fleet.metrics(end_s)["replica_seconds"] == pytest.approx(end_s + 2.0)


def test_replica_seconds_and_peak_from_the_timeline():
    workload = ramp(100)
    fleet, result = scripted_run([1, 3, 3, 3, 3, 3, 3, 3, 2], workload, start_s=2.0)
    end_s = float(workload.arrival_s[0]) + result["sim_s"]
    metrics = fleet.metrics(end_s)
    stops = {i: t for t, kind, i in fleet.events if kind == "stop"}
    (drained,) = stops  # one of the three left, after its drain
    drain_s = next(t for t, kind, i in fleet.events if kind == "drain")
    assert drain_s == 8.0 and stops[drained] >= drain_s
    # Replica 0 all along, one more from 1 s to the end, one from 1 s to its stop.
    assert metrics["replica_seconds"] == pytest.approx(end_s + (end_s - 1.0) + stops[drained] - 1.0)
    assert metrics["peak_replicas"] == 3
    assert fleet.policy.calls[2] == (1, 3)  # still starting at 2 s: running 1, target 3
    assert fleet.policy.calls[4] == (3, 3)


def test_kv_policy_scales_up_under_a_ramp_and_back_down():
    # Serve's pow2 router queues at the replicas, where the KV policy's signals are.
    workload = ramp(300, seed=1)
    fleet_config = FleetConfig(replica_start_s=2.0, period_s=0.5, look_back_s=1.0)
    result = run_autoscaled("serve-pow2", "kv", workload, SIM, COST, CONFIG, fleet_config)
    counts = [run for _, _, run, _, _ in result["timeline"]]
    assert counts[0] == 1 and max(counts) >= 3 and counts[-1] == 1, counts
    assert result["num_drained"] >= 2
    assert result["num_completed"] + result["num_rejected"] == len(workload)
    assert result["peak_replicas"] == max(s + r + d for _, s, r, d, _ in result["timeline"])


def test_a_trickle_keeps_a_replicas_worth_of_headroom():
    # 20 req/s for 20 s: a few percent of one 16-slot replica. The arrivals rising from
    # nothing at the start read as a trend (up to 4); once that is over the fleet scales
    # back down (3-s delay) to one without the headroom, to two with the default's
    # (0.025/s over the 31-s horizon: 0.78 of a replica).
    points = [(0.0, 20.0), (20.0, 20.0)]
    arrival_s = profile_arrivals(points, 0)
    workload = Workload(WorkloadConfig(num_requests=len(arrival_s), rate=20.0, seed=0))
    workload.arrival_s = arrival_s
    fleet_config = FleetConfig(replica_start_s=2.0, period_s=0.5, look_back_s=1.0)
    ends = {}
    for headroom in (AutoscaleConfig().headroom_rise_per_s, 0.0):
        config = replace(CONFIG, headroom_rise_per_s=headroom)
        result = run_autoscaled("kv", "kv", workload, SIM, COST, config, fleet_config)
        assert result["num_completed"] == len(workload)
        held = [(t, start + run) for t, start, run, _, _ in result["timeline"]]
        ends[headroom] = {n for t, n in held if t >= 15.0}
        assert result["num_drained"] + result["num_cancelled"] >= 1, held
    assert ends == {AutoscaleConfig().headroom_rise_per_s: {2}, 0.0: {1}}, ends


def test_serve_default_follows_ongoing_requests_over_its_target():
    workload = ramp(300, seed=1)
    fleet_config = FleetConfig(replica_start_s=2.0, period_s=0.5, look_back_s=1.0)
    peaks, replica_s = {}, {}
    for spec in ("serve-default:2", "serve-default:64"):
        result = run_autoscaled("serve-pow2", spec, workload, SIM, COST, CONFIG, fleet_config)
        assert result["num_completed"] == len(workload)
        peaks[spec] = result["peak_replicas"]
        replica_s[spec] = result["replica_seconds"]
        assert result["autoscale_config"]["target_ongoing_requests"] == float(spec.split(":")[1])
    # 16 sequences a replica: a target of 2 asks for the maximum at the first requests;
    # 64 waits for a queue that deep, so it holds fewer replicas for less time.
    assert peaks["serve-default:2"] == 4, peaks
    assert replica_s["serve-default:2"] > 1.2 * replica_s["serve-default:64"], replica_s


def test_invalid_settings_raise_naming_the_field():
    with pytest.raises(ValueError, match="autoscale"):
        parse_policy("serve-default:x", CONFIG)
    with pytest.raises(ValueError, match="autoscale"):
        parse_policy("hpa", CONFIG)
    assert parse_policy("serve-default", CONFIG)[0] == "serve-default:2"
    for bad in ("0:1", "1:5,2:5", "0:1,0:2", "0:1,5:x", "0:0,5:0", "0:1;5:2"):
        with pytest.raises(ValueError, match="rate_profile"):
            parse_rate_profile(bad)
    with pytest.raises(ValueError, match="replica_start_s"):
        FleetConfig(replica_start_s=-1.0)
    with pytest.raises(ValueError, match="autoscale_period_s"):
        FleetConfig(period_s=0.0)
    with pytest.raises(ValueError, match="routers"):
        run_autoscaled("dynamo", "kv", ramp(50), SIM, COST, CONFIG, FleetConfig())


def test_profile_arrivals_follow_the_rate():
    arrival_s = profile_arrivals([(0.0, 0.0), (100.0, 200.0)], seed=0)
    # Rate 2t: about 10,000 requests, three quarters of them in the second half.
    assert len(arrival_s) == pytest.approx(10_000, rel=0.05)
    assert np.mean(arrival_s > 50.0) == pytest.approx(0.75, abs=0.02)
    assert np.all(np.diff(arrival_s) >= 0)


def test_cli_writes_each_policy(tmp_path):
    out = tmp_path / "r.json"
    sim.main([
        "--autoscale", "kv,serve-default:16", "--rate-profile", "0:20,3:150,6:20,8:20",
        "--max-replicas", "3", "--replica-start-s", "1", "--upscale-delay-s", "0.5",
        "--downscale-delay-s", "2", "--max-num-seqs", "16", "--num-blocks", "1024",
        "--upscale-kv-usage", "0.7", "--out", str(out), "--plot", str(tmp_path / "p.png"),
    ])  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert [r["autoscale"] for r in results] == ["kv", "serve-default:16"]
    for r in results:
        for key in ("slo_attainment", "goodput_rps", "ttft_p50_s", "ttft_p99_s",
                    "replica_seconds", "peak_replicas", "timeline"):  # fmt: skip
            assert key in r
        assert r["router"] == "kv" and r["replica_seconds"] > 0
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_a_hold_that_runs_out_ends_and_the_run_finishes():
    # queue_fraction 0 holds requests at the router while the one replica is full. A hold
    # once ended at max_hold_s - elapsed, which for this arrival time is a positive
    # remainder under the clock's float resolution (the retry backoffs add up to 3 s
    # but for one ulp): the retry landed at the same instant, forever, and the run hung.
    arrival_1_s = 1.004
    slow = replace(COST, a_ms=200.0)  # 30 decode steps keep the replica full for ~6 s
    workload = Workload.from_trace(
        [0.0, arrival_1_s], [list(range(992)), [7] * 16], [30, 1], offered_rate=2.0
    )
    sim_config = SimConfig(
        replica=ReplicaSimConfig(num_blocks=64, max_num_seqs=16),  # the first takes 62
        router=RouterConfig(queue_fraction=0.0, max_hold_s=3.0),
    )
    config = AutoscaleConfig(min_replicas=1, max_replicas=1)
    result = run_autoscaled("kv", "kv", workload, sim_config, slow, config, FleetConfig())
    assert result["num_completed"] == 1 and result["num_rejected"] == 1
    assert result["num_held"] == 1
