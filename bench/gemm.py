"""Decode-step GEMMs: kernels.linear's tiles against cuBLAS (torch), on one CUDA GPU.

    python -m bench.gemm [--models gpt2,qwen3-0.6b] [--rows 1 8 64 256] [--out gemm.json]
    python -m bench.gemm --fold [--fold-sweep] [--rows 32 64 128 256]

For each linear layer of a model (its weight layout and dtype: GPT-2's Conv1D
[K, N] in fp16, a Llama-family nn.Linear [N, K] in bf16) and each batch of rows,
it times torch (addmm / F.linear, plus the separate GELU, or SiLU(gate) * up, where
the model has one) and kernels.linear: the tile choose_tile picks, and the best of a sweep (tiles
first at 4 warps / 4 stages, then split K over the four best, then warps x
stages around the two best tiles).
Times are CUDA-graph-timed over rotating copies of x and W that together exceed
the L2 four times (bench.kernels.graph_time_us): in a decode step every weight
comes from HBM. Every tile is checked against the float32 reference before it is
timed. The last table is choose_tile's: where it is slower than torch, the
model keeps torch for that shape.

--fold times GPT-2's sublayer boundaries instead (bench_fold): a projection, the
residual add + LayerNorm kernel and the next projection, against the two
projections with the add and the norm folded in (linear_add, linear_norm);
--fold-sweep times the folded pair over a few tiles of each launch.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from bench.common import machine_description, markdown_table, write_json
from bench.kernels import graph_time_us, num_copies, print_now
from kernels.layer_norm import fused_add_layer_norm
from kernels.linear import fold_layer_norm, linear, linear_add, linear_norm, linear_ref
from kernels.linear_tiles import Tile, choose_tile, gated_tile


@dataclass(frozen=True)
class Gemm:
    model: str
    name: str
    k: int
    n: int
    dtype: torch.dtype
    weight_is_kn: bool
    activation: str = "none"


GEMMS = {
    "gpt2": [
        Gemm("gpt2", "c_attn", 768, 2304, torch.float16, True),
        Gemm("gpt2", "attn.c_proj", 768, 768, torch.float16, True),
        Gemm("gpt2", "c_fc+gelu", 768, 3072, torch.float16, True, "gelu_tanh"),
        Gemm("gpt2", "mlp.c_proj", 3072, 768, torch.float16, True),
        Gemm("gpt2", "lm_head", 768, 50304, torch.float16, False),
    ],
    "qwen3-0.6b": [
        Gemm("qwen3-0.6b", "qkv_proj", 1024, 4096, torch.bfloat16, False),
        Gemm("qwen3-0.6b", "o_proj", 2048, 1024, torch.bfloat16, False),
        Gemm("qwen3-0.6b", "gate_up_proj", 1024, 6144, torch.bfloat16, False),
        # the folded decode path's launch: SiLU(gate) * up in the epilogue, [M, 3072] out
        Gemm("qwen3-0.6b", "gate_up+silu", 1024, 6144, torch.bfloat16, False, "silu_mul"),
        Gemm("qwen3-0.6b", "down_proj", 3072, 1024, torch.bfloat16, False),
    ],
}


SPLIT_KS = (2, 3, 4, 6)


def _inputs(gemm: Gemm, rows: int, gen: torch.Generator) -> list[tuple]:
    shape_w = (gemm.k, gemm.n) if gemm.weight_is_kn else (gemm.n, gemm.k)
    nbytes = (rows * gemm.k + gemm.k * gemm.n + rows * gemm.n) * 2
    copies = []
    for _ in range(num_copies(nbytes)):
        x = (torch.randn(rows, gemm.k, generator=gen) * 0.5).to(gemm.dtype).cuda()
        w = (torch.randn(*shape_w, generator=gen) / gemm.k**0.5).to(gemm.dtype).cuda()
        bias = (torch.randn(gemm.n, generator=gen) * 0.1).to(gemm.dtype).cuda()
        out_cols = gemm.n // 2 if gemm.activation == "silu_mul" else gemm.n
        out = torch.empty(rows, out_cols, dtype=gemm.dtype, device="cuda")
        copies.append((x, w, bias, out))
    return copies


def _torch_fn(gemm: Gemm, x, w, bias, out):
    def call():
        y = torch.addmm(bias, x, w) if gemm.weight_is_kn else F.linear(x, w, bias)
        if gemm.activation == "silu_mul":
            gate, up = y.chunk(2, dim=1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh") if gemm.activation == "gelu_tanh" else y

    return call


def _triton_fn(gemm: Gemm, tile: Tile, x, w, bias, out):
    def call():
        return linear(
            x, w, bias, weight_is_kn=gemm.weight_is_kn, activation=gemm.activation,
            out=out, tile=tile,
        )  # fmt: skip

    return call


def _tiles(rows: int, warps_stages: tuple[int, int] = (4, 4)) -> list[Tile]:
    max_m = max(16, 1 << (rows - 1).bit_length())
    return [
        Tile(bm, bn, bk, *warps_stages)
        for bm, bn, bk in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128))
        if bm <= max_m
    ]


def _time_tile(gemm: Gemm, tile: Tile, copies: list[tuple]) -> float | None:
    x, w, bias, out = copies[0]
    try:
        got = _triton_fn(gemm, tile, x, w, bias, out)()
    except Exception as exc:  # out of shared memory for this tile: not a candidate
        print_now(f"    {tile}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return None
    want = linear_ref(x, w, bias, weight_is_kn=gemm.weight_is_kn, activation=gemm.activation)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    return graph_time_us([_triton_fn(gemm, tile, *c) for c in copies])


def bench_gemm(gemm: Gemm, rows: int, gen: torch.Generator) -> dict:
    copies = _inputs(gemm, rows, gen)
    torch_us = graph_time_us([_torch_fn(gemm, *c) for c in copies])
    times: dict[Tile, float] = {}
    for tile in _tiles(rows):
        if (us := _time_tile(gemm, tile, copies)) is not None:
            times[tile] = us
    for base in sorted(times, key=times.get)[:4]:
        for split_k in SPLIT_KS:
            tile = replace(base, split_k=split_k)
            if gemm.k >= split_k * base.block_k and (us := _time_tile(gemm, tile, copies)):
                times[tile] = us
    for base in sorted(times, key=times.get)[:2]:
        for warps, stages in itertools.product((2, 4, 8), (2, 3, 4, 5)):
            tile = replace(base, num_warps=warps, num_stages=stages)
            if tile not in times and (us := _time_tile(gemm, tile, copies)) is not None:
                times[tile] = us
    best = min(times, key=times.get)
    chosen = choose_tile(rows, gemm.n, gemm.k, weight_is_kn=gemm.weight_is_kn)
    if chosen is not None and gemm.activation == "silu_mul":  # as layers.Projection takes it
        chosen = gated_tile(chosen, gemm.dtype.itemsize)
    if chosen not in times:
        times[chosen] = _time_tile(gemm, chosen, copies) or float("nan")
    weight_bytes = gemm.k * gemm.n * 2
    row = {
        "model": gemm.model, "gemm": gemm.name, "M": rows, "N": gemm.n, "K": gemm.k,
        "torch us": torch_us, "best us": times[best], "best tile": str(best),
        "x torch": torch_us / times[best], "chosen tile": str(chosen),
        "chosen us": times[chosen], "chosen x torch": torch_us / times[chosen],
        "weight GB/s (best)": weight_bytes / times[best] / 1e3,
        "sweep": {str(t): us for t, us in sorted(times.items(), key=lambda kv: kv[1])[:10]},
    }  # fmt: skip
    print_now(
        f"  {gemm.model} {gemm.name} M={rows}: torch {torch_us:.2f} us, best {times[best]:.2f} "
        f"({best}), chosen {times[chosen]:.2f} ({chosen}), {len(times)} tiles timed"
    )
    return row


def bench_prefill_gelu(rows: int, gen: torch.Generator) -> dict:
    """GPT-2's fc + GELU above kernels.linear's rows (prefill): addmm then a GELU kernel,
    against cuBLASLt's bias + GELU epilogue (torch._addmm_activation, the model's path)."""
    gemm = next(g for g in GEMMS["gpt2"] if g.activation == "gelu_tanh")
    copies = _inputs(gemm, rows, gen)
    separate = graph_time_us([_torch_fn(gemm, *c) for c in copies])
    epilogue = graph_time_us(
        [lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w, use_gelu=True)
         for x, w, b, _ in copies]
    )  # fmt: skip
    x, w, bias, _ = copies[0]
    want = linear_ref(x, w, bias, weight_is_kn=True, activation="gelu_tanh").float()
    err = [
        (fn().float() - want).abs().max().item()
        for fn in (_torch_fn(gemm, *copies[0]),
                   lambda: torch._addmm_activation(bias, x, w, use_gelu=True))
    ]  # fmt: skip
    print_now(
        f"  gpt2 c_fc+gelu M={rows}: addmm + GELU {separate:.1f} us, epilogue {epilogue:.1f} us;"
        f" max error against fp32 {err[0]:.4f} / {err[1]:.4f}"
    )
    return {"M": rows, "addmm+gelu us": separate, "epilogue us": epilogue,
            "max err addmm+gelu": err[0], "max err epilogue": err[1]}  # fmt: skip


def _fold_copy(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One copy of a GPT-2 fp16 block's operands at a sublayer boundary."""

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).half().cuda()

    hidden = 768
    return {
        "o": rand(rows, hidden), "f": rand(rows, 4 * hidden, scale=0.5),
        "residual": rand(rows, hidden),
        "c_proj": rand(hidden, hidden, scale=hidden**-0.5), "c_proj.b": rand(hidden, scale=0.1),
        "fc": rand(hidden, 4 * hidden, scale=hidden**-0.5), "fc.b": rand(4 * hidden, scale=0.1),
        "proj": rand(4 * hidden, hidden, scale=(4 * hidden) ** -0.5),
        "proj.b": rand(hidden, scale=0.1),
        "c_attn": rand(hidden, 3 * hidden, scale=hidden**-0.5),
        "c_attn.b": rand(3 * hidden, scale=0.1),
        "ln.w": 1 + rand(hidden, scale=0.1), "ln.b": rand(hidden, scale=0.1),
    }  # fmt: skip


