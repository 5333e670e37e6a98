"""The cluster simulator: determinism, conservation, policy orderings, cost-model fit."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from bench import sim_replica
from bench.sim_core import SimConfig, simulate
from bench.sim_model import CostModel, default_cost_model, fit_cost_model
from bench.sim_replica import ReplicaSimConfig
from bench.sim_workload import Workload, WorkloadConfig
from router import RouterConfig

COST = default_cost_model()


def run(policy: str, workload: WorkloadConfig, **config) -> dict:
    return simulate(policy, Workload(workload), SimConfig(**config), COST)


def stable(result: dict) -> dict:
    timing = {"wall_s", "route_us_mean", "route_s_total"}
    return {k: v for k, v in result.items() if k not in timing}


@pytest.mark.parametrize(
    "policy", ["kv", "prefix", "pow2", "sglang", "dynamo", "serve_pow2", "random"]
)
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


@pytest.mark.parametrize("rate", [1800, 3400])
def test_kv_beats_random_on_p99_ttft_under_imbalance(rate):
    # Long-tailed lengths: random piles long prompts onto some replicas. Strict least-load
    # order (balance_band 0) lost to random here: it sent runs of requests to the replica
    # with the least KV in use (BENCHMARKS.md, "the kv balance band").
    wl = WorkloadConfig(dataset="long_tail", num_requests=2000, rate=rate, seed=1)
    config = dict(num_replicas=4, stats_period_s=0.02, stats_delay_s=0.02)
    kv = run("kv", wl, **config)["ttft_ms"]["p99"]
    rnd = run("random", wl, **config)["ttft_ms"]["p99"]
    strict = run("kv", wl, router=RouterConfig(balance_band=0.0), **config)["ttft_ms"]["p99"]
    assert kv < rnd < strict, (kv, rnd, strict)


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


# ---- replaying traces and validating against a measured run (bench/sim_validate.py) ----


def test_trace_prompts_share_exactly_their_common_blocks():
    head = list(range(64))  # 4 blocks of 16
    prompts = [head + [900 + i] * 20 for i in range(3)] + [[7] * 84]
    wl = Workload.from_trace([0.0, 0.01, 0.02, 0.03], prompts, [8, 8, 8, 8], offered_rate=100)
    wl.set_block_size(16)
    firsts = [wl.block_hashes(rid, 5) for rid in range(4)]
    assert firsts[0][:4] == firsts[1][:4] == firsts[2][:4]
    assert len({f[4] for f in firsts[:3]}) == 3  # the fifth blocks differ
    assert not set(firsts[3]) & set(firsts[0])
    assert wl.block_hashes(0, 7)[5:] != wl.block_hashes(1, 7)[5:]  # generated: private
    result = simulate("prefix", wl, SimConfig(num_replicas=1), COST)
    assert result["num_completed"] == 4
    assert result["cache_hit_rate"] > 0  # later prompts reuse the shared head


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_closed_loop_keeps_at_most_concurrency_requests_in_flight(policy):
    wl = Workload(WorkloadConfig(num_requests=200, rate=1e6, seed=2))
    concurrency = 7
    config = SimConfig(num_replicas=2, concurrency=concurrency)
    result = simulate(policy, wl, config, COST, keep_times=True)
    assert result["num_completed"] == 200
    arrivals, finishes = result["arrival_s"], result["finish_s"]
    assert arrivals[:concurrency] == [0.0] * concurrency
    events = sorted([(t, 1) for t in arrivals] + [(t, -1) for t in finishes])
    in_flight = max_in_flight = 0
    for _, delta in events:  # at equal times a finish (-1) sorts first: it frees the user
        in_flight += delta
        max_in_flight = max(max_in_flight, in_flight)
    assert max_in_flight == concurrency
    # every later request starts exactly when an earlier one ended
    assert set(arrivals[concurrency:]) <= set(finishes)


def load_result(tmp_path, runs: dict, workload: dict, target: dict, kv_samples=()) -> str:
    """A result file in bench/load.py's --out format (the fields validation reads and more)."""
    payload = {
        "date": "2026-11-21",
        "machine": "test",
        "command": "python -m bench.load ...",
        "workload": workload,
        "target": target,
        "runs": {
            router: {
                "metrics": metrics,
                "leak_check": {"ok": True, "replicas": []},
                "generator": [],
                "kv_samples": list(kv_samples),
            }
            for router, metrics in runs.items()
        },
        "ratios_vs_serve-pow2": {},
    }
    path = tmp_path / "load.json"
    path.write_text(json.dumps(payload))
    return str(path)


