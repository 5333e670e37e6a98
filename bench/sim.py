"""Cluster simulator: N replicas under a request trace, routed by the real router/ code.

A discrete-event simulation. Replicas (bench/sim_replica.py) batch continuously
over a prefix-cached KV pool; each step's duration comes from the fitted cost
model (bench/sim_model.py). The kv, prefix and pow2 policies are router/'s own
Admission + make_policy, fed ReplicaStats snapshots that each replica publishes
every stats_period_s and that reach the router stats_delay_s later, so herding
on stale stats and reservations behave as in the cluster; peers (SGLang-style,
Dynamo-style, random, round robin) are simulator-side (bench/sim_policies.py).

    python -m bench.sim --replicas 16 --requests 50000 --rate 4000 8000 12000 \
        --dataset shared_prefix --out results/sim.json --plot results/sim.png
    python -m bench.sim --fit results/engine_fit.json ...     # refit the cost model
    python -m bench.sim --validate results/load.json          # compare with a real run

--validate reads a measured run's JSON (the bench/load.py output) and uses these
fields: num_replicas, num_requests, rate (offered req/s), router (policy, default
"kv"), dataset (default "random"), optional prompt_len / output_len (fixed
lengths), and the measurements output_tokens_per_s and ttft_ms {"p50", "p99"}.
It simulates the same setting and prints predicted vs measured and the error.

What is approximate: the cost model is linear and fitted on three decode points
(prefill slope estimated); no network, Ray or host overhead beyond the fitted
step; one router process; the prefix cache registers a prompt's blocks when its
prefill completes; peers are re-implementations, not the systems themselves.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from bench.sim_model import CostModel, cost_model_from_file
from bench.sim_policies import ALL_POLICIES, HELD, REJECTED, make_sim_router
from bench.sim_replica import ReplicaSimConfig, SimReplica
from bench.sim_workload import ARRIVALS, DATASETS, Workload, WorkloadConfig
from router import RouterConfig

_STEP, _PUBLISH, _RETRY = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 4
    replica: ReplicaSimConfig = field(default_factory=ReplicaSimConfig)
    stats_period_s: float = 0.05
    stats_delay_s: float = 0.1
    slo_ttft_s: float = 0.25
    slo_tpot_s: float = 0.01
    seed: int = 0
    progress_every: int = 0  # print progress every this many routed requests (0: never)

    def __post_init__(self) -> None:
        if self.num_replicas <= 0:
            raise ValueError(f"num_replicas must be > 0, got {self.num_replicas}")
        if self.stats_period_s <= 0 or self.stats_delay_s < 0:
            raise ValueError("stats_period_s must be > 0 and stats_delay_s >= 0")


def simulate(policy: str, workload: Workload, config: SimConfig, cost: CostModel) -> dict:
    """Run one policy over the trace; return its metrics (see summarize())."""
    wall_start = time.perf_counter()
    workload.set_block_size(config.replica.block_size)
    n = len(workload)
    first_token_s = [-1.0] * n
    finish_s = [-1.0] * n
    replicas = [
        SimReplica(i, config.replica, cost, workload, first_token_s, finish_s)
        for i in range(config.num_replicas)
    ]
    router = make_sim_router(
        policy, workload, config.num_replicas, config.replica.num_blocks, config.seed,
        RouterConfig(seed=config.seed),
    )  # fmt: skip
    heap: list[tuple] = []
    counter = 0
    current = []
    visible: deque = deque()
    if router.needs_stats:
        for i, r in enumerate(replicas):
            current.append(r.stats(0.0, router.needs_hashes))
            offset_s = config.stats_period_s * (i + 1) / config.num_replicas
            heap.append((offset_s, counter, _PUBLISH, i))
            counter += 1
        heapq.heapify(heap)
    arrivals = workload.arrival_s.tolist()
    next_arrival, num_done, num_rejected, num_held = 0, 0, 0, 0
    route_s, num_decisions = 0.0, 0
    stats_delay_s, stats_period_s = config.stats_delay_s, config.stats_period_s
    tracks = router.tracks_progress
    routed_to = [-1] * n
    inf = math.inf
    while num_done < n:
        t_arrival = arrivals[next_arrival] if next_arrival < n else inf
        if heap and heap[0][0] <= t_arrival:
            now, _, kind, arg = heapq.heappop(heap)
            if kind == _STEP:
                r = replicas[arg]
                r.complete_step(now)
                if r.finished:
                    num_done += len(r.finished)
                    if tracks:
                        for rid in r.first_tokens:
                            router.on_first_token(rid, arg)
                        for rid in r.finished:
                            router.on_finish(rid, arg)
                elif tracks:
                    for rid in r.first_tokens:
                        router.on_first_token(rid, arg)
                end_s = r.schedule(now)
                if end_s is not None:
                    heapq.heappush(heap, (end_s, counter, _STEP, arg))
                    counter += 1
                continue
            if kind == _PUBLISH:
                visible.append(
                    (now + stats_delay_s, arg, replicas[arg].stats(now, router.needs_hashes))
                )
                heapq.heappush(heap, (now + stats_period_s, counter, _PUBLISH, arg))
                counter += 1
                continue
            rid, attempt, held_since_s = arg
        else:
            now, rid, attempt, held_since_s = t_arrival, next_arrival, 0, t_arrival
            next_arrival += 1
            if config.progress_every and next_arrival % config.progress_every == 0:
                _progress(next_arrival, n, now, num_done, wall_start, route_s, num_decisions)
        while visible and visible[0][0] <= now:
            _, i, snapshot = visible.popleft()
            current[i] = snapshot
        t0 = time.perf_counter()
        replica, retry_after_s = router.route(rid, now, current, attempt, held_since_s)
        route_s += time.perf_counter() - t0
        num_decisions += 1
        if replica >= 0:
            routed_to[rid] = replica
            r = replicas[replica]
            r.add(rid)
            if not r.busy:
                end_s = r.schedule(now)
                if end_s is not None:
                    heapq.heappush(heap, (end_s, counter, _STEP, replica))
                    counter += 1
        elif replica == HELD:
            num_held += attempt == 0
            heapq.heappush(
                heap, (now + retry_after_s, counter, _RETRY, (rid, attempt + 1, held_since_s))
            )
            counter += 1
        elif replica == REJECTED:
            num_rejected += 1
            num_done += 1
    wall_s = time.perf_counter() - wall_start
    result = summarize(workload, config, replicas, first_token_s, finish_s)
    result |= {
        "policy": policy,
        "wall_s": wall_s,
        "num_rejected": num_rejected,
        "num_held": num_held,
        "num_route_calls": num_decisions,
        "route_us_mean": 1e6 * route_s / max(1, num_decisions),
        "route_s_total": route_s,
    }
    return result


def _progress(i: int, n: int, now: float, done: int, wall_start: float, route_s: float,
              decisions: int) -> None:  # fmt: skip
    wall = time.perf_counter() - wall_start
    print(
        f"  routed {i}/{n} sim {now:.2f}s done {done} wall {wall:.0f}s "
        f"route {1e6 * route_s / max(1, decisions):.0f} us/decision "
        f"(projected total wall {wall * n / i:.0f}s)",
        flush=True,
    )


def summarize(
    workload: Workload,
    config: SimConfig,
    replicas: list[SimReplica],
    first_token_s: list[float],
    finish_s: list[float],
) -> dict:
    arrival = workload.arrival_s
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
    good = done & (first - arrival <= config.slo_ttft_s) & (tpot_all <= config.slo_tpot_s)
    makespan_s = float(finish[done].max() - arrival[0]) if done.any() else float("nan")
    num_prompt = sum(r.num_prompt_tokens for r in replicas)

    def pct(values: np.ndarray) -> dict[str, float]:
        if not len(values):
            return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
        p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1e3
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}

    return {
        "num_replicas": config.num_replicas,
        "num_requests": len(arrival),
        "num_completed": int(done.sum()),
        "offered_rate": float(workload.config.rate),
        "sim_s": makespan_s,
        "ttft_ms": pct(ttft),
        "tpot_ms": pct(tpot),
        "e2e_ms": pct(e2e),
        "throughput_req_s": float(done.sum() / makespan_s),
        "output_tokens_per_s": float(output[done].sum() / makespan_s),
        "goodput_req_s": float(good.sum() / makespan_s),
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
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in map(table_row, results):
        lines.append("| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_good, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = sorted(
            (r for r in results if r["policy"] == policy), key=lambda r: r["offered_rate"]
        )
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


def validate(path: str, args: argparse.Namespace, cost: CostModel) -> dict:
    with open(path) as f:
        real = json.load(f)
    wl_kwargs = {}
    if "prompt_len" in real:
        wl_kwargs |= {"prompt_min": real["prompt_len"], "prompt_max": real["prompt_len"]}
    if "output_len" in real:
        wl_kwargs |= {"output_min": real["output_len"], "output_max": real["output_len"]}
    workload = Workload(
        WorkloadConfig(
            dataset=real.get("dataset", "random"), num_requests=int(real["num_requests"]),
            rate=float(real["rate"]), seed=args.seed, **wl_kwargs,
        )
    )  # fmt: skip
    config = sim_config(args, int(real["num_replicas"]))
    predicted = simulate(real.get("router", "kv"), workload, config, cost)
    report = {}
    for name, pred, meas in (
        ("output_tokens_per_s", predicted["output_tokens_per_s"], real["output_tokens_per_s"]),
        ("ttft_p50_ms", predicted["ttft_ms"]["p50"], real["ttft_ms"]["p50"]),
        ("ttft_p99_ms", predicted["ttft_ms"]["p99"], real["ttft_ms"]["p99"]),
    ):
        report[name] = {"predicted": pred, "measured": meas, "rel_error": (pred - meas) / meas}
        print(f"{name:>22}: predicted {pred:10.4g}  measured {meas:10.4g}  "
              f"error {100 * (pred - meas) / meas:+.1f}%")  # fmt: skip
    return {"validation": report, "predicted": predicted}


def sim_config(args: argparse.Namespace, num_replicas: int) -> SimConfig:
    return SimConfig(
        num_replicas=num_replicas,
        replica=ReplicaSimConfig(
            num_blocks=args.num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            max_prefix_hashes_in_stats=args.max_prefix_hashes,
        ),
        stats_period_s=args.stats_period_ms / 1e3, stats_delay_s=args.stats_delay_ms / 1e3,
        slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3, seed=args.seed,
        progress_every=args.progress_every,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rate", type=float, nargs="+", default=[1500.0], help="offered req/s")
    p.add_argument("--policies", nargs="+", default=list(ALL_POLICIES), choices=ALL_POLICIES)
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    p.add_argument("--arrival-cv", type=float, default=1.0)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-prefix-hashes", type=int, default=2048)
    p.add_argument("--stats-period-ms", type=float, default=50.0)
    p.add_argument("--stats-delay-ms", type=float, default=100.0)
    p.add_argument("--slo-ttft-ms", type=float, default=250.0)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit", default=None, help="fit file for the cost model (see sim_model.py)")
    p.add_argument("--validate", default=None, help="measured run JSON to compare against")
    p.add_argument("--progress-every", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--plot", default=None, help="write a goodput-vs-load PNG here")
    args = p.parse_args()

    cost = cost_model_from_file(args.fit)
    print(f"cost model: {cost}")
    if args.validate:
        payload = validate(args.validate, args, cost)
        _write(args.out, payload | {"cost_model": cost.as_dict()})
        return
    config = sim_config(args, args.replicas)
    results = []
    for rate in args.rate:
        workload_config = WorkloadConfig(
            dataset=args.dataset, num_requests=args.requests, rate=rate, arrival=args.arrival,
            arrival_cv=args.arrival_cv, num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len, seed=args.seed,
        )  # fmt: skip
        for policy in args.policies:
            result = simulate(policy, Workload(workload_config), config, cost)
            results.append(result)
            print(markdown([result]).splitlines()[-1], flush=True)
    print(
        f"\nreplicas={args.replicas} requests={args.requests} dataset={args.dataset} "
        f"arrival={args.arrival} slo ttft<={args.slo_ttft_ms}ms tpot<={args.slo_tpot_ms}ms"
    )
    print(markdown(results))
    _write(args.out, {"args": vars(args), "cost_model": cost.as_dict(),
                      "sim_config": _plain(config), "results": results})  # fmt: skip
    if args.plot:
        plot(results, args.plot)


def _plain(config: SimConfig) -> dict:
    return replace(config).__dict__ | {"replica": config.replica.__dict__}


def _write(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d")} | payload
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
