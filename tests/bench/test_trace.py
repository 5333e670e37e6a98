"""Mooncake trace replay and synthesis (bench/trace.py), and the simulator's --trace runs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import sim
from bench.load_workload import trace_specs
from bench.sim_core import SimConfig, simulate
from bench.sim_model import default_cost_model
from bench.sim_policies import ServeConsistentHashRouter, policy_name
from bench.sim_replica import ReplicaSimConfig
from bench.trace import (
    MOONCAKE_BLOCK_TOKENS,
    ReplayConfig,
    SynthConfig,
    TraceRequest,
    describe,
    read_mooncake,
    replay,
    synthesize,
    write_mooncake,
)
from replica.hashing import prefix_block_hashes

DATA = os.path.join(os.path.dirname(__file__), "data")
SMALL = os.path.join(DATA, "mooncake_small.jsonl")
HOT = os.path.join(DATA, "mooncake_hot.jsonl")


def line(**fields) -> str:
    record = {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [7, 8, 9]}
    return json.dumps({**record, **fields})


def test_equal_block_ids_give_identical_blocks_and_the_tail_is_the_requests_own():
    requests = [
        TraceRequest(0.0, 2 * 512 + 100, 320, (1, 2, 90)),
        TraceRequest(1000.0, 3 * 512 + 40, 32, (1, 2, 3, 91)),
        TraceRequest(2000.0, 2 * 512 + 100, 320, (1, 5, 92)),
    ]
    a, b, c = replay(requests, ReplayConfig(length_scale=1 / 32))
    assert len(a.prompt_token_ids) == 2 * 16 + round(100 / 32)
    assert len(b.prompt_token_ids) == 3 * 16 + round(40 / 32)
    assert (a.max_tokens, b.max_tokens) == (10, 1)
    ha, hb, hc = (prefix_block_hashes(r.prompt_token_ids, 16) for r in (a, b, c))
    assert ha[:2] == hb[:2] and ha[0] == hc[0]
    assert ha[1] != hc[1]  # id 5 is not id 2
    assert hb[2] not in ha  # b's third block is its id 3, not a's tail
    assert a.prompt_token_ids[32:] != c.prompt_token_ids[32:]  # own tails differ
    assert a.family == b.family == c.family == 1


def test_time_scale_and_window():
    requests = [TraceRequest(1000.0 * t, 600, 8, (t, 100 + t)) for t in range(10)]
    replayed = replay(requests, ReplayConfig(time_scale=0.5, start_s=2.0, duration_s=3.0))
    assert [r.line for r in replayed] == [2, 3, 4]
    assert [r.arrival_s for r in replayed] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="start_s / duration_s"):
        replay(requests, ReplayConfig(start_s=50.0))


@pytest.mark.parametrize(
    "bad, field",
    [
        (line(timestamp="soon"), "timestamp"),
        (line(input_length=0), "input_length"),
        (line(output_length=2.5), "output_length"),
        (line(hash_ids=[1]), "hash_ids"),  # 1100 tokens are 2 full blocks
        (line(hash_ids=[1, -2, 3]), "hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ],
)
def test_a_malformed_line_names_its_field_and_line(tmp_path, bad, field):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n\n" + bad + "\n")
    with pytest.raises(ValueError, match=rf"t.jsonl:3: .*{field}"):
        read_mooncake(str(path))


@pytest.mark.parametrize(
    "field, value",
    [("length_scale", 0.3), ("length_scale", 2.0), ("time_scale", 0.0), ("duration_s", 0.0)],
)
def test_replay_config_names_a_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        ReplayConfig(**{field: value})


def test_synthetic_traces_have_the_published_shape(tmp_path):
    requests = synthesize(SynthConfig(num_requests=2000, seed=1))
    shape = describe(requests)
    assert 10_000 <= shape["mean_input_tokens"] <= 14_000
    assert 300 <= shape["mean_output_tokens"] <= 400
    assert 0.35 <= shape["shared_block_fraction"] <= 0.65
    assert shape["top_family_share"] < 0.3
    gaps = np.diff([r.timestamp_ms for r in requests])
    assert gaps.std() / gaps.mean() > 1.5  # bursty: Poisson's would be ~1
    hot = describe(synthesize(SynthConfig(num_requests=2000, hot_fraction=0.4, seed=1)))
    assert hot["top_family_share"] >= 0.35
    path = tmp_path / "s.jsonl"
    write_mooncake(requests[:50], str(path))
    assert read_mooncake(str(path)) == requests[:50]


def test_the_small_trace_files_parse_and_replay():
    for path in (SMALL, HOT):
        requests = read_mooncake(path)
        assert 30 <= len(requests) <= 100
        replayed = replay(requests, ReplayConfig(length_scale=1 / 32))
        assert max(len(r.prompt_token_ids) for r in replayed) <= 2048
        specs = trace_specs(replayed)
        assert [s.arrival_s for s in specs] == [r.arrival_s for r in replayed]
        assert specs[0].prompt_token_ids == list(replayed[0].prompt_token_ids)
    assert MOONCAKE_BLOCK_TOKENS == 512


def test_consistent_hash_sends_one_head_to_one_replica_and_falls_back_when_full():
    workload = sim.trace_workload(replay(read_mooncake(HOT), ReplayConfig(length_scale=1 / 32)))
    workload.set_block_size(16)
    router = ServeConsistentHashRouter(workload, 4, key_tokens=16, max_ongoing_requests=2)
    by_head: dict[tuple, set[int]] = {}
    for rid in range(len(workload)):
        head = workload.prompt_token_ids(rid)[:16]
        by_head.setdefault(head, set()).add(router.ranked(rid)[0])
    assert all(len(owners) == 1 for owners in by_head.values())
    assert len({next(iter(o)) for o in by_head.values()}) > 1  # heads spread over the ring
    hot = max(range(len(workload)), key=lambda rid: len(router.ranked(rid)))
    first, second, third = router.ranked(hot)
    assert [router.route(hot, 0.0, 0, 0.0)[0] for _ in range(6)] == [first] * 2 + [second] * 2 + [
        third
    ] * 2
    replica, retry_after_s = router.route(hot, 0.0, 0, 0.0)
    assert replica < 0 and retry_after_s > 0


def test_policy_names_take_the_issues_spelling():
    assert policy_name("serve-consistent-hash") == "serve_consistent_hash"
    assert policy_name("serve_pow2") == "serve_pow2"
    with pytest.raises(ValueError, match="routers"):
        policy_name("serve-magic")


def test_sim_replays_a_trace_per_router_and_load(tmp_path):
    out = tmp_path / "r.json"
    sim.main([
        "--trace", SMALL, "--length-scale", "0.03125", "--time-scale", "0.01",
        "--replicas", "3", "--routers", "prefix,serve-pow2,serve-consistent-hash",
        "--load-scales", "1", "4", "--num-blocks", "1024", "--out", str(out),
    ])  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert [(r["router"], r["load_scale"]) for r in results] == [
        (router, scale)
        for scale in (1.0, 4.0)
        for router in ("prefix", "serve-pow2", "serve-consistent-hash")
    ]
    for r in results:
        assert r["num_completed"] == 48
        for key in ("cache_hit_rate", "goodput_rps", "slo_attainment", "ttft_p50_s",
                    "ttft_p99_s", "max_kv_usage_spread"):  # fmt: skip
            assert 0 <= r[key] < float("inf"), key
        assert r["ttft_p50_s"] <= r["ttft_p99_s"]
    light, heavy = results[0], results[3]
    assert heavy["offered_rate"] == pytest.approx(4 * light["offered_rate"])
    assert heavy["ttft_p99_s"] > light["ttft_p99_s"]


def test_kv_usage_spread_is_zero_for_one_replica_and_positive_for_several():
    workload = sim.trace_workload(replay(read_mooncake(SMALL), ReplayConfig(length_scale=1 / 32)))
    cost = default_cost_model()
    replica = ReplicaSimConfig(num_blocks=1024)
    one = simulate("random", workload, SimConfig(num_replicas=1, replica=replica), cost)
    assert one["max_kv_usage_spread"] == 0.0
    three = simulate("random", workload, SimConfig(num_replicas=3, replica=replica), cost)
    assert 0 < three["max_kv_usage_spread"] <= 1


def test_prefix_keeps_affinity_and_balance_where_consistent_hashing_keeps_only_affinity():
    # One family carries 40% of a Mooncake-shaped trace: consistent hashing keeps it on
    # one replica, whose KV fills while another idles; prefix spills it to a second
    # replica, caching nearly as much and far more than a router without affinity.
    requests = synthesize(SynthConfig(num_requests=500, hot_fraction=0.4, seed=3))
    workload = sim.trace_workload(replay(requests, ReplayConfig(0.001, 1 / 16)))
    config = SimConfig(num_replicas=3, replica=ReplicaSimConfig(num_blocks=4096))
    runs = {p: simulate(p, workload, config, default_cost_model()) for p in
            ("prefix", "serve_consistent_hash", "serve_pow2")}  # fmt: skip
    prefix, hashed, pow2 = runs["prefix"], runs["serve_consistent_hash"], runs["serve_pow2"]
    assert prefix["max_kv_usage_spread"] < hashed["max_kv_usage_spread"] - 0.15
    assert prefix["cache_hit_rate"] > pow2["cache_hit_rate"] + 0.05
    assert prefix["cache_hit_rate"] > 0.85 * hashed["cache_hit_rate"]


def test_bench_load_replays_a_trace_open_loop_in_the_models_vocabulary():
    from bench import load

    args = load._parser().parse_args(
        ["--trace", SMALL, "--length-scale", "0.03125", "--time-scale", "0.5"]
    )
    specs, workload = load._replayed(args, vocab_size=512)
    replayed = replay(read_mooncake(SMALL), ReplayConfig(0.5, 0.03125, vocab_size=511))
    assert [s.arrival_s for s in specs] == [r.arrival_s for r in replayed]
    assert max(max(s.prompt_token_ids) for s in specs) < 511  # the last id is often EOS
    assert workload["num_requests"] == 48 and workload["trace"] == SMALL
    with pytest.raises(SystemExit, match="open loop"):
        load.main(["--trace", SMALL, "--concurrency", "4"])
