"""Inter-token latency runs of bench.engine: a lockstep cohort, and a steady state.

cohort: batch sequences start together with 16-token prompts and decode `steps`
tokens each. Their context grows from 16 to 16 + steps, so the attention part of a
step grows with it and p99/p50 over the run measures that growth as much as any
spike; steps are also compared with their own neighbourhood, and block rollovers
(all sequences at once) are reported apart.

steady: batch requests are always in flight, as in serving. Each lives `steps`
tokens; the first wave's lengths are spread (1/batch, 2/batch, ... of that), and a
request that finishes is replaced by a new one, whose 16-token prefill joins the
next step. After one lifetime of warm-up the requests' ages are spread evenly, the
batch's total context is stationary, and rollovers, prefills and host pauses are
what moves a step. Every step of the `steps` measured counts: each gives one token
to every request in flight.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.common import percentile
from bench.engine_run import random_prompts, run_engine
from replica import LLMEngine, SamplingParams

PROMPT_LEN = 16


def max_lifetime(engine: LLMEngine) -> int:
    """The most decode steps one request can live: GPT-2's 1024 positions hold 16 + 1007."""
    return engine.max_model_len - PROMPT_LEN - 1


def cohort_itl(engine: LLMEngine, batch: int, steps: int, block_size: int, vocab: int) -> dict:
    """Per-step latency over a long lockstep decode (see the module docstring); at most
    max_lifetime steps."""
    steps = min(steps, max_lifetime(engine))
    run = run_engine(engine, random_prompts(batch, PROMPT_LEN, vocab, 7), steps + 1)
    walls = run.decode_step_s
    # Decode step j writes position PROMPT_LEN + j: a new block when that is a multiple.
    boundary = [t for j, t in enumerate(walls) if (PROMPT_LEN + j) % block_size == 0]
    inner = [t for j, t in enumerate(walls) if (PROMPT_LEN + j) % block_size != 0]
    local = [t / statistics.median(walls[max(0, j - 16) : j + 17]) for j, t in enumerate(walls)]
    return _summary(walls) | {
        "boundary_p50_ms": 1e3 * percentile(boundary, 50),
        "inner_p50_ms": 1e3 * percentile(inner, 50),
        "first_50_p50_ms": 1e3 * percentile(walls[:50], 50),
        "last_50_p50_ms": 1e3 * percentile(walls[-50:], 50),
        "local_p99_ratio": percentile(local, 99), "local_max_ratio": max(local),
    }  # fmt: skip


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


def format_itl(batch: int, cohort: dict, steady: dict) -> str:
    return (
        f"ITL at batch {batch}, steady state over {steady['steps']} steps (mean batch"
        f" {steady['mean_batch']:.1f}, {steady['num_requests']} requests of"
        f" {PROMPT_LEN} + {steady['lifetime']} tokens): p50"
        f" {steady['p50_ms']:.3f} ms, p90 {steady['p90_ms']:.3f}, p99 {steady['p99_ms']:.3f},"
        f" p99/p50 {steady['p99_over_p50']:.2f}, max {steady['max_ms']:.3f}\n"
        f"ITL at batch {batch}, lockstep cohort over {cohort['steps']} decode steps (context"
        f" {PROMPT_LEN} -> {PROMPT_LEN + cohort['steps']}): p50 {cohort['p50_ms']:.3f} ms, p99"
        f" {cohort['p99_ms']:.3f}, p99/p50 {cohort['p99_over_p50']:.2f}, max"
        f" {cohort['max_ms']:.3f}; p50 at block rollovers {cohort['boundary_p50_ms']:.3f},"
        f" elsewhere {cohort['inner_p50_ms']:.3f}; first 50 steps p50"
        f" {cohort['first_50_p50_ms']:.3f}, last 50 {cohort['last_50_p50_ms']:.3f}; step /"
        f" median of its 33-step neighbourhood: p99 {cohort['local_p99_ratio']:.2f}, max"
        f" {cohort['local_max_ratio']:.2f}"
    )
