"""Overload benchmark: goodput and shedding at multiples of measured capacity, over HTTP.

    # 2 local CPU replicas of gpt2-tiny: capacity (closed loop), then 1x 2x 3x 5x of it
    python -m bench.overload --model gpt2-tiny --replicas 2 --device cpu --duration-s 20 \
        --scales 1 2 3 5 --out overload.json
    # attach to a running server (python -m cluster serve ...) at a capacity given
    python -m bench.overload --http-url http://127.0.0.1:8000 --capacity 40

First the capacity: completed requests per second of a closed loop of --capacity-users
streaming users for --capacity-s (a user refused with 503 pauses 50 ms; --capacity skips
this). Then, per scale, open-loop Poisson arrivals at scale x capacity for --duration-s,
every request streamed (POST /v1/completions, bench.load_http) under a client timeout.
Per step: goodput (completed requests whose TTFT met --ttft-slo-ms, per second of the
step), the time to each 503 (rejection latency), the lost (neither a completion, a typed
error nor a 503 within the client timeout), the time until every replica reports nothing
running or waiting (/stats, polled every 50 ms) from the last arrival (l) and from the last
response (r: work left behind once every client is done; the target's), and the resident
memory of the ingress replicas and of Serve's proxy (with its HAProxy children) before
and after, from Ray's actor table (same host only). The issue-48 targets: goodput at 3x
and 5x >= 90% of 1x, rejections < 50 ms p99, 0 lost, idle within 2 s, memory within 20%.
Exit status 1 if any request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from bench.common import percentile, write_json
from bench.load_http import open_session, send_one_http
from bench.load_metrics import RequestRecord
from bench.load_workload import RequestSpec
from cluster.config import ClusterConfig
from replica.config_flags import add_config_flags, flag_values

STATS_POLL_S = 0.05
STATS_SAMPLE_S = 0.5  # while a step runs: often enough for its peaks, rare enough to cost nothing
REJECTED_PAUSE_S = 0.05  # a closed-loop user refused with 503 waits this, then sends again
CAPACITY_WARMUP = 1 / 3  # of the closed loop's time, left out of its rate
TARGETS = {"goodput_ratio": 0.9, "reject_p99_ms": 50.0, "lost": 0, "idle_s": 2.0, "rss": 1.2}


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    vocab_size: int
    timeout_s: float  # the client's: a request with no outcome by then is lost

    def spec(self, index: int, rng: np.random.Generator, arrival_s: float = 0.0) -> RequestSpec:
        # Random prompts: no two share a cached prefix, so every step costs the same.
        tokens = rng.integers(0, self.vocab_size - 1, self.input_len).tolist()
        return RequestSpec(index, tokens, self.output_len, arrival_s)


async def send(
    session: aiohttp.ClientSession, url: str, spec: RequestSpec, t0: float, timeout_s: float
) -> RequestRecord:
    record = RequestRecord(spec.index, len(spec.prompt_token_ids), spec.max_tokens, spec.arrival_s)
    try:
        await asyncio.wait_for(send_one_http(session, url, spec, record, t0), timeout_s)
    except TimeoutError:
        record.error_message = f"no outcome within the client timeout ({timeout_s:g} s)"
    return record


async def closed_loop(
    url: str, workload: Workload, num_users: int, duration_s: float, seed: int
) -> float:
    """Completed requests per second of num_users back-to-back streaming users, counted
    over the last (1 - CAPACITY_WARMUP) of duration_s: the users start together, so the
    first completions come late and would understate the rate."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    done: list[RequestRecord] = []
    start_s = CAPACITY_WARMUP * duration_s

    async def user(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() - t0 < duration_s:
            record = await send(session, url, workload.spec(len(done), rng), t0, workload.timeout_s)
            if record.outcome == "ok" and start_s <= record.end_s <= duration_s:
                done.append(record)
            elif record.outcome != "ok":
                await asyncio.sleep(REJECTED_PAUSE_S)

    async with open_session() as session:
        await asyncio.gather(*(user(session) for _ in range(num_users)))
    return len(done) / (duration_s - start_s)


async def engine_load(
    session: aiohttp.ClientSession, url: str, headers: dict
) -> tuple[int, int] | None:
    """Sequences running and waiting over every replica (/stats); None if it did not answer."""
    try:
        async with session.get(f"{url}/stats", headers=headers) as response:
            if response.status != 200:
                return None
            replicas = (await response.json())["replicas"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
        return None
    return sum(r["num_running"] for r in replicas), sum(r["num_waiting"] for r in replicas)


async def sample_load(url: str, headers: dict, samples: list[tuple[int, int]]) -> None:
    """Append engine_load every STATS_SAMPLE_S until cancelled (what the engines held
    while the step ran: where the requests waited)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        while True:
            load = await engine_load(session, url, headers)
            if load is not None:
                samples.append(load)
            await asyncio.sleep(STATS_SAMPLE_S)


async def wait_idle(url: str, headers: dict, timeout_s: float) -> float | None:
    """Seconds until /stats shows nothing running or waiting; None past timeout_s."""
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.perf_counter() - start < timeout_s:
            if await engine_load(session, url, headers) == (0, 0):
                return time.perf_counter() - start
            await asyncio.sleep(STATS_POLL_S)
    return None


async def open_loop_step(
    url: str, workload: Workload, rate: float, duration_s: float, seed: int, headers: dict
) -> tuple[list[RequestRecord], float | None, float | None, list[tuple[int, int]]]:
    """Poisson arrivals at rate for duration_s; (records, seconds from the last arrival to
    idle, seconds from the last response to idle, the engines' (running, waiting) samples
    over the arrivals)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 1.5) + 16)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration_s]
    t0 = time.perf_counter()
    samples: list[tuple[int, int]] = []
    sampler = asyncio.ensure_future(sample_load(url, headers, samples))
    async with open_session() as session:
        tasks = []
        for i, arrival_s in enumerate(arrivals.tolist()):
            delay_s = arrival_s - (time.perf_counter() - t0)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            spec = workload.spec(i, rng, arrival_s)
            tasks.append(asyncio.ensure_future(send(session, url, spec, t0, workload.timeout_s)))
        load_end = time.perf_counter()
        sampler.cancel()
        idle = asyncio.ensure_future(wait_idle(url, headers, workload.timeout_s + 30.0))
        records = await asyncio.gather(*tasks)
        last_response = time.perf_counter()
        idle_after_load_s = await idle
    idle_after_last_s = None
    if idle_after_load_s is not None:
        idle_after_last_s = max(0.0, load_end + idle_after_load_s - last_response)
    return list(records), idle_after_load_s, idle_after_last_s, samples


