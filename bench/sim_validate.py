"""Validation of the simulator against a measured load run (`python -m bench.load --out`).

    python -m bench.sim --validate results/load_4gpu.json [--fit results/engine_fit.json]

From the result JSON ("workload", "target", "runs"):
  - the trace: build_trace(WorkloadConfig(**workload)) gives the very requests the run
    sent, output lengths max_tokens (the load test sets ignore_eos); a closed loop's
    concurrency and one router per generator process (num_procs) carry over;
  - the replicas: the target's replicas, block_size, max_num_seqs and num_blocks (a
    pool sized from memory: --num-blocks, else the size its kv_samples imply);
    EngineConfig's defaults for what the load test does not set;
  - the routers: every run, as the simulator's policy of the same algorithm
    (LOAD_ROUTER_POLICIES), with the target's on_overload and queue_fraction.
For each router it prints predicted vs measured output-token throughput, request
throughput and TTFT p50/p99 (bench.load's definitions) with the relative error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np

from bench.sim_core import SimConfig, sim_config, simulate
from bench.sim_model import CostModel
from bench.sim_workload import Workload
from replica.config import EngineConfig
from router import RouterConfig

# bench.load router name -> simulator policy (None: no model of it here).
LOAD_ROUTER_POLICIES: dict[str, str | None] = {
    "kv": "kv",
    "prefix": "prefix",
    "pow2": "pow2",
    "serve-pow2": "serve_pow2",
    "serve-round-robin": "round_robin",
    "serve-consistent-hash": "serve_consistent_hash",
}
# (name, key in bench.load's metrics, percentile or None, key path in the simulator's result)
COMPARED = (
    ("output_tokens_per_s", "output_token_throughput", None, ("output_tokens_per_s",)),
    ("requests_per_s", "request_throughput", None, ("throughput_req_s",)),
    ("goodput_req_s", "goodput", None, ("goodput_req_s",)),  # SLOs: --slo-ttft/tpot-ms
    ("ttft_p50_ms", "ttft_ms", "p50", ("ttft_ms", "p50")),
    ("ttft_p99_ms", "ttft_ms", "p99", ("ttft_ms", "p99")),
)


def trace_workload(workload: dict) -> Workload:
    """The run's own requests: its trace file replayed as bench.load replayed it (the
    file must be where the run's command named it), else its recorded WorkloadConfig's."""
    from bench.load_workload import WorkloadConfig, build_trace, trace_specs

    if workload.get("trace"):
        from bench.trace import ReplayConfig, read_trace, replay

        names = {f.name for f in dataclasses.fields(ReplayConfig)}
        config = ReplayConfig(**{k: v for k, v in workload.items() if k in names})
        requests = read_trace(workload["trace"], workload.get("trace_format") or "mooncake")
        trace = trace_specs(replay(requests, config))
    else:
        names = {f.name for f in dataclasses.fields(WorkloadConfig)}
        trace = build_trace(WorkloadConfig(**{k: v for k, v in workload.items() if k in names}))
    return Workload.from_trace(
        [spec.arrival_s for spec in trace],
        [spec.prompt_token_ids for spec in trace],
        [spec.max_tokens for spec in trace],
        offered_rate=float(workload.get("rate", math.inf)),
    )


def num_blocks_from_samples(runs: dict) -> int | None:
    """The replicas' KV pool size implied by kv_samples: free + cached = (1 - usage) x total."""
    estimates = [
        (s["num_blocks_free"] + s["num_blocks_cached"]) / (1.0 - s["kv_usage"])
        for run in runs.values()
        for s in run.get("kv_samples", ())
        if s.get("kv_usage", 1.0) < 0.5  # the division amplifies rounding above that
    ]
    return round(float(np.median(estimates))) if estimates else None


def replica_overrides(result: dict, args: argparse.Namespace) -> dict:
    """SimConfig / ReplicaSimConfig fields of the measured target."""
    target = result["target"]
    num_blocks = (
        args.num_blocks or target.get("num_blocks") or num_blocks_from_samples(result["runs"])
    )
    if num_blocks is None:
        raise SystemExit(
            "the run sized its KV pool from memory and recorded no usable kv_samples: "
            "pass --num-blocks (the replicas' num_blocks_total)"
        )
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    concurrency = result["workload"].get("concurrency")
    return {
        "num_blocks": int(num_blocks),
        "block_size": int(target.get("block_size") or engine["block_size"]),
        "max_num_seqs": int(target.get("max_num_seqs") or engine["max_num_seqs"]),
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "enable_prefix_caching": engine["enable_prefix_caching"],
        "max_prefix_hashes_in_stats": engine["max_prefix_hashes_in_stats"],
        "concurrency": int(concurrency) if concurrency else None,
        # Each generator process routes through its own Serve handle: one router each.
        "num_routers": int(target.get("num_procs") or 1),
    }


def relative_error(predicted: float, measured: float) -> float:
    if not measured or math.isnan(measured) or math.isnan(predicted):
        return math.nan
    return (predicted - measured) / measured


def compare(predicted: dict, measured: dict) -> dict[str, dict[str, float]]:
    rows = {}
    for name, key, stat, path in COMPARED:
        value = measured.get(key, math.nan)
        meas = float(value.get(stat, math.nan) if stat else value)
        pred = predicted
        for part in path:
            pred = pred[part]
        pred = float(pred)
        rows[name] = {"predicted": pred, "measured": meas, "rel_error": relative_error(pred, meas)}
    return rows


def validate(path: str, args: argparse.Namespace, cost: CostModel) -> dict:
    """Simulate every router of the measured run; print and return predicted vs measured."""
    with open(path) as f:
        result = json.load(f)
    overrides = replica_overrides(result, args)
    target = result["target"]
    num_replicas = int(target.get("num_replicas") or target["replicas"])  # older runs: replicas
    seed = int(result["workload"].get("seed", args.seed))
    on_overload = result["target"].get("on_overload") or "hold"
    report: dict[str, dict] = {}
    workload = trace_workload(result["workload"])
    print(
        f"validating against {path}: {num_replicas} replicas, {overrides['num_blocks']} blocks "
        f"of {overrides['block_size']}, {len(workload)} requests"
    )
    print("| router | metric | predicted | measured | error |\n|---|---|---|---|---|")
    for router, run in result["runs"].items():
        policy = LOAD_ROUTER_POLICIES.get(router)
        if policy is None:
            print(f"| {router} | (no simulator model of this router) | | | |")
            report[router] = {"skipped": "no simulator model of this router"}
            continue
        router_config = RouterConfig(
            seed=seed,
            on_overload=on_overload,
            queue_fraction=result["target"].get("queue_fraction") or 0.0,
        )
        config: SimConfig = sim_config(args, num_replicas, router=router_config, **overrides)
        predicted = simulate(policy, workload, config, cost)
        rows = compare(predicted, run["metrics"])
        for name, row in rows.items():
            print(
                f"| {router} | {name} | {row['predicted']:.4g} | {row['measured']:.4g} "
                f"| {100 * row['rel_error']:+.1f}% |"
            )
        report[router] = {"policy": policy, "metrics": rows, "predicted": predicted}
    modeled = f"{args.serve_request_ms} ms a request" if args.serve_request_ms else "no"
    print(
        f"each replica's request path (--serve-request-ms): {modeled}; not modeled: the"
        " output side (first token -> caller), the client's own time, generator send lag,"
        " stats propagation beyond --stats-delay-ms (the measured TTFT includes them)"
    )
    return {
        "validation": report,
        "measured_file": path,
        "sim_config": overrides | {"num_replicas": num_replicas},
    }
