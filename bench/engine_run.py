"""bench.engine's runs of the engine: run_engine runs seeded random prompts to completion
and records each step's wall and host phases; steady_itl measures inter-token latency in
the steady state of serving.

steady_itl: batch requests are always in flight. Each lives `steps` tokens; the first
wave's lengths are spread (1/batch, 2/batch, ... of that), and a request that finishes is
replaced by a new one, whose 16-token prefill joins the next step. After one lifetime of
warm-up the requests' ages are spread evenly, the batch's total context is stationary, and
rollovers, prefills and host pauses are what moves a step. Every step of the `steps`
measured counts: each gives one token to every request in flight.
"""

from __future__ import annotations

import collections
import random
import statistics
import time
from dataclasses import dataclass, field

from bench.common import summary_ms
from replica import LLMEngine, SamplingParams


@dataclass
class EngineRun:
    num_seqs: int
    output_tokens: int = 0
    wall_s: float = 0.0
    decode_tokens: int = 0
    # Per step() that collects a pure-decode step (run_engine): (wall, schedule, launch,
    # wait, drain) seconds.
    decode_phases_s: list[tuple[float, float, float, float, float]] = field(default_factory=list)

    @property
    def decode_step_s(self) -> list[float]:
        return [p[0] for p in self.decode_phases_s]

    @property
    def decode_host_s(self) -> list[float]:  # scheduler + block manager + drain
        return [p[1] + p[4] for p in self.decode_phases_s]

    @property
    def decode_launch_s(self) -> list[float]:  # runner: inputs + launches
        return [p[2] for p in self.decode_phases_s]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / sum(self.decode_step_s)


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


@dataclass(frozen=True)
class Sampling:
    """How the benchmark's requests sample (greedy by default); seeded: request i has seed i.
    extras_fraction: that fraction of the requests, spread evenly, also ask logprobs=5
    and presence 0.5, frequency 0.5, repetition 1.1 penalties (the engine's extras path)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seeded: bool = False
    extras_fraction: float = 0.0

    def params(self, i: int, max_new: int) -> SamplingParams:
        extras = int((i + 1) * self.extras_fraction) > int(i * self.extras_fraction)
        return SamplingParams(
            max_tokens=max_new, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=i if self.seeded else None, ignore_eos=True,
            **(EXTRAS if extras else {}),
        )  # fmt: skip

    def hf_kwargs(self) -> dict:
        """transformers generate's arguments for the same sampling."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p}  # fmt: skip

    def __str__(self) -> str:
        if self.temperature == 0:
            return "greedy"
        seeded = " seeded" if self.seeded else ""
        return f"T={self.temperature} top_k={self.top_k} top_p={self.top_p}{seeded}"


GREEDY = Sampling()
EXTRAS = dict(logprobs=5, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


class CollectedSteps:
    """Which launched step each step() collects: LLMEngine keeps one in flight, and a
    call's wall is mostly its wait for the step it collects. after_step() returns that
    step as (prompt tokens, decode sequences), or None (the first call collects nothing)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pending: collections.deque[tuple[int, int]] = collections.deque()

    def after_step(self) -> tuple[int, int] | None:
        """Call after each step()."""
        t = self.engine.last_step
        if t.num_prefill_tokens or t.num_decode_seqs:  # it launched a step
            self.pending.append((t.num_prefill_tokens, t.num_decode_seqs))
        if len(self.pending) > (self.engine.in_flight is not None):
            return self.pending.popleft()
        return None


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_new: int, sampling: Sampling = GREEDY
) -> EngineRun:
    """Run prompts to completion; record the wall and host-side time of each step().

    A step() waits for the step it collects, launched by the call before (LLMEngine.step),
    so its wall is that step's device time when the device sets the pace: a call counts
    as a decode step by the step it collects, not by the one it launches (the call that
    launches the first decode step waits for the last prompt step)."""
    run = EngineRun(len(prompts))
    steps = CollectedSteps(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, sampling.params(i, max_new))
    last = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        run.output_tokens += len(outputs.token_ids)  # StepOutputs: one token a row
        t = engine.last_step
        phases = (now - last, t.schedule_s, t.launch_s, t.wait_s, t.drain_s)
        collected = steps.after_step()
        if collected and not collected[0]:  # a decode step: no prompt tokens
            run.decode_tokens += collected[1]
            run.decode_phases_s.append(phases)
        last = now
    run.wall_s = time.perf_counter() - start
    engine.check_invariants()
    return run


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
    ms = {f"{k}_ms": v for k, v in summary_ms(walls).items()}
    return ms | {
        "steps": len(walls), "max_ms": 1e3 * max(walls), "lifetime": lifetime,
        "p99_over_p50": ms["p99_ms"] / ms["p50_ms"], "mean_batch": statistics.mean(sizes),
        "num_requests": num_added,
    }  # fmt: skip


def format_itl(batch: int, steady: dict) -> str:
    return (
        f"ITL at batch {batch}, steady state over {steady['steps']} steps (mean batch"
        f" {steady['mean_batch']:.1f}, {steady['num_requests']} requests of"
        f" {PROMPT_LEN} + {steady['lifetime']} tokens): p50"
        f" {steady['p50_ms']:.3f} ms, p90 {steady['p90_ms']:.3f}, p99 {steady['p99_ms']:.3f},"
        f" p99/p50 {steady['p99_over_p50']:.2f}, max {steady['max_ms']:.3f}"
    )
