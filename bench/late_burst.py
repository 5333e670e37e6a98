"""A burst that arrives while other requests decode: how long the running ones wait for
their next token while it is added, on the bare engine and through an EngineLoop.

    python -m bench.late_burst --model gpt2 --dtype float16 --batch 256 --reps 3

Each rep runs both modes. A first burst of --batch prompts (--prompt-len tokens, greedy,
ignore_eos, --max-new new tokens) is added and decodes; once its requests have had --at
tokens, a second burst of --batch prompts arrives. max_num_seqs is --batch, so the
second burst waits in the queue: what the running requests feel is its adds, not its
prefill. Bare: the second burst's add_requests run between two steps, as a loop that
drains its inputs before stepping would. Engine loop: the burst is posted to an
EngineLoop (cluster.engine_loop) from another thread, as a Serve replica's event loop
posts its requests. Printed per mode: the first burst's gaps between tokens (the times
its tokens reach the caller: when step() returns them, or when the loop delivers them)
before the second burst, their median; from the second burst's first add until the
first burst ends, the longest; and how long the second burst took to add.

Both modes step one engine, built on the main thread, with torch at one CPU thread, as
a Serve replica runs by default (--torch-threads: bench.common.add_burst_args).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from bench.common import add_burst_args, burst_engine, machine_description, write_json
from bench.engine import random_prompts
from cluster.config import ClusterConfig
from cluster.engine_loop import EngineLoop
from replica import SamplingParams


class Gaps:
    """When the first burst's tokens arrive, and the second burst's arrival."""

    def __init__(self, first_ids: set[str]) -> None:
        self.first_ids = first_ids
        self.times: list[float] = []  # each step's delivery holding first-burst tokens
        self.burst_at: float | None = None
        self.burst_added_ms = 0.0

    def saw(self, request_ids, now: float) -> None:
        if not self.first_ids.isdisjoint(request_ids):
            self.times.append(now)

    def summary(self) -> dict:
        gaps = [(b, 1e3 * (b - a)) for a, b in zip(self.times, self.times[1:])]
        before = [g for t, g in gaps if t <= self.burst_at]
        after = [g for t, g in gaps if t > self.burst_at]
        return {
            "gap_median_before_ms": statistics.median(before),
            "gap_max_before_ms": max(before),
            "gap_max_after_ms": max(after),
            "burst_added_ms": self.burst_added_ms,
            "num_gaps_after": len(after),
        }


def run_bare(engine, first, second, params, at: int, tag: str) -> dict:
    gaps = Gaps({f"{tag}-a{i}" for i in range(len(first))})
    for i, prompt in enumerate(first):
        engine.add_request(f"{tag}-a{i}", prompt, params)
    while engine.has_unfinished():
        if gaps.burst_at is None and len(gaps.times) >= at:
            gaps.burst_at = time.perf_counter()
            for i, prompt in enumerate(second):
                engine.add_request(f"{tag}-b{i}", prompt, params)
            gaps.burst_added_ms = 1e3 * (time.perf_counter() - gaps.burst_at)
        request_ids = engine.step().request_ids
        gaps.saw(request_ids, time.perf_counter())
    return gaps.summary()


def run_loop(engine, first, second, params, at: int, tag: str, stats_period_s: float) -> dict:
    gaps = Gaps({f"{tag}-a{i}" for i in range(len(first))})
    num_requests = len(first) + len(second)
    ended, due, finishes = threading.Event(), threading.Event(), [0]

    def deliver(caller_id, batch) -> None:  # on the engine thread
        gaps.saw(batch.request_ids, time.perf_counter())
        if len(gaps.times) >= at:
            due.set()
        finishes[0] += len(batch.finishes)
        if finishes[0] == num_requests:
            ended.set()

    loop = EngineLoop(lambda: engine, "bench", stats_period_s, deliver)
    try:
        futures = [loop.add("c0", f"{tag}-a{i}", p, params) for i, p in enumerate(first)]
        if not due.wait(timeout=120):
            raise RuntimeError(f"the first burst had no {at} tokens within 120 s")
        gaps.burst_at = time.perf_counter()
        later = [loop.add("c0", f"{tag}-b{i}", p, params) for i, p in enumerate(second)]
        for future in later:
            future.result(timeout=60)
        gaps.burst_added_ms = 1e3 * (time.perf_counter() - gaps.burst_at)
        for future in futures:
            future.result(timeout=60)
        if not ended.wait(timeout=300):
            raise RuntimeError("the requests did not end within 300 s")
    finally:
        loop.shutdown()
    if loop.failure:
        raise RuntimeError(loop.failure)
    return gaps.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_args(parser)
    parser.add_argument("--at", type=int, default=None, help="the first burst's tokens before")
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    engine, model, prompt_len, max_new = burst_engine(args, cpu_max_new=12)
    at = args.at or max_new // 2
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    stats_period_s = ClusterConfig(model=model).stats_period_s
    warm = random_prompts(args.batch, prompt_len, vocab, 99)
    run_bare(engine, warm, warm[: args.batch // 2], params, at, "warm")
    rows = []
    for rep in range(args.reps):
        for mode in ("bare", "engine loop"):
            seed = 4 * rep + 2 * (mode != "bare")  # prompts of their own: no prefix hits
            first = random_prompts(args.batch, prompt_len, vocab, seed)
            second = random_prompts(args.batch, prompt_len, vocab, seed + 1)
            tag = f"{mode[0]}{rep}"
            if mode == "bare":
                result = run_bare(engine, first, second, params, at, tag)
            else:
                result = run_loop(engine, first, second, params, at, tag, stats_period_s)
            rows.append({"rep": rep, "mode": mode, **result})
            print(
                f"rep {rep} {mode:>11}: the first burst's gaps between tokens before the"
                f" second: median {result['gap_median_before_ms']:.3f} max"
                f" {result['gap_max_before_ms']:.3f} ms; after its first add: longest"
                f" {result['gap_max_after_ms']:.3f} ms; the second burst added in"
                f" {result['burst_added_ms']:.1f} ms",
                flush=True,
            )
    write_json(
        args.out,
        {"machine": machine_description(), "model": model, "batch": args.batch,
         "prompt_len": prompt_len, "max_new": max_new, "at": at,
         "torch_threads": args.torch_threads, "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