def step_summary(
    records: list[RequestRecord], duration_s: float, ttft_slo_ms: float
) -> dict[str, object]:
    """The step's counts, goodput and latencies (ms) from its records."""
    ok = [r for r in records if r.outcome == "ok"]
    refused = [r for r in records if r.outcome == "rejected"]
    good = [r for r in ok if r.ttft_s * 1e3 <= ttft_slo_ms]
    reject_ms = [1e3 * (r.end_s - r.sent_s) for r in refused]
    ttft_ms = [1e3 * r.ttft_s for r in ok]
    return {
        "offered": len(records),
        "completed": len(ok),
        "rejected": len(refused),
        "errors": sum(r.outcome == "error" for r in records),
        "lost": sum(r.outcome == "lost" for r in records),
        "goodput_rps": len(good) / duration_s,
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "reject_p50_ms": percentile(reject_ms, 50),
        "reject_p99_ms": percentile(reject_ms, 99),
    }


def front_pids() -> dict[str, list[int]]:
    """The PIDs of the HTTP ingress replicas and of Serve's proxy actors (Ray's actor table
    of the connected cluster); empty when not connected."""
    import ray

    if not ray.is_initialized():
        return {}
    from ray._private.state import actors  # the GCS table: no dashboard needed

    pids: dict[str, list[int]] = {"ingress": [], "proxy": []}
    for actor in actors(actor_state_name="ALIVE").values():
        name = actor["ActorClassName"]
        if name.startswith("ServeReplica:") and name.endswith(":Ingress"):
            pids["ingress"].append(actor["Pid"])
        elif name == "ProxyActor":
            pids["proxy"].append(actor["Pid"])
    return pids


