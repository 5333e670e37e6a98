"""Can decode attention's memory stream share the GPU with a layer's projections?

The question behind a two-batch overlap of the decode step (issue 4's gpt2 4x):
a 256-row gpt2 step is ~0.48 ms of attention (a memory stream at ~90% of the read
bandwidth) and ~0.35 ms of projections (latency-bound launches, far from the
tensor cores' peak). Run one half-batch's attention beside the other half's
projections and the step would shrink toward the larger of the two, if both
kernels can hold the GPU together. The twelfth and fifteenth sessions found they
do not with the engine's kernels: the attention's grid fills every SM.

What is at stake (BENCHMARKS.md's figures): a layer is ~40 us of attention and
~30 us of projections at 256 rows, ~20 and ~25 at 128 (projections barely shrink
with rows: they sit at their latency floor). Two halves whose projections never run
at once cost at least 2 x 25 = 50 us a layer (0.65 ms a step, ~3.5x HF in issue 4's
run); only if the halves' projections and attentions all run beside each other
does a layer near max(30, 40) us (0.54 ms a step, ~4.0x). So the overlap must hide
nearly all of the shorter side to matter.

This benchmark measures the two conditions an overlap needs, each graph-timed:
  1. A read that holds part of the GPU: a persistent grid of P programs, each with
     UNROLL independent CHUNK-element loads in flight, against the full grid. How few
     programs per SM still read at full bandwidth?
  2. Concurrency: that read, the engine's decode attention (full grid) and a candidate
     attention that needs few programs (`group_attention`, below) on one stream
     beside one gpt2 layer's four projections (kernels.linear, the engine's tiles) on
     another, forked and joined inside one CUDA graph, against each alone; and two
     layers' projections beside each other (the other half's). "hidden %" is how much
     of the shorter one the pair saved: (a + b - both) / min(a, b).

The candidate (`group_attention`): a program per (sequence, group of HEADS heads), or
a persistent grid over them when given fewer programs; its tile a whole KV block of
the group's heads (BLOCK_SIZE tokens x HEADS x head_dim: 8 KiB of K for gpt2 at 4
heads), STAGES blocks in flight through shared memory (Triton's pipeliner, cp.async).
Few programs then keep many bytes in flight each, which the engine's (row, head)
programs of 2-4 KiB tiles cannot. The products run on the CUDA cores (a query row
per head; the tensor cores stay free for the projections beside it). MHA only
(gpt2), no append: an experiment, not the engine's kernel. Compiled for sm_90 on a
CPU (ptxas -v), 4 heads / 4 warps / 3 stages take 168 registers a thread (21.5K a
program, a third of an SM's) and 36 KiB of shared memory, no spills; 2 heads, 80 and 18.

    python -m bench.overlap --rows 128 256 --out overlap.json

Result (H200, 2026-11-27; BENCHMARKS.md, "Can decode attention share the GPU with the
projections?"): the read needs ~8 programs per SM for ~3.5 TB/s, and at that many it
hides only about half of the projections. The engine's attention hides 17%. The
candidate reads at 760-1,280 GB/s. Two halves with their attention and projections
overlapped would cost more per layer than one whole batch (76.8 against 64.8 us at 256
rows), so the decode step keeps one batch on one stream.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench import kernels as bk
from bench.common import markdown_table, write_json

CHUNK = 2048  # fp16 elements per load of a program: 4 KiB
CONTEXT = 192  # the mean context of issue 4's run (prompt 128, 128 new tokens)
LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2


@triton.jit
def stream_read(x_ptr, out_ptr, n, span, CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    """Program p sums x[p * span, (p + 1) * span), UNROLL independent loads per iteration."""
    start = tl.program_id(0) * span
    end = tl.minimum(start + span, n)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), tl.float32)
    for base in range(start, end, CHUNK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = base + u * CHUNK + offs
            acc += tl.load(x_ptr + o, mask=o < end, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def group_decode_attention(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, slot_mapping_ptr, context_lens_ptr,
    out_ptr, qk_scale, num_items,
    stride_q_row, stride_cache_block, stride_cache_slot, stride_bt, stride_out_row,
    NUM_GROUPS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Item i is (row i // NUM_GROUPS, heads (i % NUM_GROUPS) * HEADS ...); program p
    takes items p, p + programs, ...; a tile is one KV block of the item's heads."""
    g = tl.arange(0, HEADS)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_SIZE)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        row = item // NUM_GROUPS
        hd = (item % NUM_GROUPS) * HEADS * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :]  # [H, D]
        tile = n[:, None, None] * stride_cache_slot + hd[None, :, :]  # [BLOCK_SIZE, H, D]
        ctx_len = tl.load(context_lens_ptr + row)
        bt_row = block_table_ptr + tl.load(slot_mapping_ptr + row).to(tl.int64) * stride_bt
        q = tl.load(q_ptr + row * stride_q_row + hd).to(tl.float32) * qk_scale  # [H, D]
        m_i = tl.full([HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([HEADS], tl.float32)
        acc = tl.zeros([HEADS, HEAD_DIM], tl.float32)
        # Pipelined through shared memory (cp.async, STAGES blocks in flight): a block is
        # allocated whole, so its loads need no mask; positions past ctx_len score -inf.
        for b in tl.range(0, tl.cdiv(ctx_len, BLOCK_SIZE), num_stages=STAGES):
            base = tl.load(bt_row + b).to(tl.int64) * stride_cache_block
            k = tl.load(k_cache_ptr + base + tile).to(tl.float32)
            v = tl.load(v_cache_ptr + base + tile).to(tl.float32)
            s = tl.sum(k * q[None, :, :], axis=2)  # [BLOCK_SIZE, H], log2 domain
            s = tl.where((b * BLOCK_SIZE + n < ctx_len)[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])  # [BLOCK_SIZE, H]
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_out_row + hd, out.to(out_ptr.dtype.element_ty))


def group_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_heads, head_dim]: MHA
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [B]
    context_lens: torch.Tensor,  # [B], the cache holding every position (no append)
    scale: float,
    out: torch.Tensor,  # [B, num_heads, head_dim]
    heads: int = 4,  # heads per item, a power of 2 dividing num_heads
    programs: int | None = None,  # default: one per item
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """group_decode_attention's launch: what kernels.reference.paged_decode_attention_ref
    computes, for MHA caches of q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    assert k_cache.shape[2] == num_heads, "MHA only"
    assert num_heads % heads == 0 and heads & (heads - 1) == 0, "heads: a power of 2 dividing"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(2) == head_dim and q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    num_items = num_rows * (num_heads // heads)
    group_decode_attention[(programs or num_items,)](
        q, k_cache, v_cache, block_table, slot_mapping, context_lens, out,
        scale * LOG2E, num_items,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), block_table.stride(0), out.stride(0),
        NUM_GROUPS=num_heads // heads, HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out


def read_fn(x: torch.Tensor, out: torch.Tensor, programs: int, unroll: int, warps: int):
    per_iter = CHUNK * unroll
    span = -(-x.numel() // (programs * per_iter)) * per_iter
    return lambda: stream_read[(programs,)](
        x, out, x.numel(), span, CHUNK=CHUNK, UNROLL=unroll, num_warps=warps
    )


def projections_fn(
    rows: int, hidden: int, dtype: torch.dtype, split_k: bool = True, seed: int = 0
) -> Callable[[], None]:
    """One gpt2 layer's four projections at `rows` rows, as the engine launches them
    (kernels.linear with the tile table's tiles; GELU fused into c_fc). split_k=False
    runs mlp.c_proj's tile unsplit: split launches share the device's semaphores, so two
    chains on two streams must not both split."""
    from kernels.linear import linear
    from kernels.linear_tiles import choose_tile

    gen = torch.Generator(device=bk.DEVICE).manual_seed(rows * 1000 + seed)

    def w(k: int, n: int) -> torch.Tensor:
        return bk._randn((k, n), dtype, gen) * k**-0.5

    x = bk._randn((rows, hidden), dtype, gen)
    w_attn, w_o, w_fc, w_proj = (
        w(hidden, 3 * hidden),
        w(hidden, hidden),
        w(hidden, 4 * hidden),
        w(4 * hidden, hidden),
    )
    qkv = torch.empty(rows, 3 * hidden, dtype=dtype, device=bk.DEVICE)
    o = torch.empty(rows, hidden, dtype=dtype, device=bk.DEVICE)
    h = torch.empty(rows, 4 * hidden, dtype=dtype, device=bk.DEVICE)
    y = torch.empty(rows, hidden, dtype=dtype, device=bk.DEVICE)
    proj_tile = choose_tile(rows, hidden, 4 * hidden)
    if proj_tile is not None and not split_k:
        proj_tile = dataclasses.replace(proj_tile, split_k=1)

    def run() -> None:
        linear(x, w_attn, weight_is_kn=True, out=qkv)
        linear(qkv[:, :hidden], w_o, weight_is_kn=True, out=o)
        linear(o, w_fc, weight_is_kn=True, activation="gelu_tanh", out=h)
        linear(h, w_proj, weight_is_kn=True, out=y, tile=proj_tile)

    return run


def _attention_inputs(rows: int):
    """paged_decode_attention's arguments over one gpt2 layer's cache at `rows` x CONTEXT,
    an output buffer, and the reference's first rows (bench.kernels' cached inputs)."""
    shape = bk.SHAPES[0]
    caches, block_table, slot_mapping, q, context_lens, _, expect = bk._decode_inputs(
        shape, rows, CONTEXT
    )
    k, v = caches[0]
    args = (q, k, v, block_table, slot_mapping, context_lens, shape.head_dim**-0.5)
    return args, torch.empty_like(q), expect


def _checked(fn: Callable[[], object], out: torch.Tensor, expect: torch.Tensor):
    """fn, once run on a poisoned out and compared with the reference's rows."""
    out.fill_(float("nan"))
    fn()
    torch.testing.assert_close(out[: len(expect)], expect, atol=1e-2, rtol=1e-2)
    return fn