def measured_metrics(throughput: float, ttft_p50_ms: float, ttft_p99_ms: float) -> dict:
    """bench.load_metrics.compute_metrics' shape, with the compared fields set."""
    ms = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {
        "num_requests": 60, "completed": 60, "rejected": 0, "errors": 0, "lost": 0,
        "duration_s": 1.0, "request_throughput": throughput / 10,
        "output_token_throughput": throughput, "total_token_throughput": throughput,
        "ttft_ms": ms | {"p50": ttft_p50_ms, "p99": ttft_p99_ms}, "tpot_ms": ms,
        "itl_ms": ms, "e2e_ms": ms,
    }  # fmt: skip


def test_validate_replays_the_run_and_reports_relative_errors(tmp_path, capsys):
    from bench.load_workload import WorkloadConfig as LoadWorkloadConfig
    from bench.load_workload import build_trace
    from bench.sim import parser
    from bench.sim_validate import validate

    load_workload = LoadWorkloadConfig(
        num_requests=60, rate=50.0, dataset="prefix", input_len=40, output_len=12,
        num_prefixes=2, prefix_len=64, vocab_size=500, seed=5,
    )  # fmt: skip
    workload = dataclasses.asdict(load_workload) | {"concurrency": None}
    target = {"app_name": "kvfleet", "model": "gpt2", "replicas": 2, "routers": "kv,serve-pow2",
              "router": "kv", "num_blocks": 300, "max_num_seqs": 32, "block_size": 16,
              "device": "cuda", "on_overload": "hold", "num_procs": 2}  # fmt: skip
    # What the simulator predicts for that trace and target, by hand:
    trace = build_trace(load_workload)
    replay = Workload.from_trace(
        [s.arrival_s for s in trace], [s.prompt_token_ids for s in trace],
        [s.max_tokens for s in trace], offered_rate=50.0,
    )  # fmt: skip
    replica = ReplicaSimConfig(num_blocks=300, block_size=16, max_num_seqs=32,
                               max_num_batched_tokens=8192)  # fmt: skip
    # num_procs 2: one router per generator process.
    config = SimConfig(num_replicas=2, replica=replica, seed=5, num_routers=2)
    expected = simulate("kv", replay, config, COST)
    measured = measured_metrics(
        throughput=2 * expected["output_tokens_per_s"],
        ttft_p50_ms=expected["ttft_ms"]["p50"] / 2,
        ttft_p99_ms=expected["ttft_ms"]["p99"] * 1.25,
    )
    path = load_result(
        tmp_path,
        {"kv": measured, "serve-pow2": measured, "serve-consistent-hash": measured},
        workload,
        target,
    )
    report = validate(path, parser().parse_args(["--validate", path]), COST)["validation"]
    kv = report["kv"]["metrics"]
    assert kv["output_tokens_per_s"]["rel_error"] == pytest.approx(-0.5)
    assert kv["ttft_p50_ms"]["rel_error"] == pytest.approx(1.0)
    assert kv["ttft_p99_ms"]["rel_error"] == pytest.approx(-0.2)
    assert kv["output_tokens_per_s"]["predicted"] == expected["output_tokens_per_s"]
    assert report["kv"]["predicted"]["num_completed"] == 60
    assert report["serve-pow2"]["policy"] == "serve_pow2"
    assert report["serve-consistent-hash"]["policy"] == "serve_consistent_hash"
    printed = capsys.readouterr().out
    assert "| kv | ttft_p50_ms |" in printed and "+100.0%" in printed


def test_validate_replays_a_trace_run_at_its_timestamps(tmp_path):
    """A bench.load --trace run records the trace file and its replay settings, not a
    WorkloadConfig: the validation replays that file as the run did (its arrivals spread
    over the window, not all at 0), and reads num_replicas as ClusterConfig names it."""
    from bench.sim_validate import trace_workload
    from bench.trace import ReplayConfig, read_trace, replay

    small = os.path.join(os.path.dirname(__file__), "data", "mooncake_small.jsonl")
    config = ReplayConfig(time_scale=0.01, length_scale=1 / 32, vocab_size=499)
    workload = {"trace": small, "trace_format": "mooncake", "num_requests": 48} | (
        dataclasses.asdict(config)
    )
    expected = replay(read_trace(small, "mooncake"), config)
    rebuilt = trace_workload(workload)
    assert rebuilt.arrival_s.tolist() == [r.arrival_s for r in expected]
    assert rebuilt.arrival_s[-1] > 0
    assert rebuilt.prompts == [tuple(r.prompt_token_ids) for r in expected]
    target = {"num_replicas": 2, "num_blocks": 300, "max_num_seqs": 32, "block_size": 16,
              "on_overload": "hold", "num_procs": 1}  # fmt: skip
    measured = measured_metrics(throughput=100.0, ttft_p50_ms=10.0, ttft_p99_ms=20.0)
    path = load_result(tmp_path, {"prefix": measured}, workload, target)
    from bench.sim import parser
    from bench.sim_validate import validate

    report = validate(path, parser().parse_args(["--validate", path]), COST)["validation"]
    assert report["prefix"]["predicted"]["num_completed"] == len(expected)


