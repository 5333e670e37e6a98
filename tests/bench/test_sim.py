"""The cluster simulator: determinism, conservation, policy orderings, cost-model fit."""

from __future__ import annotations

import random

import pytest

from bench import sim_replica
from bench.sim import SimConfig, simulate
from bench.sim_model import CostModel, default_cost_model, fit_cost_model
from bench.sim_replica import ReplicaSimConfig
from bench.sim_workload import Workload, WorkloadConfig

COST = default_cost_model()


def run(policy: str, workload: WorkloadConfig, **config) -> dict:
    return simulate(policy, Workload(workload), SimConfig(**config), COST)


def stable(result: dict) -> dict:
    timing = {"wall_s", "route_us_mean", "route_s_total"}
    return {k: v for k, v in result.items() if k not in timing}


@pytest.mark.parametrize("policy", ["kv", "prefix", "pow2", "sglang", "dynamo", "random"])
def test_same_seed_same_result(policy):
    wl = WorkloadConfig(dataset="shared_prefix", num_requests=300, rate=2500, seed=3)
    first = run(policy, wl, num_replicas=3)
    assert stable(first) == stable(run(policy, wl, num_replicas=3))
    assert stable(first) != stable(run(policy, WorkloadConfig(**{**wl.__dict__, "seed": 4}),
                                       num_replicas=3))  # fmt: skip


@pytest.mark.parametrize("dataset", ["random", "shared_prefix", "long_tail"])
@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_no_request_lost_and_blocks_balance(monkeypatch, dataset, policy):
    schedule = sim_replica.SimReplica.schedule

    def checked(self, now_s):
        self.check_invariants()
        end_s = schedule(self, now_s)
        self.check_invariants()
        return end_s

    monkeypatch.setattr(sim_replica.SimReplica, "schedule", checked)
    # A small KV pool under overload: preemption and recompute must not lose anyone.
    result = run(
        policy, WorkloadConfig(dataset=dataset, num_requests=400, rate=4000),
        num_replicas=2, replica=ReplicaSimConfig(num_blocks=600, max_num_seqs=64),
    )  # fmt: skip
    assert result["num_completed"] == result["num_requests"] == 400
    assert result["num_rejected"] == 0
    if dataset == "random":
        assert result["num_preempted"] > 0


def test_prefix_policies_hit_the_cache_more_than_round_robin():
    wl = WorkloadConfig(dataset="shared_prefix", num_requests=1000, rate=600, num_prefixes=40)
    # 40 prefixes of 32 blocks: one replica's cache holds about a third of them.
    config = dict(num_replicas=4, replica=ReplicaSimConfig(num_blocks=600))
    rr = run("round_robin", wl, **config)["cache_hit_rate"]
    # The real prefix policy matches on published summaries 50-150 ms old, while
    # LRU churn from unique suffix blocks evicts prefixes within a few hundred ms:
    # it gains little here. SGLang's router-side tree sticks at once.
    assert run("prefix", wl, **config)["cache_hit_rate"] > rr
    assert run("sglang", wl, **config)["cache_hit_rate"] > rr + 0.1


@pytest.mark.xfail(
    reason="open: in this model kv's p99 TTFT is 10-25% worse than random on long_tail at "
    "1800-3400 req/s on 4 replicas (5.5 vs 5.0 ms); not yet explained (herding within a "
    "stats period, or a simulator error)",
    strict=False,
)
def test_kv_beats_random_on_p99_ttft_under_imbalance():
    # Long-tailed lengths: random piles long prompts onto some replicas.
    wl = WorkloadConfig(dataset="long_tail", num_requests=2000, rate=1800, seed=1)
    config = dict(num_replicas=4, stats_period_s=0.02, stats_delay_s=0.02)
    kv = run("kv", wl, **config)["ttft_ms"]["p99"]
    rnd = run("random", wl, **config)["ttft_ms"]["p99"]
    assert kv < rnd, (kv, rnd)


def test_fit_recovers_known_coefficients():
    truth = CostModel(0.7, 3e-3, 4e-3, 2e-5)
    rng = random.Random(0)
    points = []
    for _ in range(40):
        p, n, c = rng.randrange(0, 2048), rng.randrange(1, 256), rng.randrange(0, 200_000)
        points.append((p, n, c, truth.step_s(p, n, c) * 1e3))
    fitted = fit_cost_model(points)
    for name, value in truth.as_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6)


def test_fit_keeps_unidentifiable_coefficients_at_default():
    truth = CostModel(0.9, 5e-3, 2e-3, 1e-5)
    points = [
        (0, n, c, truth.step_s(0, n, c) * 1e3)
        for n, c in [(1, 100), (64, 9000), (200, 30000), (128, 40000)]
    ]  # noqa: E501
    fitted = fit_cost_model(points, default=truth)
    assert fitted.b_ms_per_prefill_token == truth.b_ms_per_prefill_token
    assert fitted.c_ms_per_decode_seq == pytest.approx(truth.c_ms_per_decode_seq, rel=1e-6)


def test_default_model_reproduces_the_h200_points():
    assert COST.step_s(0, 1, 192) * 1e3 == pytest.approx(0.86, abs=1e-6)
    assert COST.step_s(0, 64, 64 * 500) * 1e3 == pytest.approx(1.38, abs=1e-6)
    assert COST.step_s(0, 256, 256 * 190) * 1e3 == pytest.approx(1.99, abs=1e-6)
