"""The simulator's report: metrics of a run, a markdown table, goodput-vs-load plots."""

from __future__ import annotations

import os

import numpy as np

from bench.common import markdown_table, summary_ms
from bench.sim_replica import SimReplica
from bench.sim_workload import Workload


def summarize(
    workload: Workload,
    replicas: list[SimReplica],
    arrival_s: list[float],
    first_token_s: list[float],
    finish_s: list[float],
    slo_ttft_s: float,
    slo_tpot_s: float,
) -> dict:
    """A run's metrics, with bench.load's definitions (vLLM's): over completed requests,
    TTFT from arrival to first token, TPOT (E2E - TTFT) / (output - 1), throughputs over
    the run (first arrival to last finish); goodput counts requests within both SLOs."""
    arrival = np.array(arrival_s)
    first = np.array(first_token_s)
    finish = np.array(finish_s)
    output = workload.output_len
    done = finish >= 0
    ttft = (first - arrival)[done]
    e2e = (finish - arrival)[done]
    multi = done & (output > 1)
    tpot = ((finish - first)[multi] / (output[multi] - 1)) if multi.any() else np.zeros(0)
    tpot_all = np.zeros(len(arrival))
    tpot_all[multi] = (finish - first)[multi] / (output[multi] - 1)
    good = done & (first - arrival <= slo_ttft_s) & (tpot_all <= slo_tpot_s)
    makespan_s = float(finish[done].max() - arrival[0]) if done.any() else float("nan")
    num_prompt = sum(r.num_prompt_tokens for r in replicas)
    ttft_ms = summary_ms(ttft.tolist())

    return {
        "num_replicas": len(replicas),
        "num_requests": len(arrival),
        "num_completed": int(done.sum()),
        "offered_rate": float(workload.offered_rate),
        "sim_s": makespan_s,
        "ttft_ms": ttft_ms,
        "tpot_ms": summary_ms(tpot.tolist()),
        "e2e_ms": summary_ms(e2e.tolist()),
        "throughput_req_s": float(done.sum() / makespan_s),
        "output_tokens_per_s": float(output[done].sum() / makespan_s),
        "goodput_req_s": float(good.sum() / makespan_s),
        "goodput_rps": float(good.sum() / makespan_s),  # the name for goodput_req_s
        "ttft_p50_s": ttft_ms["p50"] / 1e3,
        "ttft_p99_s": ttft_ms["p99"] / 1e3,
        "slo_attainment": float(good.sum() / len(arrival)),
        "cache_hit_rate": sum(r.num_hit_tokens for r in replicas) / max(1, num_prompt),
        "num_preempted": sum(r.num_preempted_total for r in replicas),
        "num_steps": sum(r.num_steps for r in replicas),
        "replica_busy_frac": sum(r.busy_s for r in replicas) / (len(replicas) * makespan_s),
    }


COLUMNS = ("policy", "offered_rate", "goodput_req_s", "output_tokens_per_s", "ttft p50",
           "ttft p99", "tpot p50", "tpot p99", "e2e p99", "cache_hit_rate", "num_preempted",
           "route_us_mean", "wall_s")  # fmt: skip


def table_row(result: dict) -> dict:
    return result | {
        "ttft p50": result["ttft_ms"]["p50"], "ttft p99": result["ttft_ms"]["p99"],
        "tpot p50": result["tpot_ms"]["p50"], "tpot p99": result["tpot_ms"]["p99"],
        "e2e p99": result["e2e_ms"]["p99"],
    }  # fmt: skip


def markdown(results: list[dict]) -> str:
    return markdown_table([table_row(r) for r in results], list(COLUMNS), digits=4)


def label(result: dict) -> str:
    """The name a run was asked for (--routers), else its policy."""
    return result.get("router", result["policy"])


KVFLEET_POLICIES = ("prefix", "kv", "pow2")


def targets(results: list[dict]) -> dict:
    """The issue's goodput comparisons over a load sweep: at each load, kvfleet's best
    policy over the best peer's; at the heaviest load where some router still met the
    SLO for at least half the requests, kvfleet's best over serve-pow2's and
    serve-consistent-hash's (when they ran)."""
    by_load: dict[float, dict[str, dict]] = {}
    for r in results:
        by_load.setdefault(r["offered_rate"], {})[r["policy"]] = r
    per_load = []
    for rate in sorted(by_load):
        runs = by_load[rate]
        ours = [r for p, r in runs.items() if p in KVFLEET_POLICIES]
        peers = [r for p, r in runs.items() if p not in KVFLEET_POLICIES]
        if not ours or not peers:
            continue
        best = max(ours, key=lambda r: r["goodput_req_s"])
        best_peer = max(peers, key=lambda r: r["goodput_req_s"])
        row = {
            "offered_rate": rate,
            "kvfleet_best": label(best),
            "best_peer": label(best_peer),
            "x_best_peer": best["goodput_req_s"] / max(best_peer["goodput_req_s"], 1e-9),
            "max_slo_attainment": max(r["slo_attainment"] for r in runs.values()),
        }
        for peer in ("serve_pow2", "serve_consistent_hash"):
            if peer in runs:
                row[f"x_{peer}"] = best["goodput_req_s"] / max(runs[peer]["goodput_req_s"], 1e-9)
        per_load.append(row)
    met = [row for row in per_load if row["max_slo_attainment"] >= 0.5]
    return {
        "per_load": per_load,
        "min_x_best_peer": min((row["x_best_peer"] for row in per_load), default=float("nan")),
        "heaviest_half_slo": met[-1] if met else None,
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_good, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(label(r) for r in results):
        rows = sorted((r for r in results if label(r) == policy), key=lambda r: r["offered_rate"])
        rates = [r["offered_rate"] for r in rows]
        ax_good.plot(rates, [r["goodput_req_s"] for r in rows], marker="o", label=policy)
        ax_ttft.plot(rates, [r["ttft_ms"]["p99"] for r in rows], marker="o", label=policy)
    ax_good.set(xlabel="offered load (req/s)", ylabel="goodput (req/s within SLO)",
                title="goodput vs offered load")  # fmt: skip
    ax_ttft.set(xlabel="offered load (req/s)", ylabel="p99 TTFT (ms)", yscale="log",
                title="p99 TTFT")  # fmt: skip
    ax_good.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
