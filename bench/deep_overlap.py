"""One step in flight against two (EngineConfig.deep_overlap_rows), run by run in turn on
one engine, at each emulated host delay.

    python -m bench.deep_overlap --model gpt2 --dtype float16 --batch 256 --runs 8 \
        --host-delay-ms 0 0.4 0.6

The host's speed drifts between processes and within one (bench.engine's runs of one
setting swung by 10%), so the two settings alternate on the same engine, each run on
prompts of its own, and the comparison is of their medians. --host-delay-ms busy-waits
after each step() (bench.engine.run_engine), as a slower host's Python would: where the
host's work per step nears the device's, one step in flight leaves the device idle, and
two give the host a second step of slack. Printed per delay and setting: the median
run's tokens/s, decode tokens/s and % of the roofline (the copy bandwidth measured in
the same process), and the median decode step.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import copy_bandwidth_gbps, machine_description, markdown_table, write_json
from bench.engine import random_prompts, roofline_decode_tokens_per_s, run_engine
from replica import EngineConfig, LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="preset or directory (gpt2 on GPU)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-new", type=int, default=None)
    parser.add_argument("--runs", type=int, default=8, help="runs of each setting per delay")
    parser.add_argument("--host-delay-ms", type=float, nargs="+", default=[0.0])
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    model = args.model or ("gpt2" if on_gpu else "gpt2-tiny")
    prompt_len = args.prompt_len or (128 if on_gpu else 16)
    max_new = args.max_new or (128 if on_gpu else 8)
    engine = LLMEngine(
        EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.batch,
                     max_model_len=prompt_len + max_new)
    )  # fmt: skip
    deep = engine.config.deep_overlap_rows
    settings = {"one in flight": 0, f"two from {deep} rows": deep}
    vocab = engine.model_config.vocab_size
    bandwidth = copy_bandwidth_gbps(engine.device) if on_gpu else None
    roof = (
        roofline_decode_tokens_per_s(engine, args.batch, prompt_len, max_new, bandwidth)
        if bandwidth
        else None
    )
    run_engine(engine, random_prompts(args.batch, prompt_len, vocab, 99), max_new)  # warm-up
    rows, raw = [], []
    for delay_ms in args.host_delay_ms:
        runs: dict[str, list] = {name: [] for name in settings}
        for r in range(args.runs):
            for i, (name, value) in enumerate(settings.items()):
                engine.deep_overlap_rows = value
                seed = 10_000 + 1_000 * len(raw) + 2 * r + i  # prompts of its own
                prompts = random_prompts(args.batch, prompt_len, vocab, seed)
                runs[name].append(run_engine(engine, prompts, max_new, host_delay_s=delay_ms / 1e3))
        for name, done in runs.items():
            run = sorted(done, key=lambda x: x.tokens_per_s)[len(done) // 2]  # the median
            row = {
                "host delay ms": delay_ms,
                "setting": name,
                "tok/s": run.tokens_per_s,
                "decode tok/s": run.decode_tokens_per_s,
                "step p50 ms": 1e3 * statistics.median(run.decode_step_s),
                "step mean ms": 1e3 * statistics.mean(run.decode_step_s),
                "run ms range": f"{1e3 * min(x.wall_s for x in done):.1f}-"
                f"{1e3 * max(x.wall_s for x in done):.1f}",
            }
            if roof:
                row["% roofline"] = 100 * run.decode_tokens_per_s / roof
            rows.append(row)
            raw.append({"host_delay_ms": delay_ms, "setting": name,
                        "tok/s runs": [x.tokens_per_s for x in done],
                        "decode tok/s runs": [x.decode_tokens_per_s for x in done]})  # fmt: skip
    engine.deep_overlap_rows = deep
    print(f"model={model} dtype={engine.dtype} batch={args.batch} prompt={prompt_len}"
          f" new={max_new} runs={args.runs}"
          + (f" copy_bw={bandwidth:.0f} GB/s" if bandwidth else ""))  # fmt: skip
    columns = ["host delay ms", "setting", "tok/s", "decode tok/s", "% roofline",
               "step p50 ms", "step mean ms", "run ms range"]  # fmt: skip
    print(markdown_table(rows, [c for c in columns if any(c in r for r in rows)]))
    write_json(
        args.out,
        {"machine": machine_description(), "model": model, "batch": args.batch,
         "prompt_len": prompt_len, "max_new": max_new, "copy_bw_gbps": bandwidth,
         "rows": rows, "runs": raw},
    )  # fmt: skip


if __name__ == "__main__":
    main()
