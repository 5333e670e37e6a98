"""Host time of each piece of an engine step, with the device's work left in.

    python -m bench.step_pieces --model gpt2 --dtype float16 --batch 1 256

Wraps the engine's methods with perf_counter: the scheduler's schedule, the runner's
launch and its parts (staging the inputs, their copy, the decode forward: the graph
replay call on CUDA, the tokens' copy to the host), the engine's
launch and drain. Prints each one's median over --steps decode steps per batch: where
a step's host time goes on the machine that runs it. On CUDA it also times a bare graph
replay call and an event's creation and record. On the CPU (gpt2-tiny) the decode
forward runs eagerly inside the launch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.common import machine_description, write_json
from bench.engine import random_prompts
from replica import EngineConfig, LLMEngine, SamplingParams

_PIECES = (  # (what to wrap, the method's name, the name printed)
    ("scheduler", "schedule", "schedule"),
    ("step_inputs", "fill", "fill"),
    ("step_inputs", "upload", "upload"),
    ("runner", "_run_decode", "decode"),  # on CUDA: the graph replay call
    ("runner", "_tokens_to_host", "tokens to host"),
    ("runner", "launch", "runner.launch"),
    ("engine", "launch", "engine.launch"),
    ("engine", "drain", "drain"),
)


def wrap_pieces(engine: LLMEngine, times: dict[str, list[float]]) -> None:
    """Each piece's calls append their host seconds to times[name]."""
    owners = {
        "engine": engine,
        "scheduler": engine.scheduler,
        "runner": engine.runner,
        "step_inputs": engine.runner.step_inputs,
    }
    for owner, method, name in _PIECES:
        obj = owners[owner]
        setattr(obj, method, _timed(getattr(obj, method), times.setdefault(name, [])))


def _timed(fn: Callable, out: list[float]) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        out.append(time.perf_counter() - start)
        return result

    return timed


def _median_us(fn: Callable[[], object], repeats: int = 50, sync: bool = False) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        if sync:
            torch.cuda.synchronize()
    return 1e6 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: gpt2 on CUDA, gpt2-tiny on CPU")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per batch")
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    model = args.model or ("gpt2" if on_gpu else "gpt2-tiny")
    engine = LLMEngine(
        EngineConfig(
            model=model, device="cuda" if on_gpu else "cpu",
            dtype=args.dtype or ("float16" if on_gpu else "float32"),
            max_num_seqs=max(args.batch), max_model_len=512,
        )
    )  # fmt: skip
    warm = 10
    if 16 + warm + args.steps >= 512:
        raise SystemExit(f"--steps: {args.steps} steps exceed the 512 positions of these runs")
    times: dict[str, list[float]] = {}
    wrap_pieces(engine, times)
    rows = []
    for batch in args.batch:
        params = SamplingParams(max_tokens=warm + args.steps, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(batch, 16, engine.model_config.vocab_size, batch)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"pieces-{batch}-{i}", prompt, params)
        for _ in range(warm):  # the prefill, and decode steps whose graphs are warm
            engine.step()
        for samples in times.values():
            samples.clear()
        for _ in range(args.steps):
            engine.step()
        row = {"batch": batch} | {k: 1e6 * statistics.median(v) for k, v in times.items() if v}
        if on_gpu:
            graph, _ = engine.runner.graphs[engine.runner._padded_rows(batch, False)]
            torch.cuda.synchronize()
            row["bare replay"] = _median_us(graph.replay, sync=True)
            row["event + record"] = _median_us(lambda: torch.cuda.Event().record())
        rows.append(row)
        print(f"batch {batch}, host us (medians): " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k != "batch"
        ))  # fmt: skip
        while engine.has_unfinished():
            engine.step()
    write_json(args.out, {"machine": machine_description(), "model": model, "rows": rows})


if __name__ == "__main__":
    main()
