"""One engine run for the benchmarks: seeded random prompts, how requests sample, and
run_engine, which runs prompts to completion and records each step's wall, host phases
and (on CUDA) device span. bench.engine and bench.itl both build on it."""

from __future__ import annotations

import collections
import math
import random
import time
from dataclasses import dataclass, field

import torch

from replica import LLMEngine, SamplingParams
from replica.runner.model_runner import ModelRunner


@dataclass
class EngineRun:
    num_seqs: int
    output_tokens: int = 0
    wall_s: float = 0.0
    decode_tokens: int = 0
    # Per step() that collects pure-decode steps (run_engine): (wall, schedule, launch, wait,
    # drain) seconds, and whether some block-table row changed in them (a block rollover,
    # in these runs).
    decode_phases_s: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    decode_boundary: list[bool] = field(default_factory=list)
    decode_batch: list[int] = field(default_factory=list)  # sequences in the collected step
    decode_finished: list[int] = field(default_factory=list)  # requests its outputs finished
    add_s: float = 0.0  # add_request for every prompt
    # The other step() calls (collecting a step with a prompt chunk in it, or none): wall,
    # the four phases, the prompt tokens of the steps collected.
    other_steps: list[tuple[float, float, float, float, float, int]] = field(default_factory=list)
    # With StepEvents, per call in the order of decode_phases_s / other_steps: the device
    # span of the step it collects and the device's idle time before it, ms (NaN for a
    # call that collects nothing).
    decode_device_ms: list[tuple[float, float]] = field(default_factory=list)
    other_device_ms: list[tuple[float, float]] = field(default_factory=list)

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
    """How the benchmark's requests sample (greedy by default); seeded: request i has seed i."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seeded: bool = False

    def params(self, i: int, max_new: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_new, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=i if self.seeded else None, ignore_eos=True,
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


class StepEvents:
    """CUDA events around each model-runner launch, for each step's device time.

    A step's span runs from the stream reaching its first op to its last. Where the
    device sat idle before the step, the span also holds the wait for the host to
    enqueue the rest of it (its inputs' staging, its graphs); the idle time before it
    is the gap from the previous step's last op. close() puts the runner back."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        launch = runner.launch

        def timed_launch(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            handle = launch(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((start, end))
            return handle

        runner.launch = timed_launch  # an instance attribute over the method

    def close(self) -> None:
        del self.runner.launch

    def spans_ms(self) -> list[tuple[float, float]]:
        """(span, idle before) per launch, ms, in launch order."""
        torch.cuda.synchronize()
        out, previous_end = [], None
        for start, end in self.pairs:
            idle = previous_end.elapsed_time(start) if previous_end is not None else 0.0
            out.append((start.elapsed_time(end), idle))
            previous_end = end
        return out


class CollectedSteps:
    """Which launched step each step() collects: LLMEngine keeps one in flight, and a
    call's wall is mostly its wait for the step it collects. after_step() returns that
    step as (prompt tokens, decode sequences, block-table rows changed, tag), or None
    (the first call collects nothing)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pending: collections.deque[tuple[int, int, bool, object]] = collections.deque()

    def after_step(self, tag: object = None) -> tuple[int, int, bool, object] | None:
        """Call after each step(); tag marks the step it launched, if any."""
        t = self.engine.last_step
        if t.num_prefill_tokens or t.num_decode_seqs:  # it launched a step
            self.pending.append(
                (t.num_prefill_tokens, t.num_decode_seqs, t.num_table_rows > 0, tag)
            )
        if len(self.pending) > (self.engine.in_flight is not None):
            return self.pending.popleft()
        return None


def run_engine(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_new: int,
    sampling: Sampling = GREEDY,
    step_events: bool = False,
    host_delay_s: float = 0.0,
) -> EngineRun:
    """Run prompts to completion; record the wall and host-side time of each step() that
    collects pure-decode steps, and with step_events (CUDA) each step's device time
    (StepEvents).

    A step() waits for the step it collects, launched by the call before (LLMEngine.step),
    so its wall is that step's device time when the device sets the pace: a call counts
    as a decode step by the step it collects, not by the one it launches (the call that
    launches the first decode step waits for the last prompt step).

    host_delay_s: a busy wait after each step(), the host work a slower host's Python
    would add (what the engine's overlap has to absorb)."""
    run = EngineRun(len(prompts))
    events = StepEvents(engine.runner) if step_events else None
    launches: list[tuple[list, int | None]] = []  # per call: its list, its step's launch index
    steps = CollectedSteps(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, sampling.params(i, max_new))
    last = time.perf_counter()
    run.add_s = last - start
    while engine.has_unfinished():
        num_launches = len(events.pairs) if events else 0
        outputs = engine.step()
        if host_delay_s:
            until = time.perf_counter() + host_delay_s
            while time.perf_counter() < until:
                pass
        now = time.perf_counter()
        run.output_tokens += len(outputs.token_ids)  # StepOutputs: one token a row
        t = engine.last_step
        collected = steps.after_step(num_launches if events else None)  # its launch index
        phases = (t.schedule_s, t.launch_s, t.wait_s, t.drain_s)
        if collected and not collected[0]:  # a decode step: no prompt tokens
            run.decode_tokens += collected[1]
            run.decode_phases_s.append((now - last, *phases))
            run.decode_boundary.append(collected[2])
            run.decode_batch.append(collected[1])
            run.decode_finished.append(len(outputs.finishes))
            device_list = run.decode_device_ms
        else:
            run.other_steps.append((now - last, *phases, collected[0] if collected else 0))
            device_list = run.other_device_ms
        if events:
            launches.append((device_list, collected[3] if collected else None))
        last = now
    run.wall_s = time.perf_counter() - start
    if events:
        events.close()
        spans = events.spans_ms()
        for device_list, index in launches:
            device_list.append(spans[index] if index is not None else (math.nan, math.nan))
    engine.check_invariants()
    return run
