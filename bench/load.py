"""Cluster load test: a seeded trace against a kvfleet app, vLLM-style serving metrics.

    # start 2 local CPU replicas of gpt2-tiny, same trace under two routers
    python -m bench.load --model gpt2-tiny --replicas 2 --device cpu --num-blocks 256 \
        --routers kv,pow2 --num-requests 64 --rate 20 --input-len 64 --output-len 16 --out r.json
    # attach to a running app (python -m cluster serve ...), closed loop of 32 users
    python -m bench.load --app-name kvfleet --concurrency 32 --dataset prefix --num-prefixes 8
    # one replica through its HTTP ingress (SSE), beside the bare engine on the same trace
    python -m bench.load --model gpt2 --dtype float16 --replicas 1 --router kv --http \
        --offline-peer --concurrency 256 --num-requests 2048 --input-len 128 --output-len 128 \
        --num-procs 8
    # attach to a running HTTP server (python -m cluster serve --port 8000 ...)
    python -m bench.load --http --http-url http://127.0.0.1:8000 --concurrency 64
    # the HTTP path alone: a model-free engine stepping every 2 ms behind one ingress
    python -m bench.load --model gpt2-tiny --device cpu --replicas 1 --http \
        --ingress-replicas 1 --fake-engine-step-ms 2 --concurrency 128 --output-len 128

Open loop (--rate, --burstiness: gamma gaps, 1 = Poisson) or closed loop (--concurrency).
The requests are spread round-robin over --num-procs generator processes (bench.load_worker),
each with its own Ray driver, event loop and Client, or with --http one aiohttp session
streaming POST /v1/completions (bench.load_http); each reports its CPU use, and the report
flags a saturated generator. Over --http on a local Ray the report also gives the CPU per
streamed token of the ingress replicas and of Serve's proxy with its HAProxy
(bench.front). With --routers the app is redeployed per router (fresh replicas, fresh
caches) and the same trace replays; ratios are against serve-pow2 (Ray Serve's default
router) when it ran. --offline-peer first replays the trace through a bare
LLMEngine of the replicas' EngineConfig in a process of its own (bench.load_offline), and
each router's row gets "x offline", its output tokens/s over the engine's. Exit status 1 if
any request was lost (neither a completion nor a typed error), a replica leaked, or a
generator process failed.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, fields

from bench.common import write_json
from bench.front import front_cpu_s, front_pids
from bench.load_metrics import SLO, compute_metrics, prefix_placement
from bench.load_offline import OFFLINE_REPLICA_ID, run_offline_peer
from bench.load_pool import GeneratorPool, Round
from bench.load_report import (
    BASELINE_ROUTER,
    ratio_table,
    ratios_against,
    routing_line,
    summary_table,
    x_offline,
)
from bench.load_target import (
    attach_ray,
    deploy,
    leak_check,
    prefix_cache_hits,
    shutdown,
    start_http,
    start_local_ray,
    stats_rows,
    undeploy,
    wait_http_ready,
)
from bench.load_worker import WorkerResult
from bench.load_workload import (
    DATASETS,
    TAILS,
    RequestSpec,
    WorkloadConfig,
    build_trace,
    trace_specs,
)
from bench.trace import add_replay_flags, read_trace, replay, replay_config
from cluster import routing_trace
from cluster.config import ADMISSION_FIELDS, ROUTERS, ClusterConfig
from replica.config_flags import add_config_flags, flag_values
from replica.models import load_model_config

# Ray Serve's own routers (cluster.config has them once they are wired); kept in the CLI.
SERVE_ROUTERS = ("serve-pow2", "serve-round-robin", "serve-consistent-hash")
STATS_PERIOD_S = 0.2


def _engine_factory(args: argparse.Namespace) -> Callable | None:
    """--fake-engine-step-ms's engine factory for build_app; None: the model's engine."""
    if args.fake_engine_step_ms is None:
        return None
    from bench.cluster import fake_engine

    return functools.partial(fake_engine, step_s=args.fake_engine_step_ms / 1e3)


def run_trace(
    args: argparse.Namespace,
    router: str,
    trace: list[RequestSpec],
    pool: GeneratorPool,
    app_name: str,
) -> dict:
    """Replay the trace against app_name as it is now deployed; metrics, CPU, KV samples."""
    from cluster.client import Client

    client = Client(app_name)
    samples: list[dict] = []
    next_poll_s = 0.0

    stats_at_start = client.stats()  # the prefix-cache counters before any request
    counters_at_start = client.serving_counters()  # the replicas' CPU and submits
    pids = front_pids() if pool.http_url is not None else {}  # on this host's Ray only
    front_at_start = front_cpu_s(pids)

    def show_progress(state: Round, end: str = "") -> None:  # one rewritten stderr line
        done = f"{sum(state.done_by_proc.values())}/{len(trace)}"
        print(f"\r{router}: {done} requests done", end=end, file=sys.stderr, flush=True)

    def on_tick(state: Round) -> None:
        nonlocal next_poll_s
        t_s = time.time() - state.start_wall_s
        if time.monotonic() >= next_poll_s and t_s >= 0:
            samples.extend(stats_rows(client.stats(), t_s))
            next_poll_s = time.monotonic() + STATS_PERIOD_S
        show_progress(state)

    state = pool.run_round(app_name, trace, args.concurrency, args.timeout_s, on_tick)
    round_end_s = time.time()  # the clock of the replicas' snapshot stamps
    show_progress(state, end="\n")
    records = [r for res in state.results.values() for r in res.records]
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    leaks, stats_at_end = leak_check(client, not_before_s=round_end_s)
    prefix_ids = {s.index: s.prefix_id for s in trace if s.prefix_id is not None}
    results = state.results.values()
    rows = [row for res in results for row in res.routing_rows]
    return {
        "path": "client" if pool.http_url is None else "http",
        "records": records,
        "metrics": compute_metrics(records, [s.index for s in trace], slo),
        "placement": prefix_placement(records, prefix_ids),
        "routing": routing_trace.summarize(rows)
        | {"dropped": sum(res.routing_rows_dropped for res in results)},
        "routing_rows": rows,
        "leak_check": leaks,
        "prefix_cache": prefix_cache_hits(stats_at_start, stats_at_end),
        "replica_cpu": replica_cpu(counters_at_start, client.serving_counters()),
        "front_cpu": front_cpu(pids, front_at_start, front_cpu_s(pids), records),
        "generator": [
            _generator_row(p, state.results.get(p), state.failures.get(p))
            for p in range(pool.num_procs)
        ],
        "kv_samples": samples,
    }


def replica_cpu(before: list[dict], after: list[dict]) -> list[dict]:
    """Per replica over a round: its process's CPU (and its engine child's, when the engine
    runs in one) per request submitted, from LLMServer.serving_counters."""
    starts = {c["replica_id"]: c for c in before}
    rows = []
    for end in after:
        start = starts.get(end["replica_id"])
        if start is None:
            continue
        requests = end["submits"] - start["submits"]
        calls = end.get("submit_calls", end["submits"]) - start.get("submit_calls", 0)
        engine_s = None
        if end.get("engine_cpu_s") is not None and start.get("engine_cpu_s") is not None:
            engine_s = end["engine_cpu_s"] - start["engine_cpu_s"]
        rows.append({
            "replica_id": end["replica_id"], "requests": requests, "calls": calls,
            "cpu_ms_per_request": _ms_per(end["cpu_s"] - start["cpu_s"], requests),
            "engine_cpu_ms_per_request": None if engine_s is None else _ms_per(engine_s, requests),
        })  # fmt: skip
    return rows


def front_cpu(
    pids: dict[str, list[int]], before: dict[str, float], after: dict[str, float], records: list
) -> dict[str, dict]:
    """Per role of the HTTP front (the ingress replicas; Serve's proxy with its HAProxy)
    over a round: its processes' CPU per output token streamed and per request."""
    num_tokens = sum(r.num_output_tokens for r in records)
    rows = {}
    for role, cpu_s in after.items():
        used_s = cpu_s - before.get(role, 0.0)
        rows[role] = {
            "processes": len(pids[role]), "cpu_s": round(used_s, 3),
            "us_per_token": round(1e6 * used_s / num_tokens, 2) if num_tokens else None,
            "ms_per_request": _ms_per(used_s, len(records)),
        }  # fmt: skip
    return rows


def _ms_per(cpu_s: float, requests: int) -> float | None:
    return round(1e3 * cpu_s / requests, 3) if requests else None


def _generator_row(proc: int, result: WorkerResult | None, failure: str | None) -> dict:
    if result is None:
        return {"proc": proc, "failed": failure or "no result", "saturated": None}
    return {
        "proc": proc,
        "failed": None,
        "cpu_fraction": round(result.cpu_fraction, 3),
        "cpu_s": round(result.cpu_s, 3),
        "num_output_tokens": sum(r.num_output_tokens for r in result.records),
        "tokens_per_cpu_s": round(result.tokens_per_cpu_s),
        "cpu_max_window": round(max(result.cpu_windows, default=math.nan), 3),
        "saturated_windows": result.num_saturated_windows,
        "num_windows": len(result.cpu_windows),
        "saturated": result.saturated,
    }


def _cluster_config(args: argparse.Namespace, router: str) -> ClusterConfig:
    """The app one router's round deploys: the ClusterConfig flags (and --seed, which
    seeds the trace too), with this round's router and app name."""
    values = flag_values(ClusterConfig, args)
    if router in SERVE_ROUTERS:
        # Serve's own routers have no admission control (ClusterConfig refuses its fields):
        # in a round of theirs the router flags, which kvfleet's routers take, stay unset.
        values = {k: v for k, v in values.items() if k not in ADMISSION_FIELDS}
    return ClusterConfig(
        **values | {"router": router, "app_name": round_app_name(args.app_name, router)}
    )


def _ray_num_cpus(configs: dict[str, ClusterConfig]) -> int:
    """CPUs for a local Ray: a replica's num_cpus_per_replica (at least one) each, and two
    for Serve's controller and proxy (the HTTP ingress replicas ask for none)."""
    config = next(iter(configs.values()))
    per_replica = max(config.num_cpus_per_replica or 1, 1)
    return math.ceil(config.num_replicas * per_replica) + 2


def round_app_name(app_name: str, router: str) -> str:
    """The app each router's round deploys: a name of its own. A process keeps Serve's
    handle on an (app, deployment) for its life, and that handle's request router keeps
    the router class of the deployment it first saw, so with one name every round would
    be routed by the first round's router (and a new handle on the old name may never
    see the new replicas: Serve's shared long-poll client)."""
    return f"{app_name}-{router}"


def _workload(args: argparse.Namespace, vocab_size: int) -> WorkloadConfig:
    names = {f.name for f in fields(WorkloadConfig)} - {"vocab_size"}  # a flag each
    return WorkloadConfig(**{n: getattr(args, n) for n in names}, vocab_size=vocab_size)


def _replayed(args: argparse.Namespace, vocab_size: int) -> tuple[list[RequestSpec], dict]:
    """--trace: its requests (open loop at its timestamps) and the workload's description."""
    config = replay_config(args, vocab_size=vocab_size - 1)  # the last id is often EOS
    trace = trace_specs(replay(read_trace(args.trace, args.trace_format), config))
    workload = {"trace": args.trace, "trace_format": args.trace_format,
                "num_requests": len(trace)} | asdict(config)  # fmt: skip
    return trace, workload


def _offline_peer(config: ClusterConfig, trace: list[RequestSpec], concurrency: int | None) -> dict:
    """The trace through a bare engine with the EngineConfig, device and torch threads that
    a replica of config gets (Ray sets its OMP_NUM_THREADS to its CPUs, at least 1)."""
    import ray

    num_gpus = config.resolve_num_gpus(ray.cluster_resources().get("GPU", 0))
    num_threads = max(1, int(config.resolve_num_cpus(num_gpus)))
    engine_config = config.engine_config(OFFLINE_REPLICA_ID, num_gpus)
    offline = run_offline_peer(engine_config, trace, concurrency, num_threads)
    m = offline["metrics"]
    print(
        f"offline peer: {m['output_token_throughput']:.0f} output tokens/s, "
        f"{m['completed']}/{m['num_requests']} requests in {offline['wall_s']:.1f} s "
        f"({offline['device']}, {offline['dtype']}, {offline['num_blocks']} KV blocks)"
    )
    return offline


def run_all(args: argparse.Namespace) -> tuple[dict, dict[str, dict], dict | None]:
    """Every router's run on one trace, and the offline peer's first when asked;
    (workload description, runs by router, the offline peer's run or None)."""
    from cluster.client import Client

    routers = args.routers.split(",") if args.routers else [args.router]
    if args.model is None:
        configs = {routers[0]: None}
        ray_address = attach_ray(args.address)
        vocab = args.vocab_size or Client(args.app_name).model_info().vocab_size
    else:
        configs = {r: _cluster_config(args, r) for r in routers}  # validates every router
        ray_address = start_local_ray(
            args.ray_num_cpus or _ray_num_cpus(configs), next(iter(configs.values()))
        )
        vocab = args.vocab_size or load_model_config(args.model).vocab_size
        if args.http:
            start_http(args.http_url)
    workload_config = _workload(args, vocab)
    if args.trace is None:
        trace = build_trace(workload_config)
        workload = asdict(workload_config) | {"concurrency": args.concurrency}
    else:
        trace, workload = _replayed(args, vocab)
    num_procs = min(args.num_procs, args.concurrency or args.num_procs, len(trace))
    runs: dict[str, dict] = {}
    offline: dict | None = None
    pool: GeneratorPool | None = None
    try:
        if args.offline_peer:  # before any replica holds the GPU
            offline = _offline_peer(next(iter(configs.values())), trace, args.concurrency)
        http_url = args.http_url if args.http else None
        pool = GeneratorPool(
            num_procs, ray_address, args.routing_trace, http_url, args.submit_group_size
        )
        for router, config in configs.items():
            app_name = args.app_name if config is None else config.app_name
            if config is not None:
                t_deploy = time.monotonic()
                deploy(config, _engine_factory(args))
                print(
                    f"deployed {args.num_replicas} x {args.model} with router {router!r} "
                    f"in {time.monotonic() - t_deploy:.1f} s"
                )
            if http_url is not None:
                wait_http_ready(http_url)
            runs[router] = run_trace(args, router, trace, pool, app_name)
            if config is not None:
                undeploy(app_name)
    finally:
        if pool is not None:
            pool.close()
        if args.model is not None:
            shutdown()
    return workload, runs, offline


def report(
    args: argparse.Namespace, workload: dict, runs: dict[str, dict], offline: dict | None
) -> int:
    """Print the tables, write the JSON; the exit status."""
    print("\n" + summary_table(runs, offline))
    ratios = ratios_against(runs)
    if ratios:
        print(f"\nratios against {BASELINE_ROUTER} (Ray Serve's default router):")
        print(ratio_table(ratios))
    status = 0
    for router, run in runs.items():
        m, leaks = run["metrics"], run["leak_check"]
        if m["lost"]:
            print(f"{router}: {m['lost']} LOST requests (first: {m['lost_indices'][:10]})")
            status = 1
        if m["errors_by_type"]:
            print(f"{router}: rejected/errors by type: {m['errors_by_type']}")
            for examples in m["error_examples"].values():
                print("  " + "\n  ".join(examples))
        if not leaks["ok"]:
            print(f"{router}: LEAK CHECK FAILED: {leaks['replicas']}")
            status = 1
        else:
            print(f"{router}: leak check ok ({len(leaks['replicas'])} replicas drained)")
        blocks = {r["num_blocks_total"] for r in leaks["replicas"]}
        if offline is not None and blocks != {offline["num_blocks"]}:
            print(
                f"{router}: the replicas have {sorted(blocks)} KV blocks, the offline peer"
                f" {offline['num_blocks']}: set --num-blocks to compare like with like"
            )
        cache = run["prefix_cache"]
        if cache["query_tokens"]:
            per_replica = ", ".join(
                "-" if v is None else f"{v:.0%}" for v in cache["by_replica"].values()
            )
            print(
                f"{router}: prefix cache hit rate {cache['hit_rate']:.1%} of"
                f" {cache['query_tokens']} prompt tokens (per replica: {per_replica})"
            )
        placement = run["placement"]
        if placement["prefixes"]:
            print(
                f"{router}: prefix placement: {placement['top_replica_share']:.0%} of a prefix's"
                f" requests on its most used replica, {placement['mean_replicas_per_prefix']}"
                f" replicas per prefix ({placement['prefixes']} prefixes)"
            )
        if run["routing"]["decisions"]:
            print(f"{router}: routing trace: {routing_line(run['routing'])}")
        for row in run.get("replica_cpu", []):
            print(
                f"{router}: replica {row['replica_id']}: {row['cpu_ms_per_request']} ms of its"
                f" process's CPU a request ({row['requests']} requests in {row['calls']} Serve"
                f" calls; engine child {row['engine_cpu_ms_per_request']} ms a request)"
            )
        for role, row in run.get("front_cpu", {}).items():
            print(
                f"{router}: HTTP {role} ({row['processes']} processes and their children):"
                f" {row['us_per_token']} us of CPU a streamed token, {row['ms_per_request']} ms a"
                " request"
            )
        gen_cpu_s = sum(g.get("cpu_s", 0.0) for g in run["generator"] if not g["failed"])
        gen_tokens = sum(g.get("num_output_tokens", 0) for g in run["generator"])
        if run["path"] == "http" and gen_tokens:
            print(f"{router}: generators: {1e6 * gen_cpu_s / gen_tokens:.2f} us of CPU a token")
        admit = m["admit_ms"]
        if not math.isnan(admit["p50"]):
            print(
                f"{router}: sent -> engine admission p50 {admit['p50']:.1f} ms, p90"
                f" {admit['p90']:.1f} ms (TTFT p50 {m['ttft_ms']['p50']:.1f} ms)"
            )
        for gen in run["generator"]:
            if gen["failed"]:
                print(f"{router}: generator {gen['proc']} FAILED: {gen['failed']}")
                status = 1
            elif gen["saturated"]:
                print(
                    f"{router}: generator {gen['proc']} SATURATED: {gen['cpu_fraction']:.0%} of a"
                    f" core on average, {gen['saturated_windows']}/{gen['num_windows']} windows"
                    " over 90%: add --num-procs"
                )
    if args.out:
        payload = {
            "command": "python -m bench.load " + " ".join(sys.argv[1:]),
            "workload": workload,
            "target": {k: getattr(args, k) for k in _TARGET_KEYS},
            "runs": {
                r: _run_json(args, run) | {"x_offline": x_offline(run, offline)}
                for r, run in runs.items()
            },
            "ratios_vs_" + BASELINE_ROUTER: ratios,
            "offline_peer": None if offline is None else _run_json(args, offline),
        }
        write_json(args.out, payload)
        print(f"wrote {args.out}")
    return status


def _run_json(args: argparse.Namespace, run: dict) -> dict:
    """A run as the JSON keeps it: per-request and routing rows only when asked for."""
    out = {k: v for k, v in run.items() if k not in ("records", "routing_rows")}
    if args.save_requests:
        out["requests"] = [asdict(x) for x in run["records"]]
    if args.routing_trace:
        out["routing_rows"] = [asdict(x) for x in run.get("routing_rows", [])]
    return out


_TARGET_KEYS = (
    "app_name model num_replicas routers router num_blocks max_num_seqs block_size device "
    "dtype on_overload queue_fraction balance_band num_procs "
    "carrier_messages_per_step access_log engine_process http http_url http_proxy "
    "ingress_replicas offline_peer"
).split()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    t = p.add_argument_group("target (--model starts a local app; without it, attach)")
    t.add_argument(
        "--app-name",
        default="kvfleet",
        help="the app to attach to; with --model, each router's round deploys APP_NAME-ROUTER",
    )
    t.add_argument("--address", default="auto", help="Ray address when attaching")
    # Every ClusterConfig field but these: replica_id (the cluster names replicas), policy
    # (--router names it), seed (the workload's --seed seeds the cluster too) and app_name
    # (--app-name above, which also names the app to attach to).
    add_config_flags(
        t, ClusterConfig, exclude=("replica_id", "policy", "seed", "app_name"),
        aliases={"num_replicas": ["--replicas"]},
    )  # fmt: skip
    p.set_defaults(model=None, num_replicas=2)
    t.add_argument("--routers", default=None, help="comma list of --router's choices")
    t.add_argument(
        "--ray-num-cpus", type=int, default=None,
        help="a local Ray's CPUs (default: the replicas' and two for Serve)",
    )  # fmt: skip
    t.add_argument(
        "--http-url", default="http://127.0.0.1:8000",
        help="with --http: the ingress the generators stream from (with --model, the app's"
        " HTTP proxy binds this host and port)",
    )  # fmt: skip
    t.add_argument(
        "--fake-engine-step-ms", type=float, default=None,
        help="the replicas run a model-free engine (bench.cluster.FakeEngine: a token for"
        " every request each step of this many ms) in place of --model's: the ceiling of"
        " the serving path itself, and its CPU per token",
    )  # fmt: skip
    t.add_argument(
        "--offline-peer", action="store_true",
        help="first replay the trace through a bare engine of the replicas' EngineConfig"
        " (needs --model); each router's row gets its tokens/s over the engine's",
    )  # fmt: skip
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=200, help="requests in the trace")
    w.add_argument("--rate", type=float, default=math.inf, help="req/s; inf: all at once")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    w.add_argument("--concurrency", type=int, default=None, help="closed loop of N users")
    w.add_argument(
        "--dataset", choices=DATASETS, default="random",
        help="random lengths, shared prefixes, or long-tailed lengths (bench.load_workload)",
    )  # fmt: skip
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (median)")
    w.add_argument("--output-len", type=int, default=32, help="output tokens (median)")
    w.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="random: lengths uniform in [len * (1 - r), len * (1 + r)]",
    )  # fmt: skip
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct prefixes")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens per prefix")
    w.add_argument("--tail", choices=TAILS, default="lognormal", help="longtail's lengths")
    w.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (longtail)")
    w.add_argument("--alpha", type=float, default=1.5, help="Pareto shape (longtail)")
    w.add_argument("--max-input-len", type=int, default=1024, help="longtail: prompt cap")
    w.add_argument("--max-output-len", type=int, default=256, help="longtail: output cap")
    w.add_argument("--vocab-size", type=int, default=None, help="default: the model's")
    add_replay_flags(w)
    w.add_argument(
        "--seed", type=int, default=0, help="seeds the trace, the engines and the routers"
    )
    m = p.add_argument_group("measurement")
    m.add_argument("--slo-ttft-ms", type=float, default=None, help="SLO: time to first token")
    m.add_argument("--slo-tpot-ms", type=float, default=None, help="SLO: time per output token")
    m.add_argument("--slo-e2e-ms", type=float, default=None, help="SLO: end-to-end latency")
    m.add_argument(
        "--num-procs", type=int, default=2, help="generator processes (bench.load_worker)"
    )
    m.add_argument("--timeout-s", type=float, default=300.0, help="after the last arrival")
    m.add_argument("--out", default=None, help="write the results as JSON here")
    m.add_argument("--save-requests", action="store_true", help="per-request rows in JSON")
    m.add_argument(
        "--routing-trace",
        action="store_true",
        help="record every kvfleet routing decision in the generators (cluster.routing_trace):"
        " a summary line per router, and the rows in JSON",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.trace is not None and args.concurrency is not None:
        raise SystemExit("--trace replays open loop at its timestamps; drop --concurrency")
    if args.concurrency is not None and not math.isinf(args.rate):
        raise SystemExit("--rate and --concurrency are exclusive (open or closed loop)")
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit("--concurrency must be >= 1")
    if args.num_procs < 1:
        raise SystemExit("--num-procs must be >= 1")
    if args.model is None and len((args.routers or "").split(",")) > 1:
        raise SystemExit("--routers needs --model: an attached app cannot be redeployed")
    if args.model is None and args.offline_peer:
        raise SystemExit("--offline-peer needs --model: the engine to build is the replicas'")
    if args.fake_engine_step_ms is not None and (args.model is None or args.offline_peer):
        raise SystemExit("--fake-engine-step-ms deploys the replicas (needs --model, for its"
                         " vocabulary) and has no offline peer (drop --offline-peer)")  # fmt: skip
    if args.fake_engine_step_ms is not None and args.fake_engine_step_ms < 0:
        raise SystemExit("--fake-engine-step-ms must be >= 0")
    if args.http and args.routing_trace:
        raise SystemExit("--routing-trace records a Client's decisions; over --http the"
                         " ingress makes them")  # fmt: skip
    known = set(ROUTERS) | set(SERVE_ROUTERS)
    unknown = [r for r in (args.routers or "").split(",") if r and r not in known]
    if unknown:
        raise SystemExit(f"--routers: unknown router(s) {unknown}; known: {sorted(known)}")
    workload, runs, offline = run_all(args)
    return report(args, workload, runs, offline)


if __name__ == "__main__":
    sys.exit(main())
