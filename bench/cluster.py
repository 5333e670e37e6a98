"""Cluster benchmark: the Serve path's overhead and the transport ceiling.

    python -m bench.cluster --quick                        # CPU, ~1 min
    python -m bench.cluster --model gpt2 --device cuda --out results/cluster.json

(a) overhead: TTFT p50 at concurrency 1 through Serve (Client.stream, first chunk)
    against the same preset's LLMEngine in this process (add_request + step until
    the first token); the difference is what the cluster adds (target <= 3 ms).
(b) transport: tokens/s out of one replica into one caller process through the
    step-batched carrier (LLMServer around FakeEngine, which emits one token per
    request per step_s, so the transport is the bottleneck) against Serve's
    per-request streaming (one chunk per token per request through a
    DeploymentHandle); also the inter-chunk interval each request sees, the
    steady rate (every stream in flight: without the submit ramp), and the CPU
    time per token of the caller processes and of the replica processes.

FakeEngine and PacedEngine are also what the cluster tests use for replicas of a
known pace (an engine_factory for cluster.build_app; picklable by reference).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from bench.common import machine_description, markdown_table, percentile, write_json
from cluster.config import ClusterConfig
from replica.config_flags import add_config_flags, config_from_args
from replica.outputs import StepOutputs
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

# ---- engines of a known pace ----------------------------------------------------------


@dataclass
class _FakeRequest:
    num_prompt_tokens: int
    max_tokens: int
    num_generated: int = 0


class FakeEngine:
    """A model-free engine with LLMEngine's serving interface.

    Each step() sleeps step_s (releasing the GIL, as a GPU step would), then emits
    one token for each of the first max_num_seqs requests; a request finishes
    ("length") after max_tokens. KV usage is computed from token counts.
    """

    def __init__(
        self,
        replica_id: str,
        step_s: float = 0.0,
        num_blocks: int = 65536,
        block_size: int = 16,
        max_num_seqs: int = 1024,
    ) -> None:
        self.replica_id = replica_id
        self.step_s = step_s
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.model_config = SimpleNamespace(vocab_size=50257, eos_token_id=None)
        self.tokenizer = None
        self.max_model_len = 1 << 20
        self.requests: dict[str, _FakeRequest] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.requests[request_id] = _FakeRequest(len(prompt_token_ids), params.max_tokens)

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def device_busy(self) -> bool:
        return False  # its step's time passes within step()

    def step(self) -> StepOutputs:
        if self.step_s > 0:
            time.sleep(self.step_s)
        outputs = StepOutputs([], [], {})
        for request_id, r in list(self.requests.items())[: self.max_num_seqs]:
            r.num_generated += 1
            if r.num_generated >= r.max_tokens:
                outputs.finishes[len(outputs)] = ("length", r.num_prompt_tokens, 0)
                del self.requests[request_id]
            outputs.request_ids.append(request_id)
            outputs.token_ids.append(r.num_generated % 50000)
        return outputs

    def stats(self, with_hashes: bool = True) -> ReplicaStats:  # it caches nothing
        size = self.block_size
        num_used = sum(
            -(-(r.num_prompt_tokens + r.num_generated) // size) for r in self.requests.values()
        )
        num_used = min(num_used, self.num_blocks)
        return ReplicaStats(
            replica_id=self.replica_id,
            num_blocks_total=self.num_blocks,
            num_blocks_free=self.num_blocks - num_used,
            num_blocks_cached=0,
            kv_usage=num_used / self.num_blocks,
            num_running=min(len(self.requests), self.max_num_seqs),
            num_waiting=max(0, len(self.requests) - self.max_num_seqs),
            num_preempted_total=0,
            max_num_seqs=self.max_num_seqs,
            tokens_per_s=0.0,
            block_size=size,
            timestamp_s=time.time(),
        )


class PacedEngine:
    """A real engine whose steps last at least min_step_s: requests that stay in flight
    for seconds on a CPU where gpt2-tiny steps in under a millisecond.

    Everything but step() is the wrapped engine's own (attribute delegation)."""

    def __init__(self, engine: Any, min_step_s: float) -> None:
        self.engine = engine
        self.min_step_s = min_step_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> StepOutputs:
        start_s = time.perf_counter()
        outputs = self.engine.step()
        time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - start_s)))
        return outputs


