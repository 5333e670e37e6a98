"""Bursts of requests into one engine: each step's host phases, first burst against later ones.

    python -m bench.burst --model gpt2 --dtype float16 --batch 256 --bursts 3

Each burst adds --batch prompts at once and steps the engine until they finish
(--max-new tokens each, greedy, ignore_eos). Per step it prints the wall and the
engine's phases (StepTimings: schedule, launch, wait for the previous step's tokens,
drain) with the step's prompt tokens and decode rows. The first burst of a process
runs with only a 4-prompt warm-up before it, as a server's first requests would. A
step that costs more in the first burst than in the later ones is doing first-time
work (kernel module loads, allocator growth, compiles).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import write_json
from bench.engine import random_prompts
from replica import EngineConfig, LLMEngine, SamplingParams


def run_burst(engine: LLMEngine, prompts: list[list[int]], max_new: int, tag: str) -> list[dict]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = [{"step": "add_request", "wall_ms": 1e3 * (time.perf_counter() - start)}]
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        t = engine.last_step
        steps.append({
            "step": len(steps) - 1, "wall_ms": 1e3 * (time.perf_counter() - start),
            "schedule_ms": 1e3 * t.schedule_s, "launch_ms": 1e3 * t.launch_s,
            "wait_ms": 1e3 * t.wait_s, "drain_ms": 1e3 * t.drain_s,
            "prompt_tokens": t.num_prefill_tokens, "decode_rows": t.num_decode_seqs,
        })  # fmt: skip
    return steps


def format_burst(index: int, steps: list[dict], max_steps: int) -> str:
    lines = [f"burst {index}: add_request {steps[0]['wall_ms']:.2f} ms"]
    for s in steps[1 : 1 + max_steps]:
        lines.append(
            f"  step {s['step']}: wall {s['wall_ms']:.2f} schedule {s['schedule_ms']:.2f}"
            f" launch {s['launch_ms']:.2f} wait {s['wait_ms']:.2f} drain {s['drain_ms']:.2f}"
            f" | prompt tokens {s['prompt_tokens']}, decode rows {s['decode_rows']}"
        )
    total = sum(s["wall_ms"] for s in steps)
    lines.append(f"  all {len(steps) - 1} steps and add_request: {total:.1f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="preset or directory (gpt2 on GPU)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--show-steps", type=int, default=6, help="steps printed per burst")
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    model = args.model or ("gpt2" if on_gpu else "gpt2-tiny")
    prompt_len = args.prompt_len or (128 if on_gpu else 16)
    engine = LLMEngine(
        EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.batch,
                     max_model_len=prompt_len + args.max_new)
    )  # fmt: skip
    vocab = engine.model_config.vocab_size
    run_burst(engine, random_prompts(min(4, args.batch), prompt_len, vocab, 99), 2, "warm")
    bursts = []
    for b in range(args.bursts):
        prompts = random_prompts(args.batch, prompt_len, vocab, b)
        bursts.append(run_burst(engine, prompts, args.max_new, f"b{b}"))
        print(format_burst(b, bursts[-1], args.show_steps))
    write_json(args.out, {"model": model, "batch": args.batch, "bursts": bursts})


if __name__ == "__main__":
    main()