def test_validate_infers_the_pool_size_from_kv_samples(tmp_path):
    from bench.sim import parser
    from bench.sim_validate import replica_overrides

    samples = [
        {"t_s": 0.0, "replica_id": "a", "kv_usage": 0.0, "num_running": 0, "num_waiting": 0,
         "num_blocks_free": 1000, "num_blocks_cached": 200},
        {"t_s": 0.2, "replica_id": "a", "kv_usage": 0.25, "num_running": 3, "num_waiting": 0,
         "num_blocks_free": 800, "num_blocks_cached": 100},
        {"t_s": 0.4, "replica_id": "b", "kv_usage": 0.9, "num_running": 9, "num_waiting": 2,
         "num_blocks_free": 100, "num_blocks_cached": 21},
    ]  # fmt: skip
    target = {"replicas": 2, "num_blocks": None, "block_size": 32, "max_num_seqs": 64}
    workload = {"num_requests": 4, "rate": 10.0, "concurrency": 8}
    path = load_result(tmp_path, {"kv": {}}, workload, target, samples)
    result = json.loads(open(path).read())
    overrides = replica_overrides(result, parser().parse_args([]))
    assert overrides["num_blocks"] == 1200
    assert (overrides["block_size"], overrides["max_num_seqs"]) == (32, 64)
    assert overrides["concurrency"] == 8
    explicit = replica_overrides(result, parser().parse_args(["--num-blocks", "512"]))
    assert explicit["num_blocks"] == 512
    result["runs"]["kv"]["kv_samples"] = []
    with pytest.raises(SystemExit, match="--num-blocks"):
        replica_overrides(result, parser().parse_args([]))


def test_peer_prefix_index_matches_its_trees():
    from bench.sim_policies import ApproxPrefixIndex

    rng = random.Random(0)
    index = ApproxPrefixIndex(num_workers=6, max_blocks_per_worker=12)
    chains = [[rng.getrandbits(40) for _ in range(10)] for _ in range(4)]
    for _ in range(400):
        chain = rng.choice(chains)
        index.insert(rng.randrange(6), chain[: rng.randrange(1, 11)] + [rng.getrandbits(40)])
        query = rng.choice(chains)[: rng.randrange(0, 11)]
        expected = []
        for tree in index.trees:
            depth = 0
            while depth < len(query) and query[depth] in tree:
                depth += 1
            expected.append(depth)
        assert index.overlaps(query).tolist() == expected
        assert index.sizes.tolist() == [len(t) for t in index.trees]
        assert all(len(t) <= 12 for t in index.trees)


def test_many_routers_on_stale_snapshots_herd_and_fresh_ones_do_not():
    # Closed loop, slots (not KV) binding: 16 routers that each see replicas 250 ms late
    # send waves to whichever replica their snapshot shows lightest (as on 4 H200s,
    # BENCHMARKS.md); one router, or snapshots a few ms old (the carrier path), do not.
    wl = WorkloadConfig(dataset="random", num_requests=3000, seed=0)

    def tokens_per_s(num_routers: int, stats_delay_s: float) -> float:
        replica = ReplicaSimConfig(num_blocks=16384, max_num_seqs=128)
        result = run("kv", wl, num_replicas=4, concurrency=512, replica=replica,
                     num_routers=num_routers, stats_delay_s=stats_delay_s)  # fmt: skip
        assert result["num_completed"] == 3000
        return result["output_tokens_per_s"]

    herding = tokens_per_s(16, 0.25)
    assert herding < 0.9 * tokens_per_s(1, 0.25)
    assert herding < 0.9 * tokens_per_s(16, 0.005)


def test_num_routers_must_be_positive():
    with pytest.raises(ValueError, match="num_routers"):
        SimConfig(num_routers=0)


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_a_replicas_request_path_caps_its_request_rate(policy):
    """serve_request_s: each replica takes one request per serve_request_s before its
    engine sees it, so a saturated closed loop completes at most 1/serve_request_s
    requests/s per replica, and TTFT includes the wait."""
    wl = WorkloadConfig(num_requests=600, rate=1e6, output_min=16, output_max=16, seed=3)
    free = run(policy, wl, num_replicas=2, concurrency=256)
    capped = run(policy, wl, num_replicas=2, concurrency=256, serve_request_s=0.005)
    assert capped["num_completed"] == free["num_completed"] == 600
    assert capped["throughput_req_s"] <= 2 / 0.005 * 1.01 < free["throughput_req_s"]
    assert capped["throughput_req_s"] > 0.9 * 2 / 0.005  # the path is the bottleneck
    assert capped["ttft_ms"]["p50"] > 5 * free["ttft_ms"]["p50"]


def test_serve_request_s_must_not_be_negative():
    with pytest.raises(ValueError, match="serve_request_s"):
        SimConfig(serve_request_s=-1.0)