def fake_engine(
    config: ClusterConfig, replica_id: str, num_gpus: float, step_s: float = 0.0
) -> FakeEngine:
    """engine_factory for build_app: functools.partial(fake_engine, step_s=...)."""
    engine = FakeEngine(
        replica_id, step_s, config.num_blocks or 65536, config.block_size, config.max_num_seqs
    )
    gc.freeze()  # the replica has started up: as LLMEngine does, so GC passes skip it
    return engine


def paced_engine(
    config: ClusterConfig, replica_id: str, num_gpus: float, min_step_s: float
) -> PacedEngine:
    """engine_factory for build_app: functools.partial(paced_engine, min_step_s=...)."""
    from replica import LLMEngine

    return PacedEngine(LLMEngine(config.engine_config(replica_id, num_gpus)), min_step_s)


# ---- (a) the Serve path's overhead over the in-process engine ----------------------------


def _ttft_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_ttft_s(config: ClusterConfig, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """TTFT of each prompt on an idle LLMEngine in this process, one request at a time."""
    import torch

    from replica import LLMEngine

    engine = LLMEngine(config.engine_config("bench-direct", 1.0 if config.device == "cuda" else 0))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    times = []
    for i, prompt in enumerate(prompts):
        sync()
        start_s = time.perf_counter()
        engine.add_request(f"direct-{i}", prompt, _ttft_params(max_tokens))
        while not engine.step().token_ids:
            pass
        sync()
        times.append(time.perf_counter() - start_s)
        while engine.has_unfinished():
            engine.step()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times


async def serve_ttft_s(client: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """TTFT of each prompt through Client.stream (first chunk), one request at a time."""
    times = []
    for prompt in prompts:
        start_s = time.perf_counter()
        chunks = client.stream(prompt, _ttft_params(max_tokens))
        await chunks.__anext__()
        times.append(time.perf_counter() - start_s)
        async for _ in chunks:
            pass
    return times


# ---- (b) the transport ceiling ---------------------------------------------------------------


class TokenStreamer:
    """The per-request baseline: one Serve streaming response per request, one chunk per token."""

    async def stream(self, num_tokens: int) -> AsyncIterator[int]:
        for i in range(num_tokens):
            yield i

    def cpu_s(self) -> float:
        """This replica process's CPU seconds so far (all its threads)."""
        return time.process_time()


@dataclass
class StreamRun:
    """What one caller process received. steady_*: from the moment every stream had its
    first chunk to the first stream's end after it, when all streams are in flight (the
    transport's rate without the submit ramp); cpu_s: this process's CPU time."""

    num_tokens: int = 0
    wall_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    steady_tokens: int = 0
    steady_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else float("nan")


async def _drain_streams(streams: list[AsyncIterator[Any]], count: Any) -> StreamRun:
    run = StreamRun()
    num_started = 0
    window: list[tuple[float, int]] = []  # (time, tokens so far): all started, first end

    async def one(stream: AsyncIterator[Any]) -> None:
        nonlocal num_started
        last_s = None
        async for item in stream:
            now_s = time.perf_counter()
            run.num_tokens += count(item)
            if last_s is not None:
                run.chunk_gaps_s.append(now_s - last_s)
            else:
                num_started += 1
                if num_started == len(streams):
                    window.append((now_s, run.num_tokens))
            last_s = now_s
        if len(window) == 1:
            window.append((time.perf_counter(), run.num_tokens))

    start_s, cpu_s = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(s) for s in streams))
    run.wall_s = time.perf_counter() - start_s
    run.cpu_s = time.process_time() - cpu_s
    if len(window) == 2:
        run.steady_s = window[1][0] - window[0][0]
        run.steady_tokens = window[1][1] - window[0][1]
    return run


async def carrier_run(client: Any, num_streams: int, num_tokens: int) -> StreamRun:
    params = _ttft_params(num_tokens)
    streams = [client.stream([1, 2, 3, i % 50000 + 1], params) for i in range(num_streams)]
    return await _drain_streams(streams, lambda chunk: len(chunk.token_ids))