def rss_mb(pid: int) -> float:
    """Resident memory of pid and its descendants (Serve's HAProxy runs as the proxy
    actor's child), in MB; 0 for a process that is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total_kb, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total_kb += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total_kb / 1024


def front_rss_mb(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: round(sum(rss_mb(p) for p in ps), 1) for role, ps in pids.items()}


def verdicts(steps: list[dict], baseline_rss: dict[str, float]) -> dict[str, bool | None]:
    """Which issue-48 targets held over the steps (None: not measured)."""
    by_scale = {s["scale"]: s for s in steps}
    base = by_scale.get(1.0, steps[0])["goodput_rps"]
    heavy = [s for s in steps if s["scale"] >= 3]
    rejects = [s["reject_p99_ms"] for s in steps if not math.isnan(s["reject_p99_ms"])]
    # From the last response, not the last arrival: requests admitted just before the
    # load stopped are served to the end, and may take longer than 2 s on their own.
    idles = [s["idle_after_last_response_s"] for s in steps]
    growth = [
        s["rss_mb"][role] / baseline_rss[role]
        for s in steps
        for role in baseline_rss
        if baseline_rss[role] and s.get("rss_mb")
    ]
    return {
        "goodput_3x_5x_ge_90pct_of_1x": (
            all(s["goodput_rps"] >= TARGETS["goodput_ratio"] * base for s in heavy)
            if heavy and base > 0
            else None
        ),
        "reject_p99_lt_50ms": all(r < TARGETS["reject_p99_ms"] for r in rejects)
        if rejects
        else None,
        "zero_lost": all(s["lost"] == 0 for s in steps),
        "idle_within_2s": all(i is not None and i <= TARGETS["idle_s"] for i in idles),
        "rss_within_20pct": all(g <= TARGETS["rss"] for g in growth) if growth else None,
    }


def _row(s: dict) -> str:
    idle = "/".join(
        "-" if s[k] is None else f"{s[k]:.1f}"
        for k in ("idle_after_load_s", "idle_after_last_response_s")
    )
    rss = "/".join(f"{v:.0f}" for v in s.get("rss_mb", {}).values()) or "-"
    return (
        f"{s['scale']:>5g}x {s['rate_rps']:>7.1f} {s['offered']:>7} {s['completed']:>6} "
        f"{s['rejected']:>6} {s['errors']:>4} {s['lost']:>4} {s['goodput_rps']:>8.1f} "
        f"{s['ttft_p50_ms']:>8.0f} {s['ttft_p99_ms']:>8.0f} {s['reject_p99_ms']:>8.1f} "
        f"{idle:>9} {rss:>11}"
    )


HEADER = (
    "scale  req/s  offered     ok    503  err lost  goodput ttft p50 ttft p99 rej p99  "
    "idle_s l/r rss MB i/p"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n")[0])
    t = p.add_argument_group("target (--model starts a local app with http; without it, attach)")
    add_config_flags(
        t, ClusterConfig, exclude=("replica_id", "policy", "seed", "http"),
        aliases={"num_replicas": ["--replicas"]},
    )  # fmt: skip
    p.set_defaults(model=None, num_replicas=2)
    t.add_argument("--http-url", default="http://127.0.0.1:8000", help="the server's URL")
    t.add_argument("--address", default="auto", help="Ray address when attaching (for RSS)")
    t.add_argument("--ray-num-cpus", type=int, default=None, help="a local Ray's CPUs")
    w = p.add_argument_group("load")
    w.add_argument("--capacity", type=float, default=None, help="req/s; default: measured")
    w.add_argument("--capacity-s", type=float, default=15.0, help="closed-loop seconds")
    w.add_argument("--capacity-users", type=int, default=64, help="closed-loop users")
    w.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0, 3.0, 5.0])
    w.add_argument("--duration-s", type=float, default=60.0, help="seconds per scale")
    w.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="goodput's TTFT bound")
    w.add_argument("--client-timeout-s", type=float, default=30.0, help="per request")
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--vocab-size", type=int, default=None, help="default: the model's (or 512)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", default=None, help="JSON report path")
    return p


def _start(args: argparse.Namespace) -> tuple[ClusterConfig | None, int]:
    """Start the local app (with --model) or attach to Ray (for RSS); (config, vocab)."""
    import ray

    from bench.load_target import deploy, start_http, start_local_ray, wait_http_ready

    if args.model is None:
        try:
            ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
        except ConnectionError:
            print("no Ray to attach to: ingress and proxy RSS are not measured")
        return None, args.vocab_size or 512
    config = ClusterConfig(**flag_values(ClusterConfig, args) | {"http": True})
    num_cpus = args.ray_num_cpus or math.ceil(config.num_replicas) + 2
    start_local_ray(num_cpus, config)
    start_http(args.http_url)
    deploy(config)
    wait_http_ready(args.http_url)
    from replica.models import load_model_config

    return config, args.vocab_size or load_model_config(args.model).vocab_size


def run(args: argparse.Namespace) -> dict:
    config, vocab_size = _start(args)
    url = args.http_url.rstrip("/")
    key = (config.api_key if config else None) or os.environ.get("KVFLEET_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    workload = Workload(args.input_len, args.output_len, vocab_size, args.client_timeout_s)
    capacity = args.capacity
    if capacity is None:
        capacity = asyncio.run(
            closed_loop(url, workload, args.capacity_users, args.capacity_s, args.seed)
        )
        print(f"capacity: {capacity:.1f} req/s ({args.capacity_users} users, {args.capacity_s} s)")
    asyncio.run(wait_idle(url, headers, args.client_timeout_s + 30.0))
    pids = front_pids()
    baseline_rss = front_rss_mb(pids)
    print(f"ingress / proxy RSS baseline: {baseline_rss} MB")
    print(HEADER)
    steps = []
    for i, scale in enumerate(args.scales):
        rate = scale * capacity
        cpu0 = time.process_time()
        records, idle_load_s, idle_last_s, samples = asyncio.run(
            open_loop_step(url, workload, rate, args.duration_s, args.seed + 1 + i, headers)
        )
        step = {"scale": scale, "rate_rps": rate}
        step |= step_summary(records, args.duration_s, args.ttft_slo_ms)
        step |= {
            "idle_after_load_s": idle_load_s,
            "idle_after_last_response_s": idle_last_s,
            "rss_mb": front_rss_mb(pids),
            "engine_max_running": max((r for r, _ in samples), default=None),
            "engine_max_waiting": max((w for _, w in samples), default=None),
            "generator_cpu_fraction": (time.process_time() - cpu0) / args.duration_s,
            "lost_examples": [r.error_message for r in records if r.outcome == "lost"][:3],
        }
        steps.append(step)
        print(_row(step))
    base = steps[0]["goodput_rps"] or math.nan
    for step in steps:
        step["goodput_ratio"] = step["goodput_rps"] / base
    report = {
        "target": {"http_url": url, "model": args.model, "replicas": args.num_replicas},
        "config": None if config is None else json.loads(json.dumps(vars(args), default=str)),
        "capacity_rps": capacity,
        "duration_s": args.duration_s,
        "ttft_slo_ms": args.ttft_slo_ms,
        "client_timeout_s": args.client_timeout_s,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "baseline_rss_mb": baseline_rss,
        "steps": steps,
        "targets": verdicts(steps, baseline_rss),
    }
    print("goodput / 1x: " + ", ".join(f"{s['scale']:g}x {s['goodput_ratio']:.2f}" for s in steps))
    print("targets: " + json.dumps(report["targets"]))
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        report = run(args)
    finally:
        if args.model is not None:
            from bench.load_target import shutdown

            shutdown()
    write_json(args.out, report)
    return 1 if any(s["lost"] for s in report["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
