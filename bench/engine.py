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
import gc
import math
import statistics
import tempfile
import time

import torch

import kernels.pdl
from bench.common import copy_bandwidth_gbps, host_cpu, markdown_table, percentile, write_json
from bench.engine_run import GREEDY, EngineRun, Sampling, random_prompts, run_engine
from bench.itl import cohort_itl, format_itl, steady_itl
from replica import EngineConfig, LLMEngine
from replica.config_flags import add_config_flags, config_from_args
from replica.models.layers import uses_triton_linear
from replica.models.presets import PRESETS
from replica.options import EngineOptions

HOST_BOUND_WAIT = 0.1  # a step that waited for the device under this share of its wall


def step_profile(run: EngineRun, slow_factor: float = 1.25) -> dict:
    """How the decode steps' walls spread, and what the slow ones (> slow_factor x the
    median) spent their time on: decode tok/s divides by the sum of walls, so a few slow
    steps move it while the median (TPOT) stays put. A step is host-bound when it waited
    for the device's previous step less than HOST_BOUND_WAIT of its wall: the host's own
    work (schedule, launch, drain) set its pace, and a faster host would have shortened it."""
    walls = run.decode_step_s
    if not walls:
        return {}
    median = percentile(walls, 50)
    slow = [i for i, w in enumerate(walls) if w > slow_factor * median]

    def phases_ms(indices: list[int]) -> list[float]:
        if not indices:
            return [float("nan")] * 5
        return [1e3 * statistics.mean(run.decode_phases_s[i][k] for i in indices) for k in range(5)]

    slow_set = set(slow)
    normal = [i for i in range(len(walls)) if i not in slow_set]
    others = run.other_steps
    prof = {
        "wall_ms": 1e3 * run.wall_s, "add_ms": 1e3 * run.add_s,
        "decode_total_ms": 1e3 * sum(walls), "num_other_steps": len(others),
        "other_prompt_tokens": sum(o[5] for o in others),
        "other_phases_ms": [1e3 * sum(o[k] for o in others) for k in range(5)],
        "mean_ms": 1e3 * statistics.mean(walls), "p50_ms": 1e3 * median,
        "p90_ms": 1e3 * percentile(walls, 90), "p99_ms": 1e3 * percentile(walls, 99),
        "max_ms": 1e3 * max(walls), "num_steps": len(walls), "num_slow": len(slow),
        "num_slow_at_rollover": sum(run.decode_boundary[i] for i in slow),
        "num_rollover_steps": sum(run.decode_boundary),
        "num_host_bound": sum(p[3] < HOST_BOUND_WAIT * p[0] for p in run.decode_phases_s),
        "excess_share": sum(w - median for w in walls if w > median) / sum(walls),
        "slow_phases_ms": phases_ms(slow), "normal_phases_ms": phases_ms(normal),
        "slow_indices": slow,
        "slow_batch": [run.decode_batch[i] for i in slow],
        "slow_finished": [run.decode_finished[i] for i in slow],
        # each slow step's (wall, schedule, launch, wait, drain): what the mean above hides
        "slow_steps_ms": [[1e3 * x for x in run.decode_phases_s[i]] for i in slow],
    }  # fmt: skip
    if run.decode_device_ms:  # StepEvents: (device span, idle before) ms
        spans = [d[0] for d in run.decode_device_ms if not math.isnan(d[0])]
        prof["device_p50_ms"] = percentile(spans, 50) if spans else math.nan
        prof["slow_device_ms"] = [list(run.decode_device_ms[i]) for i in slow]
        # each prompt step's (wall, schedule, launch, wait, drain, prompt tokens, device
        # span, idle before), ms
        prof["other_steps_ms"] = [
            [1e3 * x for x in o[:5]] + [o[5], *d]
            for o, d in zip(others, run.other_device_ms, strict=True)
        ]
    return prof


