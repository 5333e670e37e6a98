"""Sampling a decode step's logits: kernels.sampling against the torch sampler, on a GPU.

    python -m bench.sampling [--rows 1 64 256] [--shapes gpt2,qwen3-0.6b] [--out sampling.json]
    python -m bench.sampling --host [--rows 1 64 256]     # any machine
    python -m bench.sampling --kinds "T=0.8 top_p=0.95" --split-rounds 1 2 3 4   # a sweep

--host times the host's side of a sampled step instead: packing the rows' parameters for
the device (GraphSamplingInputs.upload, what a decode step's sampling graph reads, and
SamplingBatch.build, what sample_fused reads), over a mix of seeded and unseeded top-p
rows, and upload over unseeded rows alone (its common case), in us per call.

For each vocabulary (gpt2's 50,257 in fp16 and qwen3-0.6b's 151,936 in bf16, as their
LM heads give them), each batch of rows and each kind of sampling (temperature alone,
top-p, top-k, seeded top-p), it times `replica.sampler.sample_fused` (the CUDA path:
kernels.sampling, a bisected floor for top-k rows) against `replica.sampler.sample` (the
torch path, a sort for top-k / top-p: the peer), both with triton's do_bench (host launch
included, as the engine pays it), and kernels.sample_tokens alone, CUDA-graph-timed over
rotating copies of the logits. Random logits with a spread like a trained model's
(normal, scale 3) and like a random-weight one's (scale 0.3): the rejection rounds
depend on how peaked a row is.

--split-rounds sweeps the rejection rounds run split over a row's chunks before the
finishing launch takes a row still undecided, one program a row (kernels.sampling's
SPLIT_ROUNDS, or one for a launch of few logits: ONE_ROUND_LOGITS).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch

import kernels
import kernels.sampling
from bench import kernels as bk
from bench.common import machine_description, markdown_table, write_json
from replica.models.layers import LMHead
from replica.sampler import GraphSamplingInputs, SamplingBatch, sample, sample_fused
from replica.sampling_params import SamplingParams


@dataclass(frozen=True)
class Vocab:
    name: str
    size: int
    dtype: torch.dtype


VOCABS = [Vocab("gpt2", 50257, torch.float16), Vocab("qwen3-0.6b", 151936, torch.bfloat16)]
KINDS = {
    "T=0.8": dict(temperature=0.8),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.8 top_k=50": dict(temperature=0.8, top_k=50),
    "T=0.8 top_p=0.95 seeded": dict(temperature=0.8, top_p=0.95, seed=0),
}
SPREADS = (3.0, 0.3)


def bench_case(vocab: Vocab, rows: int, kind: str, spread: float) -> dict:
    device = torch.device(bk.DEVICE)
    fields = KINDS[kind]
    params = [
        SamplingParams(**(fields | ({"seed": i} if "seed" in fields else {}))) for i in range(rows)
    ]
    gen = torch.Generator(device=device).manual_seed(rows)
    copies = bk.num_copies(rows * vocab.size * vocab.dtype.itemsize)
    # As the fused LM head gives them: rows of a padded width (aligned), sliced.
    width = -(-vocab.size // LMHead.PAD_ROWS_TO) * LMHead.PAD_ROWS_TO
    logits = [
        (torch.randn(rows, width, generator=gen, device=device) * spread).to(vocab.dtype)[
            :, : vocab.size
        ]
        for _ in range(copies)
    ]
    positions = list(range(rows))
    fused = SamplingBatch.build(params, [None] * rows, vocab.size, device, positions, 1)
    generators = [
        torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
        for p in params
    ]
    torch_batch = SamplingBatch.build(params, generators, vocab.size, device)
    default = torch.Generator(device=device).manual_seed(0)
    fused_fns = [lambda x=x: sample_fused(x, fused) for x in logits]
    torch_fns = [lambda x=x: sample(x, torch_batch, default) for x in logits]
    rounds = kernels.sampling.num_split_rounds(rows, vocab.size, fused.any_top_p)
    row = {"vocab": vocab.name, "rows": rows, "sampling": kind, "spread": spread,
           "split_rounds": rounds}  # fmt: skip
    row["fused_us"] = bk.do_bench_us(fused_fns)
    row["torch_us"] = bk.do_bench_us(torch_fns)
    row["x torch"] = row["torch_us"] / row["fused_us"]
    out = torch.empty(rows, dtype=torch.int64, device=device)  # the kernels alone, graphed
    args = (fused.temperatures, fused.top_ks, fused.top_ps, fused.keys, fused.bases, out)
    flags = {"any_top_p": fused.any_top_p, "any_top_k": fused.any_top_k}
    row["kernel_us"] = bk.graph_time_us(
        [lambda x=x: kernels.sample_tokens(x, *args, **flags) for x in logits]
    )
    return row


def host_case(rows: int, vocab: int = 50257, reps: int = 200) -> dict:
    """us per call of the two ways a step's sampling parameters are packed for the device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i if i % 2 else None) for i in range(rows)
    ]
    unseeded = [SamplingParams(temperature=0.8, top_p=0.95) for _ in range(rows)]
    positions = list(range(100, 100 + rows))
    inputs = GraphSamplingInputs(rows, vocab, device)
    calls = {
        "upload_us": lambda: inputs.upload(params, positions, 12345, rows, 0),
        "upload_unseeded_us": lambda: inputs.upload(unseeded, positions, 12345, rows, 0),
        "build_us": lambda: SamplingBatch.build(
            params, [None] * rows, vocab, device, positions, 12345
        ),
    }
    row = {"rows": rows}
    for name, call in calls.items():
        for _ in range(reps // 10):  # warm: the pinned allocator, first-call paths
            call()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        row[name] = 1e6 * (time.perf_counter() - start) / reps
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--shapes", default=",".join(v.name for v in VOCABS))
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--host", action="store_true", help="the host's packing, not kernels")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {list(KINDS)}")
    parser.add_argument(
        "--split-rounds", type=int, nargs="+", default=[None],
        help="split rounds to sweep, each at every size (default: kernels.sampling's rule)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.host:
        bk.print_now(machine_description())
        rows = [host_case(n) for n in args.rows]
        bk.print_now(markdown_table(rows, ["rows", "upload_us", "upload_unseeded_us", "build_us"]))
        write_json(args.out, {"benchmark": "sampling_host", "rows": rows})
        return
    names = args.shapes.split(",")
    vocabs = [v for v in VOCABS if v.name in names]
    if len(vocabs) != len(names):
        raise SystemExit(f"--shapes: unknown name in {names}; known {[v.name for v in VOCABS]}")
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        raise SystemExit(f"--kinds: unknown kind in {kinds}; known {list(KINDS)}")
    if any(not 1 <= r <= kernels.sampling.MAX_ROUNDS for r in args.split_rounds if r is not None):
        raise SystemExit(f"--split-rounds: each in [1, {kernels.sampling.MAX_ROUNDS}]")
    if not torch.cuda.is_available():
        raise SystemExit("bench/sampling.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    bk.print_now(machine_description())
    rows = []
    cases = itertools.product(vocabs, args.rows, kinds, SPREADS, args.split_rounds)
    for vocab, num_rows, kind, spread, split_rounds in cases:
        if split_rounds is not None:  # at every size: no launch takes one round for its size
            kernels.sampling.SPLIT_ROUNDS = split_rounds
            kernels.sampling.ONE_ROUND_LOGITS = 0
        rows.append(bench_case(vocab, num_rows, kind, spread))
        r = rows[-1]
        bk.print_now(f"{vocab.name} {num_rows} x [{kind}] spread {spread}, split rounds "
                     f"{split_rounds}: fused {r['fused_us']:.1f} us, kernels "
                     f"{r['kernel_us']:.1f} us, torch {r['torch_us']:.1f} us")  # fmt: skip
    columns = ["vocab", "rows", "sampling", "spread", "split_rounds", "fused_us", "kernel_us",
               "torch_us", "x torch"]  # fmt: skip
    bk.print_now(markdown_table(rows, columns))
    write_json(args.out, {"benchmark": "sampling", "rows": rows})


if __name__ == "__main__":
    main()