def engine_attention(rows: int) -> Callable[[], object]:
    """The engine's decode attention (its full grid) at `rows` x CONTEXT."""
    from kernels.decode_attention import paged_decode_attention

    args, out, expect = _attention_inputs(rows)
    return _checked(
        lambda: paged_decode_attention(*args, out=out, max_context_len=CONTEXT), out, expect
    )


def candidate_attention(
    rows: int, heads: int, programs: int | None, num_warps: int, num_stages: int
) -> Callable[[], object]:
    """group_attention over the same inputs as engine_attention's."""
    args, out, expect = _attention_inputs(rows)
    return _checked(
        lambda: group_attention(*args, out, heads, programs, num_warps, num_stages), out, expect
    )


def forked(a: Callable[[], object], b: Callable[[], object], side: torch.cuda.Stream):
    """a on the current stream, b on `side`, forked and joined (graph-capturable)."""

    def run() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            b()
        a()
        main.wait_stream(side)

    return run


def pair_row(name: str, a: Callable, b: Callable, side: torch.cuda.Stream, b_us: float) -> dict:
    a_us = bk.graph_time_us([a])
    both_us = bk.graph_time_us([forked(a, b, side)])
    hidden = (a_us + b_us - both_us) / min(a_us, b_us)
    return {"stream": name, "alone us": a_us, "projections us": b_us, "both us": both_us,
            "serial us": a_us + b_us, "hidden %": 100 * hidden}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--unroll", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--warps", type=int, default=4, help="the read's warps")
    parser.add_argument("--group-heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--group-stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--group-warps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from kernels.decode_attention import num_sms

    torch.backends.cuda.matmul.allow_tf32 = False
    sms = num_sms(torch.device(bk.DEVICE))
    shape = bk.SHAPES[0]
    side = torch.cuda.Stream()
    read_rows, pair_rows = [], []
    for rows in args.rows:
        num_bytes = 2 * rows * CONTEXT * shape.kv_row_bytes  # K and V of one layer
        x = torch.randn(num_bytes // 2, device=bk.DEVICE).half()
        out = torch.empty(sms * max(args.per_sm) * 64, dtype=torch.float32, device=bk.DEVICE)
        hidden = shape.num_heads * shape.head_dim
        proj = projections_fn(rows, hidden, shape.dtype)
        proj_us = bk.graph_time_us([proj])
        full = -(-x.numel() // (CHUNK * 4))
        cases = [("full grid", full, 4)] + [
            (f"{p}/SM", sms * p, u) for p in args.per_sm for u in args.unroll
        ]
        for name, programs, unroll in cases:
            fn = read_fn(x, out, programs, unroll, args.warps)
            row = pair_row(f"read {name}, unroll {unroll}", fn, proj, side, proj_us)
            row |= {"rows": rows, "GB/s alone": num_bytes / row["alone us"] / 1e3}
            bk.print_now(row)
            read_rows.append(row)
        # The two halves' projections beside each other (both unsplit), against one alone.
        halves = [projections_fn(rows, hidden, shape.dtype, False, seed) for seed in (1, 2)]
        row = pair_row("projections (unsplit)", *halves, side, bk.graph_time_us([halves[1]]))
        row |= {"rows": rows}
        bk.print_now(row)
        pair_rows.append(row)
        w = args.group_warps
        candidates = [("decode attention (engine)", engine_attention(rows))] + [
            (f"group attention, {h} heads, {p or 'item'} programs, {w}w/{st}s",
             candidate_attention(rows, h, p, w, st))
            for h in args.group_heads for p in (None, sms, 2 * sms) for st in args.group_stages
        ]  # fmt: skip
        for name, fn in candidates:
            row = pair_row(name, fn, proj, side, proj_us)
            row |= {"rows": rows, "GB/s alone": num_bytes / row["alone us"] / 1e3}
            bk.print_now(row)
            pair_rows.append(row)
        del x
    columns = ["rows", "stream", "alone us", "GB/s alone", "projections us", "both us",
               "serial us", "hidden %"]  # fmt: skip
    print(markdown_table(read_rows + pair_rows, columns))
    write_json(args.out, {"reads": read_rows, "attention": pair_rows})


if __name__ == "__main__":
    main()
