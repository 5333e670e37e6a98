"""A burst through a Serve replica's engine thread (cluster.engine_loop.EngineLoop), beside
the same burst stepped on the bare engine.

    python -m bench.engine_loop --model gpt2 --dtype float16 --batch 256 --reps 3

Each rep runs --batch prompts (--prompt-len tokens, --max-new new tokens, greedy,
ignore_eos) to the end twice: stepping the LLMEngine in a plain loop, as bench.engine
does, and through an EngineLoop, which steps it on its own thread and, as a replica
does, takes a load snapshot (LLMEngine.stats(with_hashes=False)) every
LOAD_STATS_PERIOD_S and on each step that ends requests, a full one every
stats_period_s, and fans each step's outputs out per caller (the requests come from
--callers callers in turn; each delivery is a no-op here). A step's wall runs from its
engine.step() to the next, so the loop's own work after a step is in it. Printed per
mode: the run's wall, each request's first token from the burst's start (when step()
returns it, or when the loop delivers it), the decode steps' mean, median and p99 wall,
the mean wall of the decode steps that ended requests (where each ended request's blocks
are given back: Scheduler.retired), and that of the decode steps whose wall holds a full
snapshot; each beside the mean wall of the decode steps right after them. A step launches
the next before it waits for its own, so work after a step lengthens its wall and shortens
the next one's wait: only where the pair exceeds two plain steps did the device wait.

Both modes step one engine, built on the main thread, with torch at one CPU thread, as
a Serve replica runs by default (--torch-threads: bench.common.add_burst_args).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import threading
import time

import torch

from bench.common import add_burst_args, burst_engine, machine_description, write_json
from bench.engine import CollectedSteps, random_prompts
from cluster.config import ClusterConfig
from cluster.engine_loop import EngineLoop
from replica import LLMEngine, SamplingParams


class StepClock:
    """Wraps engine.step: each step's start, whether the step it collected ran decode
    rows alone (bench.engine.CollectedSteps), and how many requests it ended; and
    engine.stats: how long each snapshot took, full and load-only apart."""

    def __init__(self, engine: LLMEngine) -> None:
        self.snapshot_ms: dict[bool, list[float]] = {True: [], False: []}  # with_hashes
        self.snapshot_steps: list[int] = []  # the step whose wall holds each full snapshot
        self.starts: list[float] = []
        self.begin = time.perf_counter()  # the run's start: its adds come before its first step
        self.decode_only: list[bool] = []
        self.ended: list[int] = []
        self.prompt_tokens: list[int] = []
        self.collections = [0, 0, 0]  # the collector's passes during the run, by generation
        gc.callbacks.append(self._count_collection)
        step = engine.step
        steps = CollectedSteps(engine)

        def timed_step():
            self.starts.append(time.perf_counter())
            outputs = step()
            collected = steps.after_step()
            self.decode_only.append(collected is not None and not collected[0])
            self.prompt_tokens.append(collected[0] if collected else 0)
            self.ended.append(len(outputs.finishes))
            return outputs

        stats = engine.stats

        def timed_stats(with_hashes: bool = True):
            start = time.perf_counter()
            snapshot = stats(with_hashes)
            self.snapshot_ms[with_hashes].append(1e3 * (time.perf_counter() - start))
            if with_hashes:  # -1: before the first step
                self.snapshot_steps.append(len(self.starts) - 1)
            return snapshot

        engine.step = timed_step
        engine.stats = timed_stats
        self._engine = engine

    def _count_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collections[info["generation"]] += 1

    def close(self, end: float) -> dict:
        """Per-step walls (each step's start to the next's, the last to end), summarized."""
        gc.callbacks.remove(self._count_collection)
        del self._engine.step  # the instance attributes: back to the class's methods
        del self._engine.stats
        bounds = self.starts[1:] + [end]
        walls = [1e3 * (b - a) for a, b in zip(self.starts, bounds, strict=True)]
        decode = [w for w, d in zip(walls, self.decode_only, strict=True) if d]
        ending = [w for w, d, n in zip(walls, self.decode_only, self.ended, strict=True) if d and n]
        snapshot_steps = sorted({i for i in self.snapshot_steps if i >= 0 and self.decode_only[i]})
        snapshot = [walls[i] for i in snapshot_steps]
        # The decode step after each: when the host's slack absorbed the work, that step's
        # wait for the device is shorter by as much, and the pair's sum is two plain steps.
        after = [
            walls[i + 1] for i in snapshot_steps if i + 1 < len(walls) and self.decode_only[i + 1]
        ]
        ending_after = [
            walls[i + 1]
            for i, (d, n) in enumerate(zip(self.decode_only, self.ended, strict=True))
            if d and n and i + 1 < len(walls) and self.decode_only[i + 1]
        ]
        return {
            "steps": len(walls),
            "decode_mean_ms": statistics.fmean(decode),
            "decode_p99_ms": sorted(decode)[int(0.99 * (len(decode) - 1))],
            "ending_steps": len(ending),
            "decode_median_ms": statistics.median(decode),
            "ending_mean_ms": _mean(ending),
            "after_ending_mean_ms": _mean(ending_after),
            "snapshot_steps": len(snapshot),
            "snapshot_step_mean_ms": _mean(snapshot),
            "after_snapshot_mean_ms": _mean(after),
            "prompt_steps": sum(n > 0 for n in self.prompt_tokens),
            "prompt_steps_ms": sum(w for w, n in zip(walls, self.prompt_tokens, strict=True) if n),
            "first_step_at_ms": 1e3 * (self.starts[0] - self.begin) if self.starts else math.nan,
            "full_snapshots_ms": self.snapshot_ms[True],
            "full_snapshot_steps": self.snapshot_steps,
            "collections": self.collections,
            "load_snapshots_ms": self.snapshot_ms[False],
            "per_step": {"wall_ms": walls, "prompt_tokens": self.prompt_tokens,
                         "decode_only": self.decode_only, "ended": self.ended},
        }  # fmt: skip


def _mean(values_ms: list[float]) -> float:
    return statistics.fmean(values_ms) if values_ms else math.nan


def _times(values_ms: list[float]) -> str:
    if not values_ms:
        return "0"
    return f"{len(values_ms)} (mean {statistics.fmean(values_ms):.3f} max {max(values_ms):.3f} ms)"


def first_tokens_ms(first_s: dict[str, float], start: float) -> dict:
    """Each request's first token, from the burst's start (its first add), in ms."""
    ttft = sorted(1e3 * (t - start) for t in first_s.values())
    return {
        "ttft_p50_ms": ttft[len(ttft) // 2],
        "ttft_p99_ms": ttft[int(0.99 * (len(ttft) - 1))],
        "ttft_max_ms": ttft[-1],
    }


def run_bare(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str):
    clock = StepClock(engine)
    first_s: dict[str, float] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished():
        outputs = engine.step()
        if len(first_s) < len(prompts):  # once all have one, no per-row pass in the steps
            now = time.perf_counter()
            for request_id in outputs.request_ids:
                first_s.setdefault(request_id, now)
    end = time.perf_counter()
    return {"wall_ms": 1e3 * (end - start), **first_tokens_ms(first_s, start), **clock.close(end)}


def run_loop(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    tag: str,
    stats_period_s: float,
    num_callers: int = 1,
):
    done, remaining = threading.Event(), [len(prompts)]
    first_s: dict[str, float] = {}

    def deliver(caller_id, batch) -> None:  # on the engine thread
        if len(first_s) < len(prompts):  # as run_bare: no per-row pass once all have one
            now = time.perf_counter()
            for request_id in batch.request_ids:
                first_s.setdefault(request_id, now)
        remaining[0] -= len(batch.finishes)
        if remaining[0] == 0:
            done.set()

    clock = StepClock(engine)
    loop = EngineLoop(lambda: engine, "bench", stats_period_s, deliver)
    try:
        start = time.perf_counter()
        futures = [
            loop.add(f"caller-{i % num_callers}", f"{tag}-{i}", prompt, params)
            for i, prompt in enumerate(prompts)
        ]
        for future in futures:
            future.result(timeout=60)
        if not done.wait(timeout=300):
            raise RuntimeError(f"{remaining[0]} requests did not end within 300 s")
        end = time.perf_counter()
    finally:
        loop.shutdown()
    if loop.failure:
        raise RuntimeError(loop.failure)
    return {"wall_ms": 1e3 * (end - start), **first_tokens_ms(first_s, start), **clock.close(end)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_args(parser)
    parser.add_argument(
        "--max-batched-tokens", type=int, default=None,
        help="EngineConfig.max_num_batched_tokens (default: the engine's)",
    )  # fmt: skip
    parser.add_argument(
        "--callers", type=int, default=1,
        help="callers the requests come from, in turn (a replica fans each step out per caller)",
    )  # fmt: skip
    parser.add_argument(
        "--no-gc", action="store_true", help="diagnostic: Python's cyclic GC off during the runs"
    )
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    extra = {"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}
    engine, model, prompt_len, max_new = burst_engine(args, cpu_max_new=8, **extra)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    stats_period_s = ClusterConfig(model=model).stats_period_s
    run_bare(engine, random_prompts(args.batch, prompt_len, vocab, 99), params, "warm")
    rows = []
    if args.no_gc:
        gc.disable()
    for rep in range(args.reps):
        for mode in ("bare", "engine loop"):
            # Prompts of their own (the same ones would be prefix-cache hits the second time).
            prompts = random_prompts(args.batch, prompt_len, vocab, 2 * rep + (mode != "bare"))
            if mode == "bare":
                result = run_bare(engine, prompts, params, f"b{rep}")
            else:
                result = run_loop(engine, prompts, params, f"l{rep}", stats_period_s, args.callers)
            rows.append({"rep": rep, "mode": mode, **result})
            print(
                f"rep {rep} {mode:>11}: run {result['wall_ms']:.1f} ms, TTFT from the burst's"
                f" start p50 {result['ttft_p50_ms']:.1f} p99 {result['ttft_p99_ms']:.1f} max"
                f" {result['ttft_max_ms']:.1f} ms, decode step mean"
                f" {result['decode_mean_ms']:.3f} median {result['decode_median_ms']:.3f}"
                f" p99 {result['decode_p99_ms']:.3f} ms, the"
                f" {result['ending_steps']} that ended requests {result['ending_mean_ms']:.3f} ms"
                f" (the steps after them {result['after_ending_mean_ms']:.3f}),"
                f" the {result['snapshot_steps']} with a full snapshot"
                f" {result['snapshot_step_mean_ms']:.3f} ms"
                f" (the steps after them {result['after_snapshot_mean_ms']:.3f});"
                f" {result['prompt_steps']} steps with prompt tokens"
                f" {result['prompt_steps_ms']:.1f} ms, the first step at"
                f" {result['first_step_at_ms']:.1f} ms;"
                f" snapshots: {_times(result['full_snapshots_ms'])} full,"
                f" {_times(result['load_snapshots_ms'])} load-only; full ones (step: ms) "
                + " ".join(
                    f"{i}: {ms:.3f}"
                    for i, ms in zip(result["full_snapshot_steps"], result["full_snapshots_ms"])
                )
                + f"; gc passes by generation {result['collections']}",
                flush=True,
            )
    write_json(
        args.out,
        {"machine": machine_description(), "model": model, "batch": args.batch, "no_gc": args.no_gc,
         "torch_threads": torch.get_num_threads(),
         "prompt_len": prompt_len, "max_new": max_new, "callers": args.callers, "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
