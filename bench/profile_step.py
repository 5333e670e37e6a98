"""Where one decode step's time goes: host phases, graph replay, sampling, and the kernels.

    python -m bench.profile_step --model gpt2 --dtype float16 --batch 256

Prints (1) a per-phase breakdown of the engine step at a steady decode batch,
timed with host clocks and CUDA events, and (2) the kernels of one eager
decode forward from torch.profiler: how many launches and which cost most.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kernels.pdl
import replica.models.gpt2
import replica.models.llama
from bench import step_timeline
from bench.common import percentile, profiled_steps
from bench.engine import random_prompts
from replica import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cprofile", action="store_true", help="profile the host side too")
    parser.add_argument("--no-triton-linear", action="store_true", help="cuBLAS projections")
    parser.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch")
    parser.add_argument(
        "--no-fold-norms",
        action="store_true",
        help="norm + residual add kernels, not folded into the projections",
    )
    parser.add_argument(
        "--timeline-steps", type=int, default=20, help="engine steps traced for GPU idle time"
    )
    args = parser.parse_args()

    kernels.pdl.ENABLE_PDL = not args.no_pdl
    replica.models.gpt2.FOLD_NORMS = not args.no_fold_norms
    replica.models.llama.FOLD_NORMS = not args.no_fold_norms
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
                     max_model_len=min(2048, 1024 if args.model.startswith("gpt2") else 2048),
                     enable_triton_linear=not args.no_triton_linear)
    )  # fmt: skip
    vocab = engine.model_config.vocab_size
    num_steps = args.steps * (2 if args.cprofile else 1) + 2 * args.timeline_steps
    params = SamplingParams(max_tokens=num_steps + 20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch, args.prompt_len, vocab, 0)):
        engine.add_request(f"p{i}", prompt, params)
    prefill_walls = []
    prefill_prof = None
    host_prof = cProfile.Profile() if args.cprofile else None
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        t0 = time.perf_counter()
        if len(prefill_walls) == 2:  # one steady prefill step, kernels and host ops
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prefill_prof:
                engine.step()
                torch.cuda.synchronize()
        elif host_prof is not None and len(prefill_walls) > 2:
            host_prof.runcall(engine.step)
        else:
            engine.step()
        prefill_walls.append(1e3 * (time.perf_counter() - t0))
    engine.step()
    num_prompt_tokens = args.batch * args.prompt_len
    print(
        f"\nprefill of {args.batch} x {args.prompt_len} tokens: {len(prefill_walls)} steps, "
        f"{sum(prefill_walls):.1f} ms, per step ms: "
        + " ".join(f"{w:.2f}" for w in prefill_walls)
        + f" ({num_prompt_tokens / sum(prefill_walls):.0f} prompt tokens/ms)"
    )
    if prefill_prof is not None:
        print_profile("prefill step (profiled, synchronized)", prefill_prof, args.top)
    if host_prof is not None and len(prefill_walls) > 3:  # some step ran under host_prof
        print("\nhost side of the prefill steps after the profiled one (cProfile, tottime):")
        pstats.Stats(host_prof).sort_stats("tottime").print_stats(args.top)

    phases: dict[str, list[float]] = {"schedule": [], "launch": [], "wait": [], "drain": []}
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(1e3 * (time.perf_counter() - t0))
        t = engine.last_step
        for name, dt in zip(phases, (t.schedule_s, t.launch_s, t.wait_s, t.drain_s), strict=True):
            phases[name].append(1e3 * dt)
    print(f"\nsteady decode at batch {args.batch}, {args.model} {engine.dtype}, ms per step (p50):")
    print(f"  {'step wall':12s} {percentile(walls, 50):.3f}")
    for name, values in phases.items():
        print(f"  {name:12s} {percentile(values, 50):.3f}")

    if args.cprofile:
        stats = profiled_steps(engine, args.steps)
        print(f"\nhost side over {args.steps} steps (cProfile, tottime):")
        stats.sort_stats("tottime").print_stats(args.top)

    if args.timeline_steps:
        print_step_events(engine, args.timeline_steps)
        print_timeline(engine, args.timeline_steps, args.top)

    runner = engine.runner
    if runner.use_cuda_graphs:
        graph, _ = runner.graphs[runner.graph_sizes[-1]]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        replay_ms = start.elapsed_time(end) / 20
        print(f"  graph replay at {runner.graph_sizes[-1]} rows: {replay_ms:.3f} ms (GPU)")

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_forward_eager(args.batch)
        torch.cuda.synchronize()
    print_profile("eager decode forward", prof, args.top)


def print_step_events(engine: LLMEngine, num_steps: int) -> None:
    """CUDA events around each step's device work (runner.launch): per step, the device
    time from its first enqueued op to its last, and the device idle before it."""
    runner = engine.runner
    launch, graphs = runner.launch, dict(runner.graphs)
    marks: list[list[torch.cuda.Event]] = []  # per step: launch start, graph, graph end, end

    def mark() -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks[-1].append(event)

    class TimedGraph:
        def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
            self.graph = graph

        def replay(self) -> None:
            mark()
            self.graph.replay()
            mark()

    def timed_launch(*a, **kw):
        marks.append([])
        mark()
        handle = launch(*a, **kw)
        mark()
        return handle

    runner.launch = timed_launch
    runner.graphs = {size: (TimedGraph(g), out) for size, (g, out) in graphs.items()}
    try:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    finally:
        runner.launch, runner.graphs = launch, graphs
    marks = [m for m in marks if len(m) == 4]  # decode steps that replayed a graph
    if len(marks) < 2:
        print("\nstep events: fewer than two decode steps replayed a graph")
        return
    parts = {
        name: [m[i].elapsed_time(m[i + 1]) for m in marks]
        for i, name in enumerate(("before graph", "graph", "after graph"))
    }
    idle = [marks[i - 1][3].elapsed_time(marks[i][0]) for i in range(1, len(marks))]
    print(
        f"\ndevice time per step from CUDA events ({len(marks)} steps, ms, p50 / max): "
        + "; ".join(f"{n} {percentile(v, 50):.3f} / {max(v):.3f}" for n, v in parts.items())
        + f"; idle between steps {percentile(idle, 50):.3f} / {max(idle):.3f}"
    )


def print_timeline(engine: LLMEngine, num_steps: int, top: int) -> None:
    """Trace num_steps engine steps as they run (graphs, overlap and all) with
    bench.step_timeline's analysis: per step the device's kernel, copy and idle time,
    the boundaries that idle it, and each kernel's time, so that work outside the graphs
    and host stalls show."""
    torch.cuda.synchronize()
    steps = step_timeline.traced_steps(engine, num_steps)
    if not steps:
        print("\ntimeline: fewer than two steps copied tokens to the host under the profiler")
        return
    summary = step_timeline.summarize(steps)
    print(f"\ntimeline of {num_steps} engine steps:")
    print(step_timeline.format_summary(len(engine.scheduler.running), summary, top))


def print_profile(title: str, prof: profile, top: int) -> None:
    """Kernel count and GPU time, the costliest kernels, and the costliest host ops."""
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type.name == "CUDA"]
    launches = sum(e.count for e in events)
    total_us = sum(e.device_time_total for e in events)
    print(f"\n{title}: {launches} kernel launches, {total_us / 1e3:.3f} ms GPU time")
    events.sort(key=lambda e: -e.device_time_total)
    for e in events[:top]:
        print(f"  {e.count:5d} x {e.device_time_total / e.count:8.1f} us  {e.key[:90]}")
    host = [e for e in averages if e.device_type.name == "CPU" and e.self_cpu_time_total > 0]
    if host:
        host.sort(key=lambda e: -e.self_cpu_time_total)
        print(f"  host ops by self CPU time (top {min(top, 15)}):")
        for e in host[: min(top, 15)]:
            print(f"  {e.count:5d} x {e.self_cpu_time_total / e.count:8.1f} us  {e.key[:90]}")


if __name__ == "__main__":
    main()
