"""Inter-token latency of bench.engine, in the steady state of serving.

batch requests are always in flight. Each lives `steps` tokens; the first wave's
lengths are spread (1/batch, 2/batch, ... of that), and a request that finishes is
replaced by a new one, whose 16-token prefill joins the next step. After one lifetime
of warm-up the requests' ages are spread evenly, the batch's total context is
stationary, and rollovers, prefills and host pauses are what moves a step. Every step
of the `steps` measured counts: each gives one token to every request in flight.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.common import percentile
from replica import LLMEngine, SamplingParams

PROMPT_LEN = 16


def max_lifetime(engine: LLMEngine) -> int:
    """The most decode steps one request can live: GPT-2's 1024 positions hold 16 + 1007."""
    return engine.max_model_len - PROMPT_LEN - 1


def steady_itl(engine: LLMEngine, batch: int, steps: int, vocab: int) -> dict:
    """Per-step latency with batch requests always in flight (see the module docstring);
    each request lives min(steps, max_lifetime) tokens, and `steps` steps are measured."""
    lifetime = min(steps, max_lifetime(engine))
    rng = random.Random(11)
    num_added = 0

    def add(max_tokens: int) -> None:
        nonlocal num_added
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"itl-{num_added}", prompt, params)
        num_added += 1

    for i in range(batch):
        add(max(1, lifetime * (i + 1) // batch))
    walls, sizes, num_steps = [], [], 0
    last = time.perf_counter()
    while len(walls) < steps:
        outputs = engine.step()
        now = time.perf_counter()
        if num_steps >= lifetime:  # one lifetime of warm-up
            walls.append(now - last)
            sizes.append(engine.last_step.num_decode_seqs)
        last = now
        num_steps += 1
        for _ in outputs.finishes:
            add(lifetime)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()  # collects the step still in flight
    engine.check_invariants()
    return _summary(walls) | {
        "mean_batch": statistics.mean(sizes), "num_requests": num_added,
        "mean_ms": 1e3 * statistics.mean(walls), "lifetime": lifetime,
    }  # fmt: skip


def _summary(walls: list[float]) -> dict:
    p50, p99 = percentile(walls, 50), percentile(walls, 99)
    return {
        "steps": len(walls), "p50_ms": 1e3 * p50, "p90_ms": 1e3 * percentile(walls, 90),
        "p99_ms": 1e3 * p99, "max_ms": 1e3 * max(walls), "p99_over_p50": p99 / p50,
    }  # fmt: skip


def format_itl(batch: int, steady: dict) -> str:
    return (
        f"ITL at batch {batch}, steady state over {steady['steps']} steps (mean batch"
        f" {steady['mean_batch']:.1f}, {steady['num_requests']} requests of"
        f" {PROMPT_LEN} + {steady['lifetime']} tokens): p50"
        f" {steady['p50_ms']:.3f} ms, p90 {steady['p90_ms']:.3f}, p99 {steady['p99_ms']:.3f},"
        f" p99/p50 {steady['p99_over_p50']:.2f}, max {steady['max_ms']:.3f}"
    )