def format_step_profile(batch: int, prof: dict) -> str:
    names = ("wall", "schedule", "launch", "wait", "drain")
    fmt = lambda ms: " ".join(f"{n} {v:.3f}" for n, v in zip(names, ms, strict=True))  # noqa: E731
    return (
        f"batch {batch} decode steps: mean {prof['mean_ms']:.3f} ms, p50 {prof['p50_ms']:.3f},"
        f" p90 {prof['p90_ms']:.3f}, p99 {prof['p99_ms']:.3f}, max {prof['max_ms']:.3f};"
        f" {prof['num_slow']} of {prof['num_steps']} steps slow (> 1.25x p50),"
        f" {prof['num_slow_at_rollover']} of them block rollovers"
        f" ({prof['num_rollover_steps']} rollover steps in all); time above p50:"
        f" {100 * prof['excess_share']:.1f}% of the decode walls;"
        f" {prof['num_host_bound']} steps host-bound (waited for the device under"
        f" {100 * HOST_BOUND_WAIT:.0f}% of their wall)\n"
        f"  slow steps, mean ms: {fmt(prof['slow_phases_ms'])}; step (batch, requests"
        " finished): "
        + ", ".join(
            f"{i} ({b}, {f})"
            for i, b, f in zip(
                prof["slow_indices"], prof["slow_batch"], prof["slow_finished"], strict=True
            )
        )  # fmt: skip
        + "\n"
        f"  other steps, mean ms: {fmt(prof['normal_phases_ms'])}\n"
        f"  the run's {prof['wall_ms']:.1f} ms: add_request {prof['add_ms']:.1f},"
        f" {prof['num_steps']} decode steps {prof['decode_total_ms']:.1f},"
        f" {prof['num_other_steps']} steps with prompt chunks ({prof['other_prompt_tokens']}"
        f" tokens) {fmt(prof['other_phases_ms'])} (totals)"
        + (_format_device(prof) if "device_p50_ms" in prof else "")
    )


