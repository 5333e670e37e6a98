"""Cluster simulator: N replicas under a request trace, routed by the real router/ code.

A discrete-event simulation. Replicas (bench/sim_replica.py) batch continuously
over a prefix-cached KV pool; each step's duration comes from the fitted cost
model (bench/sim_model.py). The kv, prefix and pow2 policies are router/'s own
Admission + make_policy, fed ReplicaStats snapshots that each replica publishes
every stats_period_s and that reach the router stats_delay_s later, so herding
on stale stats and reservations behave as in the cluster; peers (SGLang-style,
Dynamo-style, Serve's pow2, random, round robin) are simulator-side
(bench/sim_policies.py).

    python -m bench.sim --replicas 16 --requests 50000 --rate 4000 8000 12000 \
        --dataset shared_prefix --out results/sim.json --plot results/sim.png
    python -m bench.sim --trace trace.jsonl --trace-format mooncake --length-scale 0.03125 \
        --replicas 8 --routers prefix,kv,serve-pow2,serve-consistent-hash,dynamo,random \
        --load-scales 0.5 1 2 4 --out results/trace.json --plot results/trace.png
    python -m bench.sim --fit results/engine_fit.json ...     # refit the cost model
    python -m bench.sim --validate results/load.json          # compare with a real run

--trace replays a Mooncake-format trace (bench/trace.py: token ids synthesized from its
block ids) instead of a --dataset; --load-scales multiply its arrival rate (each a run
per router). --routers takes the issue's names (serve-pow2, serve-consistent-hash);
--policies is the older spelling of the same choice.

--validate replays the trace of a `python -m bench.load --out` result (its
workload, replica count, replica config and routers) and prints predicted vs
measured throughput and TTFT p50/p99 with relative errors (bench/sim_validate.py).

Cost: routing is numpy over the fleet's columns (router/), a replica step is
O(sequences that start, finish or move). Measured on a shared 2-core box:
`--replicas 1000 --requests 1000000 --rate 800000 --policies kv`
ran in 356 s (138 us per routing decision), 2.4 GB resident.
What is approximate: the cost model is linear and fitted on three decode points
(prefill slope estimated); no network, Ray or host overhead beyond the fitted
step; routers (--num-routers) see every snapshot at the same time; peers are
re-implementations, not the systems themselves. What each replica admits per step is
the real Scheduler's (tests/bench/test_sim_scheduler.py replays a trace through both).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.common import write_json
from bench.sim_autoscale import add_autoscale_flags
from bench.sim_core import DEFAULT_NUM_BLOCKS, sim_config, simulate
from bench.sim_model import cost_model_from_file
from bench.sim_policies import ALL_POLICIES, ROUTER_ALIASES, policy_name
from bench.sim_report import markdown, plot, targets
from bench.sim_workload import ARRIVALS, DATASETS, Workload, WorkloadConfig
from bench.trace import add_replay_flags, read_trace, replay, replay_config
from replica.config_flags import add_config_flags
from router import RouterConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rate", type=float, nargs="+", default=[1500.0], help="offered req/s")
    p.add_argument(
        "--routers", default=None,
        help=f"comma-separated, of {sorted(ROUTER_ALIASES)} (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--policies", nargs="+", default=None, choices=ALL_POLICIES, help="--routers' older form"
    )
    t = p.add_argument_group("trace replay (bench/trace.py)")
    add_replay_flags(t)
    t.add_argument(
        "--load-scales", type=float, nargs="+", default=[1.0],
        help="with --trace: a run at each multiple of the trace's arrival rate",
    )  # fmt: skip
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    p.add_argument("--arrival-cv", type=float, default=1.0)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument(
        "--max-model-len", type=int, default=1024,
        help="longest prompt + output; shared_prefix needs prefix_len + 256",
    )  # fmt: skip
    p.add_argument(
        "--num-blocks", type=int, default=None,
        help=f"KV blocks per replica (default {DEFAULT_NUM_BLOCKS}; --validate: the run's)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-prefix-hashes", type=int, default=2048)
    p.add_argument(
        "--num-routers", type=int, default=1,
        help="independent routers (one per Serve handle or proxy), requests dealt round robin",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=int, default=None,
        help="closed loop: this many users, each sending its next request when one ends",
    )  # fmt: skip
    p.add_argument(
        "--serve-request-ms", type=float, default=0.0,
        help="each replica's request path: ms per request, one at a time, before the engine "
        "(0: not modeled; SimConfig.serve_request_s)",
    )  # fmt: skip
    p.add_argument("--stats-period-ms", type=float, default=50.0)
    p.add_argument("--stats-delay-ms", type=float, default=100.0)
    router = p.add_argument_group(
        "the kvfleet policies' RouterConfig", "every field but policy (--policies) and seed"
    )
    add_config_flags(router, RouterConfig, exclude=("policy", "seed"))
    p.add_argument("--slo-ttft-ms", type=float, default=250.0)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0, help="seeds the trace and the routers")
    p.add_argument("--fit", default=None, help="fit file for the cost model (see sim_model.py)")
    p.add_argument(
        "--validate",
        default=None,
        metavar="LOAD_RESULT.json",
        help="replay a `python -m bench.load --out` result and compare (bench/sim_validate.py); "
        "its replicas, blocks, block size, max seqs and routers override the flags above, "
        "except --num-blocks when the run sized its KV pool from memory",
    )
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--plot", default=None, help="write a goodput-vs-load PNG here")
    add_autoscale_flags(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    cost = cost_model_from_file(args.fit)
    print(f"cost model: {cost}")
    if args.validate:
        from bench.sim_validate import validate

        payload = validate(args.validate, args, cost)
        write_json(args.out, payload | {"cost_model": cost.as_dict()})
        return
    config = sim_config(args, args.replicas)
    if args.autoscale:  # a fleet that scales: bench/sim_autoscale.py
        from bench.sim_autoscale import run_cli

        explicit = args.routers is not None or args.policies is not None
        run_cli(args, cost, config, _routers(args) if explicit else None, _workloads)
        return
    routers = _routers(args)
    results = []
    for load_scale, workload in _workloads(args):
        for router in routers:
            result = simulate(policy_name(router), workload, config, cost)
            result |= {"router": router, "load_scale": load_scale}
            results.append(result)
            print(markdown([result]).splitlines()[-1], flush=True)
    source = f"trace={args.trace}" if args.trace else f"dataset={args.dataset}"
    print(
        f"\nreplicas={args.replicas} requests={len(workload)} {source} "
        f"arrival={args.arrival} slo ttft<={args.slo_ttft_ms}ms tpot<={args.slo_tpot_ms}ms"
    )
    print(markdown(results))
    comparison = targets(results)
    for row in comparison["per_load"]:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))  # fmt: skip
    if comparison["per_load"]:
        print(
            f"kvfleet best / best peer, lowest over loads: {comparison['min_x_best_peer']:.3f}; "
            f"heaviest load with >= half within SLO: {comparison['heaviest_half_slo']}"
        )
    write_json(args.out, {"args": vars(args), "cost_model": cost.as_dict(),
                      "sim_config": asdict(config), "results": results,
                      "targets": comparison})  # fmt: skip
    if args.plot:
        plot(results, args.plot)


def _routers(args: argparse.Namespace) -> list[str]:
    if args.routers is not None and args.policies is not None:
        raise ValueError("routers: give --routers or --policies, not both")
    if args.routers is not None:
        routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    else:
        routers = args.policies or list(ALL_POLICIES)
    if not routers:
        raise ValueError("routers: name at least one")
    for router in routers:
        policy_name(router)  # raises naming it
    return routers


def _workloads(args: argparse.Namespace) -> list[tuple[float, Workload]]:
    """(load scale, trace) per run: --trace at each --load-scales, else --dataset at each --rate."""
    if args.trace is None:
        return [
            (rate / args.rate[0], Workload(WorkloadConfig(
                dataset=args.dataset, num_requests=args.requests, rate=rate,
                arrival=args.arrival, arrival_cv=args.arrival_cv,
                num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                max_model_len=args.max_model_len, seed=args.seed,
            )))
            for rate in args.rate
        ]  # fmt: skip
    if any(not s > 0 for s in args.load_scales):
        raise ValueError(f"load_scales must be > 0, got {args.load_scales}")
    requests = read_trace(args.trace, args.trace_format)
    out = []
    for load_scale in args.load_scales:
        config = replay_config(args, time_scale=args.time_scale / load_scale)
        out.append((load_scale, trace_workload(replay(requests, config))))
    return out


def trace_workload(replayed: list) -> Workload:
    """A replayed trace (bench.trace.replay) as the simulator's Workload."""
    span_s = replayed[-1].arrival_s - replayed[0].arrival_s
    return Workload.from_trace(
        [r.arrival_s for r in replayed],
        [r.prompt_token_ids for r in replayed],
        [r.max_tokens for r in replayed],
        offered_rate=len(replayed) / span_s if span_s > 0 else float("inf"),
    )


if __name__ == "__main__":
    main()