async def per_request_run(handle: Any, num_streams: int, num_tokens: int) -> StreamRun:
    streaming = handle.options(method_name="stream", stream=True)
    streams = [streaming.remote(num_tokens) for _ in range(num_streams)]
    return await _drain_streams(streams, lambda _: 1)


# ---- the run ----------------------------------------------------------------------------------


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def run_overhead(args: argparse.Namespace) -> list[dict]:
    from ray import serve

    from cluster import Client, build_app
    from cluster.client import LLM_DEPLOYMENT

    config = config_from_args(ClusterConfig, args)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_len)] for _ in range(args.ttft_n)]
    warm = prompts[:5]
    direct = engine_ttft_s(config, warm + prompts, max_tokens=4)[len(warm) :]
    serve.run(build_app(config), name=config.app_name, route_prefix=None)
    # The peer: Serve's default handle, whose router runs on a thread of its own and
    # which reaches replicas through Ray actor calls.
    threaded = serve.get_deployment_handle(LLM_DEPLOYMENT, config.app_name)
    clients = {  # the three paths a caller takes: the HTTP ingress's, Client's, Serve's
        "Serve, router on the caller's loop, gRPC (the HTTP ingress)": Client(
            config.app_name, route_on_caller_loop=True
        ),
        "Serve, router thread, gRPC (Client's default)": Client(handle=threaded),
        "Serve, router thread, actor calls (Serve's default handle)": Client(
            handle=threaded, serve_grpc=False
        ),
    }

    async def measure(client: Any) -> list[float]:
        await serve_ttft_s(client, warm, max_tokens=4)
        ttft = await serve_ttft_s(client, prompts, max_tokens=4)
        await client.aclose()
        return ttft

    served = {path: asyncio.run(measure(client)) for path, client in clients.items()}
    serve.delete(config.app_name)
    rows = [
        {"path": "LLMEngine in-process", "ttft_p50_ms": _ms(direct, 50),
         "ttft_p90_ms": _ms(direct, 90)},
    ]  # fmt: skip
    for path, ttft in served.items():
        rows.append({"path": path, "ttft_p50_ms": _ms(ttft, 50), "ttft_p90_ms": _ms(ttft, 90),
                     "added_p50_ms": _ms(ttft, 50) - _ms(direct, 50)})  # fmt: skip
    return rows


class CallerProcess:
    """A second caller process (a Ray actor) running carrier_run with its own Client."""

    def __init__(self, app_name: str) -> None:
        from cluster import Client

        self.client = Client(app_name)
        gc.freeze()  # as run_carrier does in its own process

    def run(self, num_streams: int, num_tokens: int) -> StreamRun:
        return asyncio.run(carrier_run(self.client, num_streams, num_tokens))


def replica_cpu_s(client: Any) -> float:
    """CPU seconds the app's replica processes have used so far: LLMServer.serving_counters,
    all their threads, and the engine child's with engine_process."""
    return sum(c["cpu_s"] + (c["engine_cpu_s"] or 0.0) for c in client.serving_counters())


def run_carrier(args: argparse.Namespace, num_replicas: int, num_callers: int) -> dict:
    """num_callers processes (this one and num_callers - 1 actors), args.streams streams each."""
    import ray
    from ray import serve

    from bench import cluster as this
    from cluster import Client, build_app

    config = ClusterConfig(
        model="fake",
        num_replicas=num_replicas,
        device="cpu",
        num_blocks=1 << 20,
        max_num_seqs=4096,
        app_name="bench-carrier",
    )
    factory = functools.partial(this.fake_engine, step_s=args.step_ms / 1e3)
    serve.run(build_app(config, engine_factory=factory), name=config.app_name, route_prefix=None)
    client = Client(config.app_name)
    others = [
        ray.remote(num_cpus=0)(this.CallerProcess).remote(config.app_name)
        for _ in range(num_callers - 1)
    ]
    ray.get([o.run.remote(4, 4) for o in others])  # warm: carriers, model info
    asyncio.run(carrier_run(client, 4, 4))
    gc.freeze()  # as a caller process that has started up (the engine does the same)
    cpu_s = replica_cpu_s(client)
    pending = [o.run.remote(args.streams, args.tokens) for o in others]
    runs = [asyncio.run(carrier_run(client, args.streams, args.tokens)), *ray.get(pending)]
    cpu_s = replica_cpu_s(client) - cpu_s
    for other in others:
        ray.kill(other)
    serve.delete(config.app_name)
    return _transport_row("step-batched carrier", num_replicas, num_callers, args, runs, cpu_s)


