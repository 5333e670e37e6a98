"""The engine's host work per decode step, with the device's part taken out.

    python -m bench.host_step --batch 256 --reps 5 --steps 80

A gpt2-tiny engine on the CPU runs --batch greedy sequences in lockstep; after their
prefill, the decode forward is replaced by a precomputed result (zero logits and
tokens), so a step's wall is what the host does for it: scheduling, staging the
inputs, the bookkeeping of the launch, and turning the previous step's tokens into
outputs (LLMEngine.step's phases). On a GPU the host must do this in less than the
device's step, or the device waits: at 256 rows of gpt2 on an H200 that is ~0.95 ms.
Each rep prints the median step and the mean of each phase over --steps steps; the
best rep is the least disturbed by other work on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine_description, profiled_steps, write_json
from bench.engine import random_prompts
from replica import EngineConfig, LLMEngine, SamplingParams

PHASES = ("schedule", "launch", "wait", "drain")


def stub_decode(engine: LLMEngine) -> None:
    """Every decode forward from now on returns zero logits and tokens at once."""
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    vocab = engine.runner.vocab_size

    def decode(padded: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if padded not in results:
            results[padded] = (torch.zeros(padded, vocab), torch.zeros(padded, dtype=torch.long))
        return results[padded]

    engine.runner._run_decode = decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80, help="decode steps per rep")
    parser.add_argument(
        "--count-calls", action="store_true",
        help="after the reps, Python function calls per step over --steps more steps (cProfile)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    max_len = 512  # gpt2-tiny's positions
    engine = LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", max_num_seqs=args.batch, max_model_len=max_len,
            enable_cuda_graphs=False,
        )
    )  # fmt: skip
    prompt_len = 16
    total = 3 + (args.reps + args.count_calls) * args.steps
    if prompt_len + total > max_len:
        raise SystemExit(f"--reps x --steps: {total} steps exceed gpt2-tiny's {max_len} positions")
    params = SamplingParams(max_tokens=total + 1, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(args.batch, prompt_len, engine.model_config.vocab_size, 1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-{i}", prompt, params)
    for _ in range(3):  # the prefill and the first decode steps run the real forward
        engine.step()
    stub_decode(engine)
    rows = []
    for rep in range(args.reps):
        walls, phases = [], [0.0] * len(PHASES)
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            t = engine.last_step
            for i, s in enumerate((t.schedule_s, t.launch_s, t.wait_s, t.drain_s)):
                phases[i] += s
        row = {"rep": rep, "step p50 ms": 1e3 * statistics.median(walls)}
        row |= {f"{p} ms": 1e3 * s / args.steps for p, s in zip(PHASES, phases, strict=True)}
        rows.append(row)
        print(
            " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    best = min(rows, key=lambda r: r["step p50 ms"])
    print(f"batch {args.batch}: best rep's host step p50 {best['step p50 ms']:.3f} ms")
    result = {"machine": machine_description(), "batch": args.batch, "rows": rows}
    if args.count_calls:
        # A count of work done, where a shared machine's wall time is too noisy to compare.
        result["calls_per_step"] = profiled_steps(engine, args.steps).total_calls / args.steps
        print(f"batch {args.batch}: {result['calls_per_step']:.0f} Python calls per step")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