def _format_device(prof: dict) -> str:
    """StepEvents' lines: the decode steps' device span, the slow ones', each prompt step's."""
    pair = lambda d: f"{d[0]:.3f} (idle before {d[1]:.3f})"  # noqa: E731
    prompt_steps = "; ".join(
        f"{int(o[5])} tokens: wall {o[0]:.3f} schedule {o[1]:.3f} launch {o[2]:.3f}"
        f" wait {o[3]:.3f} drain {o[4]:.3f}, device {pair(o[6:])}"
        for o in prof["other_steps_ms"]
    )
    return (
        f"\n  device span per decode step (CUDA events), p50 {prof['device_p50_ms']:.3f} ms;"
        f" slow steps: {', '.join(map(pair, prof['slow_device_ms']))}"
        f"\n  steps with prompt chunks, ms: {prompt_steps}"
    )


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
# Older spellings of EngineConfig flags (--no-cuda-graphs, --no-triton-linear,
# --no-fused-append, --max-batched-tokens), kept working.
ENGINE_ALIASES = {
    "enable_cuda_graphs": ["--cuda-graphs"],
    "enable_triton_linear": ["--triton-linear"],
    "fuse_decode_append": ["--fused-append"],
    "max_num_batched_tokens": ["--max-batched-tokens"],
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field and option (replica.config_flags), but ENGINE_EXCLUDED."""
    group = parser.add_argument_group(
        "engine (EngineConfig, its options included)",
        "--model defaults to gpt2 on a GPU, gpt2-tiny on CPU; --max-model-len to the "
        "model's positions, at most 2048; max_num_seqs is the largest --batch / --itl-batch",
    )
    add_config_flags(group, EngineConfig, exclude=ENGINE_EXCLUDED, aliases=ENGINE_ALIASES)
    parser.set_defaults(model=None)


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    """The EngineOptions that add_engine_flags' flags (--no-pdl, ...) asked for."""
    return config_from_args(EngineOptions, args)


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
        "--no-gc", action="store_true", help="diagnostic: Python's cyclic GC off during the runs"
    )
    parser.add_argument(
        "--step-events", action="store_true",
        help="CUDA events around each step's launch: its device time and the idle before it",
    )  # fmt: skip
    parser.add_argument(
        "--host-delay-ms", type=float, default=0.0,
        help="busy-wait this long after each step(), as a slower host would (run_engine)",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample at this temperature (0: greedy); HF's peer samples the same way",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature; 0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    parser.add_argument(
        "--seeded", action="store_true", help="with --temperature: each request its own seed"
    )
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seeded)
    try:
        sampling.params(0, 1)  # bad values fail here, before a model loads
    except ValueError as exc:
        raise SystemExit(f"--temperature / --top-k / --top-p: {exc}") from None
    if args.repeat < 1:
        raise SystemExit(f"--repeat: must be at least 1, got {args.repeat}")

    on_gpu = torch.cuda.is_available()
    if args.step_events and not on_gpu:
        raise SystemExit("--step-events: needs a CUDA device")
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
        start = time.perf_counter()
        engine = LLMEngine(
            config_from_args(
                EngineConfig, args, model=model, max_num_seqs=max_num_seqs,
                max_model_len=args.max_model_len or min(2048, _max_positions(model)),
            )
        )  # fmt: skip
        start_s = time.perf_counter() - start  # weights, KV cache, graph capture
        vocab = engine.model_config.vocab_size
        if args.no_gc:
            gc.disable()
        bandwidth = copy_bandwidth_gbps(engine.device) if on_gpu else None
        run_engine(engine, random_prompts(min(4, max_num_seqs), prompt_len, vocab, 99), 8, sampling)
        rows, profiles = [], {}
        for num_seqs in args.batch:
            runs, hf_rates = [], []
            for r in range(args.repeat):
                # Prompts of its own each time: the same ones would be prefix-cache hits.
                prompts = random_prompts(num_seqs, prompt_len, vocab, num_seqs + 1000 * r)
                runs.append(
                    run_engine(
                        engine, prompts, max_new, sampling, args.step_events,
                        args.host_delay_ms / 1e3,
                    )
                )  # fmt: skip
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
            profiles[num_seqs] = step_profile(run)
            if bandwidth:
                roof = roofline_decode_tokens_per_s(
                    engine, num_seqs, prompt_len, max_new, bandwidth
                )
                row |= {"roofline tok/s": roof, "% roofline": 100 * run.decode_tokens_per_s / roof}
            if hf is not None:
                row["HF tok/s"] = statistics.median(hf_rates)
                row["x HF"] = run.tokens_per_s / row["HF tok/s"]
            if args.repeat > 1:
                row["tok/s runs"] = [x.tokens_per_s for x in runs]
                row["HF tok/s runs"] = hf_rates
            rows.append(row)
        itl = None
        if args.itl_batch:
            itl = {
                "steady": steady_itl(engine, args.itl_batch, args.itl_steps, vocab),
                "cohort": cohort_itl(
                    engine, args.itl_batch, args.itl_steps, args.block_size, vocab
                ),
            }
    columns = ["batch", "tok/s", "HF tok/s", "x HF", "decode tok/s", "roofline tok/s",
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
          f" host_delay_ms={args.host_delay_ms}"
          f" sampling={sampling}"
          f" engine_start={start_s:.2f} s"
          + (f" copy_bw={bandwidth:.0f} GB/s" if bandwidth else "")
          + f" host={host_cpu()!r}")  # fmt: skip
    print(markdown_table(rows, [c for c in columns if any(c in r for r in rows)]))
    for row in rows:
        if "tok/s runs" in row:
            runs = ", ".join(f"{x:.3g}" for x in row["tok/s runs"])
            hf_runs = ", ".join(f"{x:.3g}" for x in row["HF tok/s runs"])
            print(f"batch {row['batch']} runs (the table: the medians): tok/s {runs}"
                  + (f"; HF tok/s {hf_runs}" if hf_runs else ""))  # fmt: skip
    for num_seqs, prof in profiles.items():
        if prof:
            print(format_step_profile(num_seqs, prof))
    if itl:
        print(format_itl(args.itl_batch, itl["cohort"], itl["steady"]))
    write_json(args.out, {"model": args.model or model, "prompt_len": prompt_len,
                          "max_new": max_new, "rows": rows, "sampling": str(sampling),
                          "kv_cache_dtype": str(engine.runner.kv_cache.dtype),
                          "step_profiles": profiles,
                          "itl": itl, "engine_start_s": start_s,
                          "copy_bw_gbps": bandwidth})  # fmt: skip


def _max_positions(model: str) -> int:
    from replica.models import load_model_config

    return load_model_config(model).max_position_embeddings


if __name__ == "__main__":
    main()