def _fold_copies(rows: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Enough copies of the boundary's operands to rotate over (bench.kernels.num_copies)."""
    first = _fold_copy(rows, gen)
    copy_bytes = sum(t.numel() * t.element_size() for t in first.values())
    return [first] + [_fold_copy(rows, gen) for _ in range(num_copies(copy_bytes) - 1)]


def _boundary(
    c: dict, into_mlp: bool, folded: bool, tiles: tuple[Tile | None, Tile | None] = (None, None)
) -> Callable[[], object]:
    """A sublayer's last projection, the residual add and norm, and the next sublayer's
    first projection: c_proj -> ln_2 -> c_fc + GELU, or mlp.c_proj -> ln_1 -> c_attn.
    tiles: the two projections' (choose_tile's where None)."""
    src, last, first, act = (
        ("o", "c_proj", "fc", "gelu_tanh") if into_mlp else ("f", "proj", "c_attn", "none")
    )
    norm = (c["ln.w"], c["ln.b"], 1e-5)
    last_w, last_b, first_w, first_b = c[last], c[f"{last}.b"], c[first], c[f"{first}.b"]
    folded_norm = fold_layer_norm(*norm, first_w, first_b)

    def apart():
        y = linear(c[src], last_w, last_b, weight_is_kn=True)
        normed, _ = fused_add_layer_norm(y, c["residual"], *norm)
        return linear(normed, first_w, first_b, weight_is_kn=True, activation=act)

    def fused():
        stats = linear_add(c[src], last_w, last_b, c["residual"], tile=tiles[0])
        return linear_norm(c["residual"], folded_norm, stats, activation=act, tile=tiles[1])

    return fused if folded else apart


def bench_fold(rows: int, gen: torch.Generator) -> list[dict]:
    """GPT-2's two sublayer boundaries as three launches (projection, add + LayerNorm,
    projection) and as two (linear_add, then linear_norm with the norm folded in)."""
    copies = _fold_copies(rows, gen)
    out = []
    for into_mlp in (True, False):
        c = copies[0]
        residual = c["residual"].clone()
        want = _boundary(c, into_mlp, False)()
        c["residual"].copy_(residual)
        err = (_boundary(c, into_mlp, True)().float() - want.float()).abs().max().item()
        c["residual"].copy_(residual)
        row = {
            "M": rows,
            "boundary": "c_proj > ln_2 > c_fc" if into_mlp else "mlp.c_proj > ln_1 > c_attn",
            "3 launches us": graph_time_us([_boundary(c, into_mlp, False) for c in copies]),
            "2 launches us": graph_time_us([_boundary(c, into_mlp, True) for c in copies]),
            "max abs diff": err,
        }
        print_now("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items()))  # fmt: skip
        out.append(row)
    return out


# Candidate tiles of the folded boundary's two launches (--fold-sweep).
FOLD_PRODUCER_TILES = [
    Tile(64, 32, 128, 8, 5), Tile(64, 64, 128, 4, 4), Tile(64, 64, 128, 8, 5),
    Tile(64, 64, 128, 4, 5, split_k=2), Tile(32, 64, 128, 4, 4),
]  # fmt: skip
FOLD_CONSUMER_TILES = [
    Tile(64, 64, 64, 4, 5), Tile(64, 64, 128, 4, 4), Tile(64, 128, 64, 4, 4),
    Tile(64, 128, 128, 8, 4), Tile(128, 64, 64, 8, 4), Tile(64, 32, 128, 8, 5),
    Tile(32, 64, 128, 4, 4),
]  # fmt: skip


def bench_fold_sweep(rows: int, gen: torch.Generator) -> list[dict]:
    """The folded boundaries over FOLD_PRODUCER_TILES x FOLD_CONSUMER_TILES (tiles that
    split K only where the producer is mlp.c_proj), against choose_tile's pair."""
    copies = _fold_copies(rows, gen)
    out = []
    for into_mlp in (True, False):
        name = "c_proj > ln_2 > c_fc" if into_mlp else "mlp.c_proj > ln_1 > c_attn"
        times = {}
        for pair in itertools.product([None, *FOLD_PRODUCER_TILES], [None, *FOLD_CONSUMER_TILES]):
            if into_mlp and pair[0] is not None and pair[0].split_k > 1:
                continue
            try:
                times[pair] = graph_time_us([_boundary(c, into_mlp, True, pair) for c in copies])
            except Exception as exc:  # out of shared memory for this tile: not a candidate
                print_now(f"    {pair}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        best = min(times, key=times.get)
        row = {"M": rows, "boundary": name, "chosen us": times[(None, None)],
               "best us": times[best], "best producer": str(best[0] or "chosen"),
               "best consumer": str(best[1] or "chosen")}  # fmt: skip
        ranked = sorted(times.items(), key=lambda kv: kv[1])[:5]
        print_now(f"  M={rows} {name}: chosen {times[(None, None)]:.2f} us; best: "
                  + "; ".join(f"{p or 'chosen'} + {q or 'chosen'} {us:.2f}"
                              for (p, q), us in ranked))  # fmt: skip
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,qwen3-0.6b")
    parser.add_argument("--gemms", default=None, help="only these names (comma-separated)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 256, 512])
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this")
    parser.add_argument(
        "--prefill-gelu", type=int, nargs="+", default=None, metavar="M",
        help="only time fc + GELU at these (prefill) row counts: separate GELU vs epilogue",
    )  # fmt: skip
    parser.add_argument(
        "--fold", action="store_true",
        help="only GPT-2's sublayer boundaries at --rows: norm and add apart or folded in",
    )  # fmt: skip
    parser.add_argument(
        "--fold-sweep", action="store_true", help="the folded boundaries' tiles, swept at --rows"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print_now(machine_description())
    gen = torch.Generator().manual_seed(0)
    if args.prefill_gelu:
        rows_out = [bench_prefill_gelu(m, gen) for m in args.prefill_gelu]
        write_json(args.out, {"machine": machine_description(), "prefill_gelu": rows_out})
        return
    if args.fold or args.fold_sweep:
        bench = bench_fold_sweep if args.fold_sweep else bench_fold
        rows_out = [r for m in args.rows for r in bench(m, gen)]
        print(markdown_table(rows_out, list(rows_out[0])))
        write_json(args.out, {"machine": machine_description(), "fold": rows_out})
        return
    start = time.monotonic()
    rows_out = []
    for model in args.models.split(","):
        gemms = [g for g in GEMMS[model] if not args.gemms or g.name in args.gemms.split(",")]
        for rows, gemm in itertools.product(args.rows, gemms):
            if time.monotonic() - start > args.budget_s:
                print_now(f"budget of {args.budget_s:.0f} s spent: stopping the sweep")
                break
            rows_out.append(bench_gemm(gemm, rows, gen))
    columns = ["model", "gemm", "M", "N", "K", "torch us", "best us", "best tile", "x torch",
               "chosen us", "chosen tile", "chosen x torch"]  # fmt: skip
    print(markdown_table(rows_out, columns))
    write_json(args.out, {"machine": machine_description(), "rows": rows_out})


if __name__ == "__main__":
    main()
