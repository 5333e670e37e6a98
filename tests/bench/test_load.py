"""bench.load: arrivals, datasets, metrics, goodput and lost-request accounting; one real run."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import replace

import numpy as np
import pytest

from bench.load_metrics import SLO, RequestRecord, account, compute_metrics, prefix_placement
from bench.load_report import ratios_against, summary_table, x_offline
from bench.load_target import leak_check, prefix_cache_hits
from bench.load_worker import send_one
from bench.load_workload import (
    RequestSpec,
    WorkloadConfig,
    arrival_offsets,
    build_trace,
    long_tailed_lengths,
    split_concurrency,
    split_round_robin,
)
from cluster import live_stats
from replica.stats import ReplicaStats
from router.errors import OverloadedError
from tests.router.router_fakes import make_stats

# --- arrivals ---------------------------------------------------------------------------


def _gaps(rate: float, burstiness: float, seed: int, n: int = 20_000) -> list[float]:
    t = arrival_offsets(n, rate, burstiness, np.random.default_rng(seed))
    return [b - a for a, b in zip(t, t[1:])]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_gamma_cv(burstiness: float) -> None:
    gaps = _gaps(rate=10.0, burstiness=burstiness, seed=1)
    mean = statistics.fmean(gaps)
    cv = statistics.pstdev(gaps) / mean
    assert mean == pytest.approx(0.1, rel=0.05)
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson (k = 1) has CV 1
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    assert all(g >= 0 for g in gaps)


def test_arrivals_are_seeded_start_at_zero_and_inf_rate_is_a_burst() -> None:
    a = arrival_offsets(50, 5.0, 1.0, np.random.default_rng(7))
    assert a == arrival_offsets(50, 5.0, 1.0, np.random.default_rng(7))
    assert a != arrival_offsets(50, 5.0, 1.0, np.random.default_rng(8))
    assert a[0] == 0.0 and a == sorted(a)
    assert arrival_offsets(4, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 4


# --- datasets ---------------------------------------------------------------------------


def test_random_dataset_lengths_in_range_and_token_ids_in_vocab() -> None:
    config = WorkloadConfig(
        num_requests=300, input_len=40, output_len=10, range_ratio=0.5, vocab_size=100
    )
    trace = build_trace(config)
    assert [r.index for r in trace] == list(range(300))
    assert all(20 <= len(r.prompt_token_ids) <= 60 for r in trace)
    assert all(5 <= r.max_tokens <= 15 for r in trace)
    assert all(0 <= t < 99 for r in trace for t in r.prompt_token_ids)  # 99 = last id, kept out
    assert len({len(r.prompt_token_ids) for r in trace}) > 10  # really a range
    assert all(r.arrival_s == 0.0 for r in trace)  # default rate inf


def test_prefix_dataset_shares_k_long_prefixes_with_short_suffixes() -> None:
    config = WorkloadConfig(
        num_requests=200, dataset="prefix", num_prefixes=3, prefix_len=64, input_len=8, seed=3
    )
    trace = build_trace(config)
    prefixes: dict[int, list[int]] = {}
    for r in trace:
        assert r.prefix_id in range(3)
        head, suffix = r.prompt_token_ids[:64], r.prompt_token_ids[64:]
        assert prefixes.setdefault(r.prefix_id, head) == head
        assert len(suffix) == 8
    assert len(prefixes) == 3
    assert len({tuple(p) for p in prefixes.values()}) == 3
    # suffixes differ, so requests share exactly the prefix
    assert len({tuple(r.prompt_token_ids[64:]) for r in trace}) == 200


def test_trace_is_seeded_and_rate_does_not_change_prompts() -> None:
    base = WorkloadConfig(num_requests=40, rate=5.0, dataset="prefix", seed=11)
    assert build_trace(base) == build_trace(base)
    other_rate = build_trace(WorkloadConfig(num_requests=40, rate=50.0, dataset="prefix", seed=11))
    assert [r.prompt_token_ids for r in other_rate] == [
        r.prompt_token_ids for r in build_trace(base)
    ]
    other_seed = build_trace(WorkloadConfig(num_requests=40, rate=5.0, dataset="prefix", seed=12))
    assert [r.prompt_token_ids for r in other_seed] != [
        r.prompt_token_ids for r in build_trace(base)
    ]


@pytest.mark.parametrize("tail,spread", [("lognormal", 1.0), ("pareto", 1.5)])
def test_long_tailed_lengths_have_the_median_a_heavy_tail_and_the_cap(
    tail: str, spread: float
) -> None:
    lengths = long_tailed_lengths(100, tail, spread, 5000, 20_000, np.random.default_rng(0))
    assert statistics.median(lengths) == pytest.approx(100, rel=0.08)
    assert np.percentile(lengths, 99) > 5 * statistics.median(lengths)
    assert 1 <= min(lengths) and max(lengths) <= 5000


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="rate"):
        WorkloadConfig(rate=0)
    with pytest.raises(ValueError, match="dataset"):
        WorkloadConfig(dataset="nope")
    with pytest.raises(ValueError, match="range_ratio"):
        WorkloadConfig(range_ratio=1.0)


def test_splits_cover_every_request_once_and_every_user() -> None:
    trace = build_trace(WorkloadConfig(num_requests=10))
    parts = split_round_robin(trace, 3)
    assert sorted(r.index for p in parts for r in p) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert split_concurrency(7, 3) == [3, 2, 2]


# --- metrics (hand-computed) ------------------------------------------------------------


def _record(index, sent_s, chunks, tokens, outcome="ok", error_type=None) -> RequestRecord:
    end_s = sent_s + (chunks[-1] if chunks else 0.1)
    return RequestRecord(
        index,
        10,
        4,
        sent_s,
        sent_s,
        end_s,
        outcome,
        error_type,
        None,
        None,
        "r0",
        list(chunks),
        list(tokens),
    )


def _records() -> list[RequestRecord]:
    return [
        _record(0, 0.0, [0.1, 0.15, 0.25], [1, 1, 1]),  # TTFT .1, TPOT .075, ITL .05 .1
        _record(1, 0.5, [0.2, 0.4], [1, 2]),  # TTFT .2, TPOT (.4-.2)/2 = .1, ITL .2
        _record(2, 1.0, [0.3], [1]),  # one token: TTFT .3, no TPOT, ends at 1.3
        _record(3, 0.0, [], [], outcome="rejected", error_type="OverloadedError"),
    ]  # index 4 never reported: lost


def test_metrics_match_hand_computed_values() -> None:
    m = compute_metrics(_records(), list(range(5)))
    assert (m["completed"], m["rejected"], m["errors"], m["lost"]) == (3, 1, 0, 1)
    assert m["lost_indices"] == [4]
    assert m["errors_by_type"] == {"OverloadedError": 1}
    assert m["duration_s"] == pytest.approx(1.3)
    assert m["request_throughput"] == pytest.approx(3 / 1.3)
    assert m["total_output_tokens"] == 7
    assert m["output_token_throughput"] == pytest.approx(7 / 1.3)
    assert m["total_token_throughput"] == pytest.approx((30 + 7) / 1.3)
    assert m["ttft_ms"]["mean"] == pytest.approx(200)
    assert m["ttft_ms"]["p50"] == pytest.approx(200)
    assert m["ttft_ms"]["p90"] == pytest.approx(280)  # linear: .2 + .8 * (.3 - .2)
    assert m["tpot_ms"]["mean"] == pytest.approx(87.5)
    assert m["itl_ms"]["p50"] == pytest.approx(100)  # of [50, 100, 200]
    assert m["e2e_ms"]["p50"] == pytest.approx(300)  # of [250, 400, 300]
    assert "goodput" not in m


def test_goodput_counts_requests_meeting_every_slo() -> None:
    m = compute_metrics(_records(), list(range(5)), SLO(ttft_ms=250, tpot_ms=90))
    assert m["good_requests"] == 1  # 1 misses TPOT (100 ms), 2 misses TTFT (300 ms)
    assert m["goodput"] == pytest.approx(1 / 1.3)
    m = compute_metrics(_records(), list(range(5)), SLO(ttft_ms=350, tpot_ms=90))
    assert m["good_requests"] == 2  # the one-token request has TPOT 0
    m = compute_metrics(_records(), list(range(5)), SLO(e2e_ms=260))
    assert m["good_requests"] == 1


def test_accounting_loses_missing_and_unfinished_requests_and_refuses_duplicates() -> None:
    records = _records() + [RequestRecord(5, 10, 4, 0.0)]  # sent, never ended: "lost"
    acc = account(records, list(range(7)))
    assert (acc.num_ok, acc.num_rejected, acc.num_errors) == (3, 1, 0)
    assert acc.lost_indices == [4, 5, 6]
    with pytest.raises(ValueError, match="twice"):
        account(_records() + _records()[:1], list(range(5)))
    with pytest.raises(ValueError, match="not in the trace"):
        account(_records(), [0, 1, 2])


# --- the generator's per-request outcome -------------------------------------------------


class _Chunk:
    def __init__(self, token_ids, finish_reason=None) -> None:
        self.token_ids, self.finish_reason, self.replica_id = token_ids, finish_reason, "r1"
        self.request_id = "q0"


class _FakeClient:
    def __init__(self, script: str) -> None:
        self.script = script

    async def stream(self, prompt, params):
        if self.script == "overloaded":
            raise OverloadedError(0.5)
        yield _Chunk([1])
        if self.script == "hang":
            await asyncio.sleep(3600)
        if self.script == "boom":
            raise RuntimeError("replica fell over")
        yield _Chunk([2, 3], None if self.script == "no-finish" else "length")


@pytest.mark.parametrize(
    "script,outcome,error_type,num_tokens",
    [
        ("ok", "ok", None, 3),
        ("overloaded", "rejected", "OverloadedError", 0),
        ("boom", "error", "RuntimeError", 1),
        ("no-finish", "lost", None, 3),
    ],
)
def test_send_one_records_every_ending(script, outcome, error_type, num_tokens) -> None:
    spec = RequestSpec(0, [1, 2, 3], 3, 0.0)
    record = RequestRecord(0, 3, 3, 0.0)
    asyncio.run(send_one(_FakeClient(script), spec, record, t0=0.0))
    assert (record.outcome, record.error_type) == (outcome, error_type)
    assert record.num_output_tokens == num_tokens
    assert math.isnan(record.end_s) == (outcome == "lost")


def test_send_one_records_when_the_engine_admitted_the_request() -> None:
    """admit_s: the ack's admission time (live_stats, the replica host's wall clock) less
    the time the request was sent; NaN when no ack said (another replica id here)."""
    spec = RequestSpec(0, [1, 2, 3], 3, 0.0)
    live_stats.forget_all()
    live_stats.note_admitted("q0", "r1", time.time() + 0.25)
    record = RequestRecord(0, 3, 3, 0.0)
    asyncio.run(send_one(_FakeClient("ok"), spec, record, t0=0.0))
    assert 0.2 < record.admit_s <= 0.25
    live_stats.forget_all()
    live_stats.note_admitted("q0", "elsewhere", time.time())
    record = RequestRecord(0, 3, 3, 0.0)
    asyncio.run(send_one(_FakeClient("ok"), spec, record, t0=0.0))
    assert math.isnan(record.admit_s)
    live_stats.forget_all()


def test_a_request_cancelled_at_the_timeout_stays_lost() -> None:
    record = RequestRecord(0, 3, 3, 0.0)

    async def run() -> None:
        task = asyncio.create_task(
            send_one(_FakeClient("hang"), RequestSpec(0, [1], 3, 0.0), record, 0.0)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert record.outcome == "lost" and "timeout" in record.error_message
    assert account([record], [0]).lost_indices == [0]


# --- report -----------------------------------------------------------------------------


def test_ratios_against_serve_pow2() -> None:
    m = compute_metrics(_records(), list(range(5)), SLO(ttft_ms=250))
    faster = dict(m, request_throughput=2 * m["request_throughput"])
    runs = {"serve-pow2": {"metrics": m}, "kv": {"metrics": faster}}
    ratios = ratios_against(runs)
    assert ratios["kv"]["request_throughput"] == pytest.approx(2.0)
    assert ratios["serve-pow2"]["ttft_ms_p99"] == pytest.approx(1.0)
    assert ratios_against({"kv": runs["kv"]}) == {}


def test_summary_puts_the_offline_peer_first_and_each_routers_ratio_to_it() -> None:
    m = compute_metrics(_records(), list(range(5)))
    half = dict(m, output_token_throughput=m["output_token_throughput"] / 2)
    gens = [
        {"proc": 0, "failed": None, "cpu_fraction": 0.41, "cpu_s": 2.0, "cpu_max_window": 0.6,
         "num_output_tokens": 600},
        {"proc": 1, "failed": "exited with code 1", "saturated": None},
    ]  # fmt: skip
    run = {"path": "http", "metrics": half, "leak_check": {"ok": True}, "generator": gens}
    offline = {"path": "engine", "metrics": m}
    assert x_offline(run, offline) == pytest.approx(0.5)
    assert math.isnan(x_offline(run, None))
    lines = summary_table({"kv": run}, offline).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    engine_row, kv_row = ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])
    cell = dict(zip(header, kv_row, strict=True))
    assert engine_row[:2] == ["offline engine", "engine"] and kv_row[:2] == ["kv", "http"]
    assert (cell["x offline"], cell["gen CPU"], cell["gen CPU max"]) == ("0.5", "0.41 -", "0.6")
    assert cell["gen tok/CPU-s"] == "300" and cell["leaks"] == "none"
    assert dict(zip(header, engine_row, strict=True))["gen CPU"] == "-"
    alone = [c.strip() for c in summary_table({"kv": run}).splitlines()[2].strip("|").split("|")]
    assert dict(zip(header, alone, strict=True))["x offline"] == "-"  # no peer ran


# --- one real run -----------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_end_to_end_two_routers_lose_nothing_and_leak_nothing(tmp_path) -> None:
    from bench.load import main

    out = tmp_path / "load.json"
    argv = (
        "--model gpt2-tiny --replicas 2 --device cpu --num-blocks 128 --max-num-seqs 16 "
        "--routers prefix,serve-round-robin --num-requests 24 --rate 30 --dataset prefix "
        "--num-prefixes 2 --prefix-len 32 --input-len 8 --output-len 8 --num-procs 2 "
        f"--timeout-s 60 --slo-ttft-ms 2000 --routing-trace --out {out}"
    ).split()
    assert main(argv) == 0
    result = json.loads(out.read_text())
    for router in ("prefix", "serve-round-robin"):
        run = result["runs"][router]
        m = run["metrics"]
        assert m["lost"] == 0
        assert m["completed"] + m["rejected"] + m["errors"] == 24
        assert m["completed"] > 0
        assert run["leak_check"]["ok"]
        assert len(run["leak_check"]["replicas"]) == 2
        assert run["kv_samples"]
        # 24 requests of 40 prompt tokens over 2 prefixes of 2 blocks: some hit. Every
        # completed request was admitted with its 40 tokens, and the final snapshots are
        # stamped after the round (leak_check), so none is missing from the counts.
        cache = run["prefix_cache"]
        assert 40 * m["completed"] <= cache["query_tokens"] <= 2 * 24 * 40
        assert 0 < cache["hit_tokens"] < cache["query_tokens"]
        assert 0 < cache["hit_rate"] < 1
        assert run["placement"]["prefixes"] == 2
        assert 0.5 <= run["placement"]["top_replica_share"] <= 1
    # Every request of the prefix round was decided once by a generator's kvfleet router
    # and traced; the round after it was routed by Serve's round robin, which traces
    # nothing (each round deploys an app of its own name: with one name, the generators
    # kept routing with the first round's router).
    routing, rows = result["runs"]["prefix"]["routing"], result["runs"]["prefix"]["routing_rows"]
    assert 24 == routing["decisions"] == len(rows)
    assert len({r["request_id"] for r in rows}) == len(rows)  # one admission each
    assert routing["prefixes"] == 2 and 1 <= routing["mean_replicas_per_prefix"] <= 2
    assert result["runs"]["serve-round-robin"]["routing"]["decisions"] == 0


def test_prefix_placement_is_the_share_on_each_prefixs_most_used_replica() -> None:
    def done(index: int, replica_id: str, outcome: str = "ok") -> RequestRecord:
        return RequestRecord(index, 8, 4, 0.0, outcome=outcome, replica_id=replica_id)

    records = [done(0, "a"), done(1, "a"), done(2, "b"), done(3, "b"), done(4, "a", "error")]
    records += [done(5, "c")]  # no prefix: not counted
    placement = prefix_placement(records, {0: 7, 1: 7, 2: 7, 3: 9, 4: 9})
    # prefix 7: 2 of 3 on a; prefix 9: 1 of 1 on b (the failed request is left out)
    assert placement == {
        "prefixes": 2, "top_replica_share": 0.75, "mean_replicas_per_prefix": 1.5
    }  # fmt: skip
    assert prefix_placement(records, {})["top_replica_share"] is None


def test_leak_check_ends_on_snapshots_stamped_after_the_round() -> None:
    # A drained snapshot from a lull before the last request, then the fresh one.
    stale = replace(make_stats("a", timestamp_s=99.0), prefix_query_tokens=40)
    fresh = replace(make_stats("a", timestamp_s=101.0), prefix_query_tokens=80)

    class FakeClient:
        def __init__(self) -> None:
            self.answers = [[stale], [stale], [fresh]]

        def stats(self) -> list[ReplicaStats]:
            return self.answers.pop(0)

    report, stats = leak_check(FakeClient(), not_before_s=100.0)
    assert report["ok"] and stats == [fresh]


def test_prefix_cache_hits_difference_each_replicas_counters() -> None:
    def stats(rid: str, queries: int, hits: int) -> ReplicaStats:
        return replace(make_stats(rid), prefix_query_tokens=queries, prefix_hit_tokens=hits)

    before = [stats("a", 100, 10), stats("b", 50, 0)]
    after = [stats("a", 300, 160), stats("b", 50, 0), stats("new", 40, 10)]
    cache = prefix_cache_hits(before, after)
    assert cache["by_replica"] == {"a": 0.75, "b": None, "new": 0.25}
    assert (cache["hit_tokens"], cache["query_tokens"]) == (160, 240)
    assert cache["hit_rate"] == pytest.approx(160 / 240, abs=1e-4)
    assert prefix_cache_hits([], [stats("a", 0, 0)])["hit_rate"] is None


def test_num_cpus_per_replica_reaches_the_config_and_the_local_ray() -> None:
    from bench.load import _cluster_config, _parser, _ray_num_cpus

    args = _parser().parse_args(
        [
            "--model",
            "gpt2-tiny",
            "--replicas",
            "2",
            "--device",
            "cpu",
            "--num-cpus-per-replica",
            "4",
        ]
    )
    config = _cluster_config(args, "kv")
    assert config.num_cpus_per_replica == 4
    assert config.resolve_num_cpus(0) == 4
    assert _ray_num_cpus({"kv": config}) == 2 * 4 + 2
    default = _cluster_config(
        _parser().parse_args(["--model", "gpt2-tiny", "--replicas", "3"]), "kv"
    )
    assert default.num_cpus_per_replica is None
    assert _ray_num_cpus({"kv": default}) == 3 + 2  # one each, as a CPU replica takes
    half = replace(default, num_cpus_per_replica=0.5)
    assert _ray_num_cpus({"kv": half}) == 3 + 2  # at least one each
    assert _ray_num_cpus({"kv": replace(default, http=True)}) == 3 + 2  # ingress: no CPU
    with pytest.raises(ValueError, match="num_cpus_per_replica"):
        _cluster_config(
            _parser().parse_args(["--model", "gpt2-tiny", "--num-cpus-per-replica", "-1"]), "kv"
        )


def test_replica_cpu_is_each_replicas_cpu_per_request_over_the_round() -> None:
    from bench.load import replica_cpu

    before = [
        {"replica_id": "a", "submits": 10, "submit_calls": 4, "cpu_s": 1.0, "engine_cpu_s": 2.0},
        {"replica_id": "b", "submits": 0, "submit_calls": 0, "cpu_s": 0.5, "engine_cpu_s": None},
    ]
    after = [
        {"replica_id": "a", "submits": 110, "submit_calls": 6, "cpu_s": 1.3, "engine_cpu_s": 2.5},
        {"replica_id": "b", "submits": 0, "submit_calls": 0, "cpu_s": 0.6, "engine_cpu_s": None},
        {"replica_id": "c", "submits": 5, "submit_calls": 5, "cpu_s": 9.0, "engine_cpu_s": None},
    ]
    rows = replica_cpu(before, after)
    assert rows == [
        {"replica_id": "a", "requests": 100, "calls": 2, "cpu_ms_per_request": 3.0,
         "engine_cpu_ms_per_request": 5.0},
        {"replica_id": "b", "requests": 0, "calls": 0, "cpu_ms_per_request": None,
         "engine_cpu_ms_per_request": None},
    ]  # fmt: skip


def test_front_cpu_is_each_roles_cpu_per_streamed_token_and_request() -> None:
    from bench.load import front_cpu

    records = [RequestRecord(i, 8, 100, 0.0) for i in range(4)]
    for r in records:
        r.chunk_times_s, r.chunk_num_tokens = [0.1, 0.2], [40, 60]  # 100 tokens each
    pids = {"ingress": [11, 12], "proxy": [13]}
    rows = front_cpu(pids, {"ingress": 5.0, "proxy": 1.0}, {"ingress": 5.2, "proxy": 1.02}, records)
    assert rows["ingress"] == {"processes": 2, "cpu_s": 0.2, "us_per_token": 500.0,
                               "ms_per_request": 50.0}  # fmt: skip
    assert rows["proxy"]["us_per_token"] == 50.0 and rows["proxy"]["ms_per_request"] == 5.0
    assert front_cpu({}, {}, {}, records) == {}  # not on this host's Ray: nothing measured


def test_a_process_trees_cpu_counts_its_children_and_a_gone_process_nothing() -> None:
    import os
    import subprocess
    import sys

    from bench.front import cpu_s, process_tree

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(30)"])
    try:
        deadline_s = time.monotonic() + 30
        while cpu_s(child.pid) < 0.25:  # the child's own CPU, not yet reaped
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        assert child.pid in process_tree(os.getpid())
        assert cpu_s(os.getpid()) >= cpu_s(child.pid) + time.process_time() - 0.1
    finally:
        child.kill()
        child.wait()
    assert cpu_s(2**22 + 7) == 0.0  # above Linux's default pid_max


def test_the_fake_engine_flag_deploys_a_model_free_engine_and_refuses_an_offline_peer() -> None:
    from bench.cluster import FakeEngine
    from bench.load import _engine_factory, _parser, main
    from cluster.config import ClusterConfig

    args = _parser().parse_args(["--model", "gpt2-tiny", "--fake-engine-step-ms", "2"])
    engine = _engine_factory(args)(ClusterConfig(model="gpt2-tiny", device="cpu"), "r0", 0.0)
    assert isinstance(engine, FakeEngine) and engine.step_s == 0.002
    assert _engine_factory(_parser().parse_args(["--model", "gpt2-tiny"])) is None
    for argv in (["--model", "gpt2-tiny", "--fake-engine-step-ms", "1", "--offline-peer"],
                 ["--fake-engine-step-ms", "1"],
                 ["--model", "gpt2-tiny", "--fake-engine-step-ms", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit, match="fake-engine-step-ms"):
            main(argv)
