"""Offline engine benchmark: throughput, time per output token, ITL, host time per step.

On a GPU the same run measures the peers: Hugging Face transformers `generate`
(static cache, greedy or sampling as the engine's requests do) on the very same
checkpoint, and the HBM roofline (weight + KV bytes each decode step must read, over
the measured copy bandwidth). Requests decode greedily unless --temperature is given.

    python -m bench.engine                                  # CPU: host-side time per step
    python -m bench.engine --model gpt2 --dtype float16 --batch 1 256 --hf --itl-batch 64
    python -m bench.engine --model gpt2 --dtype float16 --batch 256 --temperature 0.8 --top-p 0.95
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

import kernels.pdl
from bench.common import copy_bandwidth_gbps, host_cpu, markdown_table, percentile, write_json
from bench.engine_run import GREEDY, Sampling, format_itl, random_prompts, run_engine, steady_itl
from replica import EngineConfig, LLMEngine
from replica.config_flags import add_config_flags, config_from_args
from replica.models import load_model_config
from replica.models.layers import uses_triton_linear
from replica.models.presets import PRESETS


def hf_checkpoint(model: str, dtype: torch.dtype, directory: str) -> torch.nn.Module:
    """A random-weight transformers model of a preset's shape, saved for the engine to load."""
    import transformers

    config = transformers.AutoConfig.for_model(**PRESETS[model])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    hf.save_pretrained(directory)
    return hf