def run_transport(args: argparse.Namespace) -> list[dict]:
    from ray import serve

    from bench import cluster as this

    rows = [run_carrier(args, r, c) for r, c in args.carrier_shapes]
    streamer = serve.deployment(
        this.TokenStreamer, name="TokenStreamer", max_ongoing_requests=1 << 16,
        ray_actor_options={"num_cpus": 1},
    )  # fmt: skip
    handle = serve.run(streamer.bind(), name="bench-per-request", route_prefix=None)
    asyncio.run(per_request_run(handle, 4, 4))
    cpu_s = handle.cpu_s.remote().result()
    run = asyncio.run(per_request_run(handle, args.streams, args.baseline_tokens))
    cpu_s = handle.cpu_s.remote().result() - cpu_s
    serve.delete("bench-per-request")
    rows.append(_transport_row("per-request stream (baseline)", 1, 1, args, [run], cpu_s))
    return rows


def _transport_row(
    name: str,
    num_replicas: int,
    num_callers: int,
    args: argparse.Namespace,
    runs: list[StreamRun],
    replica_cpu_s: float,
) -> dict:
    num_tokens = sum(r.num_tokens for r in runs)
    wall_s = max(r.wall_s for r in runs)
    steady = sum(r.steady_tokens_per_s for r in runs)  # each caller's own window
    return {
        "transport": name,
        "replicas": num_replicas,
        "callers": num_callers,
        "streams": args.streams * num_callers,
        "tokens": num_tokens,
        "wall_s": wall_s,
        "tokens_per_s_per_replica": num_tokens / wall_s / num_replicas,
        "tokens_per_s_per_caller": num_tokens / wall_s / num_callers,
        "steady_tokens_per_s_per_replica": steady / num_replicas,
        "chunk_gap_p50_ms": _ms([gap for r in runs for gap in r.chunk_gaps_s], 50),
        "caller_cpu_us_per_token": sum(r.cpu_s for r in runs) / num_tokens * 1e6,
        "replica_cpu_us_per_token": replica_cpu_s / num_tokens * 1e6,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    app = parser.add_argument_group(
        "the overhead section's app (ClusterConfig)",
        "every field but replica_id (the cluster names replicas) and policy (--router)",
    )
    add_config_flags(app, ClusterConfig, exclude=("replica_id", "policy"))
    parser.set_defaults(num_blocks=1024, max_num_seqs=64, app_name="bench-overhead")
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="overhead: prompt tokens of a TTFT request"
    )
    parser.add_argument("--step-ms", type=float, default=1.0, help="FakeEngine step time")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray logical CPUs")
    parser.add_argument(
        "--sections", nargs="+", default=["overhead", "transport"],
        choices=("overhead", "transport"), help="which measurements to run",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write results as JSON here")
    return parser


def _sizes(args: argparse.Namespace) -> None:
    quick = args.quick
    args.ttft_n = 30 if quick else 200
    args.streams = 64 if quick else 256
    args.tokens = 100 if quick else 400
    args.baseline_tokens = 20 if quick else 50
    # (replicas, caller processes): one replica's output, one caller's input
    args.carrier_shapes = [(1, 1)] if quick else [(1, 1), (1, 2), (2, 1)]


def main() -> None:
    import ray

    args = _parser().parse_args()
    _sizes(args)
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    num_cpus = args.num_cpus or max(4, os.cpu_count() or 1)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        if "overhead" in args.sections:
            results["overhead"] = run_overhead(args)
        if "transport" in args.sections:
            results["transport"] = run_transport(args)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    print(f"\n{machine_description()}, {time.strftime('%Y-%m-%d')}")
    for section in ("overhead", "transport"):
        if section in results:
            print(f"\n### {section}\n")
            print(markdown_table(results[section]))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