def run_hf(
    hf: torch.nn.Module,
    prompts: list[list[int]],
    max_new: int,
    device,
    sampling: Sampling = GREEDY,
) -> float:
    """transformers generate (greedy, or sampling's), static cache, forced to max_new
    tokens: tokens/s."""
    hf = hf.to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), cache_implementation="static",
        pad_token_id=0, min_new_tokens=max_new, **sampling.hf_kwargs(),
    )  # fmt: skip
    with torch.inference_mode():
        # Warm up at the timed length: the static cache's shape (prompt + max_new) is what
        # transformers compiles the forward for, so a shorter warm-up would leave the
        # compilation inside the timed call.
        hf.generate(ids, max_new_tokens=max_new, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_new, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + max_new
    return len(prompts) * max_new / elapsed


def roofline_decode_tokens_per_s(
    engine: LLMEngine, num_seqs: int, prompt_len: int, max_new: int, bandwidth_gbps: float
) -> float:
    """Decode tokens/s if every step only read the weights and the live KV at copy bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_per_token = engine.runner.kv_bytes_per_block() / engine.config.block_size
    steps = range(1, max_new)  # the first token comes from prefill
    total_bytes = sum(weight_bytes + num_seqs * (prompt_len + j) * kv_per_token for j in steps)
    return num_seqs * len(steps) / (total_bytes / (bandwidth_gbps * 1e9))


# EngineConfig fields bench.engine has no flag for: it runs one engine, which no cluster
# names, and its batch is what --batch / --itl-batch ask for.
ENGINE_EXCLUDED = ("replica_id", "max_num_seqs")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field and option (replica.config_flags), but ENGINE_EXCLUDED."""
    group = parser.add_argument_group(
        "engine (EngineConfig, its options included)",
        "--model defaults to gpt2 on a GPU, gpt2-tiny on CPU; --max-model-len to the "
        "model's positions, at most 2048; max_num_seqs is the largest --batch / --itl-batch",
    )
    add_config_flags(group, EngineConfig, exclude=ENGINE_EXCLUDED)
    parser.set_defaults(model=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[256], help="batch sizes, one run each"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens (default: 128 on GPU, 16)"
    )
    parser.add_argument(
        "--max-new", type=int, default=None, help="tokens generated (default: 128 on GPU, 32)"
    )
    parser.add_argument("--hf", action="store_true", help="also measure transformers generate")
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="runs per batch size, each with prompts of its own, HF's beside each engine run;"
        " the table shows the engine's median run and HF's median rate",
    )  # fmt: skip
    parser.add_argument("--itl-batch", type=int, default=0, help="ITL run: batch size")
    parser.add_argument("--itl-steps", type=int, default=1024, help="ITL run: decode steps")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample at this temperature (0: greedy); HF's peer samples the same way",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature; 0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    parser.add_argument(
        "--seeded", action="store_true", help="with --temperature: each request its own seed"
    )
    parser.add_argument(
        "--extras-fraction", type=float, default=0.0,
        help="also run each batch with this fraction of requests asking logprobs=5 and"
        " presence / frequency / repetition penalties; the row shows both decode rates",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    if not 0.0 <= args.extras_fraction <= 1.0:
        raise SystemExit(f"--extras-fraction: must be in [0, 1], got {args.extras_fraction}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seeded)
    try:
        sampling.params(0, 1)  # bad values fail here, before a model loads
    except ValueError as exc:
        raise SystemExit(f"--temperature / --top-k / --top-p: {exc}") from None
    if args.repeat < 1:
        raise SystemExit(f"--repeat: must be at least 1, got {args.repeat}")

    on_gpu = torch.cuda.is_available()
    model = args.model or ("gpt2" if on_gpu else "gpt2-tiny")
    prompt_len = args.prompt_len or (128 if on_gpu else 16)
    max_new = args.max_new or (128 if on_gpu else 32)
    max_num_seqs = max(args.batch + [args.itl_batch])
    with tempfile.TemporaryDirectory() as tmp:
        hf = None
        if args.hf and model in PRESETS:
            dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.dtype)
            hf = hf_checkpoint(model, dtype or torch.float32, tmp)
            model = tmp
        max_positions = load_model_config(model).max_position_embeddings
        start = time.perf_counter()
        engine = LLMEngine(
            config_from_args(
                EngineConfig, args, model=model, max_num_seqs=max_num_seqs,
                max_model_len=args.max_model_len or min(2048, max_positions),
            )
        )  # fmt: skip
        start_s = time.perf_counter() - start  # weights, KV cache, graph capture
        vocab = engine.model_config.vocab_size
        bandwidth = copy_bandwidth_gbps(engine.device) if on_gpu else None
        run_engine(engine, random_prompts(min(4, max_num_seqs), prompt_len, vocab, 99), 8, sampling)
        rows = []
        for num_seqs in args.batch:
            runs, hf_rates = [], []
            for r in range(args.repeat):
                # Prompts of its own each time: the same ones would be prefix-cache hits.
                prompts = random_prompts(num_seqs, prompt_len, vocab, num_seqs + 1000 * r)
                runs.append(run_engine(engine, prompts, max_new, sampling))
                if hf is not None:
                    hf_rates.append(run_hf(hf, prompts, max_new, engine.device, sampling))
            run = sorted(runs, key=lambda x: x.tokens_per_s)[len(runs) // 2]  # the median
            row = {
                "batch": num_seqs,
                "tok/s": run.tokens_per_s,
                "decode tok/s": run.decode_tokens_per_s,
                "TPOT ms": 1e3 * percentile(run.decode_step_s, 50),
                "sched+drain ms": 1e3 * percentile(run.decode_host_s, 50),
                "sched+drain p99": 1e3 * percentile(run.decode_host_s, 99),
                "launch ms": 1e3 * percentile(run.decode_launch_s, 50),
                "step mean ms": 1e3 * statistics.mean(run.decode_step_s),
                "step p99 ms": 1e3 * percentile(run.decode_step_s, 99),
            }
            if bandwidth:
                roof = roofline_decode_tokens_per_s(
                    engine, num_seqs, prompt_len, max_new, bandwidth
                )
                row |= {"roofline tok/s": roof, "% roofline": 100 * run.decode_tokens_per_s / roof}
            if hf is not None:
                row["HF tok/s"] = statistics.median(hf_rates)
                row["x HF"] = run.tokens_per_s / row["HF tok/s"]
            if args.extras_fraction:  # the same batch, a fraction of its rows with extras
                extras = dataclasses.replace(sampling, extras_fraction=args.extras_fraction)
                prompts = random_prompts(num_seqs, prompt_len, vocab, num_seqs + 7777)
                extras_run = run_engine(engine, prompts, max_new, extras)
                row["extras decode tok/s"] = extras_run.decode_tokens_per_s
                row["extras / plain"] = extras_run.decode_tokens_per_s / run.decode_tokens_per_s
            if args.repeat > 1:
                row["tok/s runs"] = [x.tokens_per_s for x in runs]
                row["HF tok/s runs"] = hf_rates
            rows.append(row)
        itl = steady_itl(engine, args.itl_batch, args.itl_steps, vocab) if args.itl_batch else None
    columns = ["batch", "tok/s", "HF tok/s", "x HF", "decode tok/s", "extras decode tok/s",
               "extras / plain", "roofline tok/s",
               "% roofline", "TPOT ms", "step mean ms", "step p99 ms", "sched+drain ms",
               "sched+drain p99", "launch ms"]  # fmt: skip
    triton_linear = uses_triton_linear(engine.runner.model)
    print(f"\nmodel={args.model or model} dtype={engine.dtype}"
          f" kv_cache={engine.runner.kv_cache.dtype} prompt={prompt_len} new={max_new}"
          f" block_size={args.block_size} cuda_graphs={engine.runner.use_cuda_graphs}"
          f" triton_linear={triton_linear}"
          f" pdl={kernels.pdl.use_pdl(engine.device, engine.config.options.pdl)}"
          f" fused_append={getattr(engine.runner.backend, 'fuse_decode_append', False)}"
          f" decode_in_prefill={engine.runner.decode_in_prefill}"
          f" mixed_prefill_tokens={engine.config.mixed_prefill_tokens}"
          f" sampling={sampling}"
          + (f" extras_fraction={args.extras_fraction}" if args.extras_fraction else "")
          + f" engine_start={start_s:.2f} s"
          + (f" copy_bw={bandwidth:.0f} GB/s" if bandwidth else "")
          + f" host={host_cpu()!r}")  # fmt: skip
    print(markdown_table(rows, [c for c in columns if any(c in r for r in rows)]))
    for row in rows:
        if "tok/s runs" in row:
            runs = ", ".join(f"{x:.3g}" for x in row["tok/s runs"])
            hf_runs = ", ".join(f"{x:.3g}" for x in row["HF tok/s runs"])
            print(f"batch {row['batch']} runs (the table: the medians): tok/s {runs}"
                  + (f"; HF tok/s {hf_runs}" if hf_runs else ""))  # fmt: skip
    if itl:
        print(format_itl(args.itl_batch, itl))
    write_json(args.out, {"model": args.model or model, "prompt_len": prompt_len,
                          "max_new": max_new, "rows": rows, "sampling": str(sampling),
                          "kv_cache_dtype": str(engine.runner.kv_cache.dtype),
                          "itl": itl, "engine_start_s": start_s,
                          "copy_bw_gbps": bandwidth})  # fmt: skip


if __name__ == "__main__":
    main()
