"""Triton linear layer for small batches: out = act(x @ W + bias), in fp16 / bf16.

A decode step of a GPT-2-sized model multiplies a few hundred rows by weights of
768 x 768 to 768 x 3072. cuBLAS picks tiles made for large M there, so a GEMM
runs on a few dozen of the GPU's SMs and takes ~6 us for ~1 us of weight bytes.
This kernel tiles small: one program per (BLOCK_M rows, BLOCK_N columns), the
whole K loop in registers with an fp32 accumulator, and the bias and activation
applied before the one rounding to the output dtype (GELU-tanh fused here saves
a launch and a round trip of the [M, 4 * hidden] activation).

W is addressed through strides, so both layouts work: GPT-2's Conv1D stores
[K, N] (stride_wk = N, stride_wn = 1) and nn.Linear stores [N, K]
(stride_wk = 1, stride_wn = K). The grid depends on shapes only and nothing is
read on the host: every launch is CUDA-graph capturable.

Split K (Tile.split_k > 1): a program's K loop is serial, a chain of dependent
loads, so with few tiles per SM a small GEMM takes the latency of the whole
chain. Split, each (tile, K slice) program writes its fp32 partial to a
workspace and counts itself in on the tile's semaphore; the last one to arrive
sums the partials in slice order (the same sum whatever the arrival order: the
result is deterministic), applies bias and activation and writes the output,
then resets the semaphore for the next launch. The semaphores live in one
zeroed buffer per device, made on the first split launch, which must not be
inside a CUDA graph capture (the model's warm-up forward runs first).

The decode step's LayerNorms and residual adds ride on the projections around
them. `linear_add` adds its product to the residual stream in the epilogue, in
place, and writes the new rows' LayerNorm statistics, per column tile (mean and
centred sum of squares: `RowStats`). `linear_norm` is the projection after the
norm, with the norm folded in (`fold_layer_norm`, once, at load):

    layer_norm(x) @ W + b = rstd * (x @ (gamma * W) - mean * colsum) + (b + beta @ W)

with colsum the column sums of gamma * W, and mean and rstd merged from the
producer's partials in the epilogue. The K loop is the plain one over x as the
residual stream holds it. A GPT-2 block is then c_attn, attention, c_proj, c_fc
and mlp.c_proj: five launches where a separate add + LayerNorm kernel made seven.
An RMSNorm (the Llama family) folds the same way with neither mean term nor beta
(`fold_rms_norm`): rms_norm(x) @ W + b = rstd * (x @ (gamma * W)) + b, its rstd from
the mean square, which is the merged variance plus the squared mean.

The Llama family's gated MLP rides on its gate_up projection too (activation
"silu_mul"): W's 2I output columns are gate then up, and a program of output columns
n0..n0+BN keeps two accumulators over one K loop, the same x tile against W's columns
n0.. (gate) and I+n0.. (up). The norm's epilogue and the bias (b[n] and b[I+n]) apply
to each, then silu(gate) * up in float32 and the one rounding: the output has I
columns, and no silu_and_mul launch reads the [M, 2I] product back. Two W tiles per
stage take more shared memory, so the tile is the table's for the [2I, K] weight with
half its columns, the stages cut where they would not fit (kernels.linear_tiles.gated_tile).
Split K works as above, each slice's partial row holding both halves.

`choose_tile(M, N, K)` (kernels.linear_tiles) is the tile table, measured on an H200;
`linear` uses it unless a tile is given (a sweep gives one). On Hopper the kernel takes
part in the decode step's launch overlap (kernels.pdl), but for a split launch of a few
rows of [N, K] weights (measured slower there: `overlap_mode`; GPT-2's few-row launches
trigger the next one after their K loop): the next kernel touches memory only after this
grid completed, so a split launch's semaphores are back at zero for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear_tiles import Tile, choose_tile, gated_tile
from kernels.pdl import pdl_launch, pdl_prologue, pdl_trigger

_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = ("none", "gelu_tanh", "silu_mul")


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); |x| > 15 is +-1 in float32 already.
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, semaphore_ptr,
    residual_ptr, stats_out_ptr, stats_in_ptr, colsum_ptr, eps,
    num_rows, N, K, stride_xm, stride_wk, stride_wn, stride_om, stride_rm,
    num_norm_tiles, norm_tile_cols,
    HAS_BIAS: tl.constexpr, GELU_TANH: tl.constexpr, GATED: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, STATS_OUT: tl.constexpr, NORM_TILES_P2: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr, TRIGGER_LATER: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL, TRIGGER_LATER)  # kernels.pdl; TRIGGER_LATER: after the K loop
    # Programs along N are adjacent in launch order, so the x rows of one program
    # row stay in L2 while every column tile of W streams through once per row tile.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    if NORM_TILES_P2 > 0:  # loaded here, used after the K loop: their latency overlaps it
        tiles = tl.arange(0, NORM_TILES_P2)
        stats_mask = row_mask[:, None] & (tiles < num_norm_tiles)[None, :]
        stats_ptrs = stats_in_ptr + (rows.to(tl.int64) * num_norm_tiles * 2)[:, None] + tiles * 2
        tile_mean = tl.load(stats_ptrs, mask=stats_mask, other=0.0)
        tile_m2 = tl.load(stats_ptrs + 1, mask=stats_mask, other=0.0)
        if not RMS:
            colsum = tl.load(colsum_ptr + cols, mask=col_mask, other=0.0)
            if GATED:
                colsum_up = tl.load(colsum_ptr + N + cols, mask=col_mask, other=0.0)
    # This program's K slice: whole BLOCK_K steps, so only the end of K is masked.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    ks = k_begin + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + ks[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:  # W's columns N + cols: the up half, on the same x tile
        w_up_ptrs = w_ptr + ks[:, None] * stride_wk + (cols + N).to(tl.int64)[None, :] * stride_wn
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = (k0 - k_begin + ks) < K
        w_mask = k_mask[:, None] & col_mask[None, :]
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if GATED:
            up = tl.dot(a, tl.load(w_up_ptrs, mask=w_mask, other=0.0), up)
            w_up_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    pdl_trigger(PDL, TRIGGER_LATER)
    writes = row_mask  # the rows this program writes: all, or none but for split K's last
    if SPLIT_K > 1:
        # A partial row holds the N gate columns, then, gated, the N up columns.
        partial_cols = 2 * N if GATED else N
        partial_ptrs = partial_ptr + rows.to(tl.int64)[:, None] * partial_cols + cols[None, :]
        own_ptrs = partial_ptrs + pid_k * num_rows * partial_cols
        tl.store(own_ptrs, acc, mask=row_mask[:, None] & col_mask)
        if GATED:
            tl.store(own_ptrs + N, up, mask=row_mask[:, None] & col_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        semaphore = semaphore_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(semaphore, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        writes = writes & last  # the others are done: only the last one goes on
        for split in tl.static_range(SPLIT_K):  # slice order: a deterministic sum
            split_ptrs = partial_ptrs + split * num_rows * partial_cols
            split_mask = writes[:, None] & col_mask[None, :]
            acc += tl.load(split_ptrs, mask=split_mask, other=0.0, cache_modifier=".cg")
            if GATED:
                up += tl.load(split_ptrs + N, mask=split_mask, other=0.0, cache_modifier=".cg")
        tl.store(semaphore, 0, mask=last)  # zero again for the next launch
    out_mask = writes[:, None] & col_mask[None, :]
    if NORM_TILES_P2 > 0:
        # The row's mean and variance, merged from the producer's column tiles (Chan et
        # al.: each tile's centred sum of squares plus its count times its mean's
        # squared distance from the row's), then the folded norm's epilogue.
        counts = tl.minimum(norm_tile_cols, K - tiles * norm_tile_cols).to(tl.float32)
        counts = tl.where(tiles < num_norm_tiles, counts, 0.0)
        mean = tl.sum(tile_mean * counts[None, :], axis=1) / K
        spread = tile_mean - mean[:, None]
        m2 = tl.sum(tile_m2 + counts[None, :] * spread * spread, axis=1)
        if RMS:  # the mean square is the variance plus the squared mean
            rstd = tl.math.rsqrt(m2 / K + mean * mean + eps)
            acc = rstd[:, None] * acc
            if GATED:
                up = rstd[:, None] * up
        else:
            rstd = tl.math.rsqrt(m2 / K + eps)
            acc = rstd[:, None] * (acc - mean[:, None] * colsum[None, :])
            if GATED:
                up = rstd[:, None] * (up - mean[:, None] * colsum_up[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GELU_TANH:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + _tanh(inner))
    if GATED:  # silu(gate) * up in float32, rounded once below
        acc = acc / (1.0 + tl.exp(-acc)) * up
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:  # the rounded product plus the residual, rounded again: torch's add
        res_ptrs = residual_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :]
        res = tl.load(res_ptrs, mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, y, mask=out_mask)
    if STATS_OUT:  # this tile's share of the rows' LayerNorm statistics, as stored
        yf = tl.where(out_mask, y.to(tl.float32), 0.0)
        tile_cols = tl.minimum(N - pid_n * BLOCK_N, BLOCK_N).to(tl.float32)
        tile_mean = tl.sum(yf, axis=1) / tile_cols
        centred = tl.where(out_mask, yf - tile_mean[:, None], 0.0)
        stats_ptrs = stats_out_ptr + rows.to(tl.int64) * tl.num_programs(0) * 2 + pid_n * 2
        tl.store(stats_ptrs, tile_mean, mask=writes)
        tl.store(stats_ptrs + 1, tl.sum(centred * centred, axis=1), mask=writes)


MAX_SPLIT_TILES = 1 << 16  # output tiles of one split-K launch: one semaphore each


@functools.cache
def _semaphores(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kernels.linear: the first split-K launch on a device makes its semaphores; "
            "run it once outside CUDA graph capture (a warm-up forward) first"
        )
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class RowStats:
    """LayerNorm statistics of the rows of a [M, N] linear_add result, per column tile:
    partials[m, t] = (mean, centred sum of squares) of row m over tile t's tile_cols
    columns (the last tile may be narrower)."""

    partials: torch.Tensor  # [M, num_tiles, 2], float32
    tile_cols: int


@dataclass(frozen=True)
class FoldedNorm:
    """A norm folded into the linear after it: LayerNorm (gamma, beta, eps) into a [K, N]
    weight, or RMSNorm (gamma, eps) into either layout."""

    weight: torch.Tensor  # W's layout and dtype: gamma * W along K
    bias: torch.Tensor | None  # [N], float32: b + beta @ W (LayerNorm), b (RMSNorm)
    colsum: torch.Tensor | None  # [N], float32: weight's column sums (LayerNorm only)
    eps: float
    weight_is_kn: bool = True

    @property
    def rms(self) -> bool:
        return self.colsum is None


def fold_layer_norm(
    norm_weight: torch.Tensor,  # [K]: gamma
    norm_bias: torch.Tensor,  # [K]: beta
    eps: float,
    weight: torch.Tensor,  # [K, N]: W (GPT-2's Conv1D layout)
    bias: torch.Tensor | None,  # [N]
) -> FoldedNorm:
    """The operands of linear_norm for `linear(layer_norm(x, gamma, beta, eps), W, b)`."""
    k = weight.shape[0]
    assert weight.dim() == 2 and norm_weight.shape == norm_bias.shape == (k,), "W is [K, N]"
    w = weight.float()
    folded = (norm_weight.float()[:, None] * w).to(weight.dtype)
    folded_bias = norm_bias.float() @ w + (bias.float() if bias is not None else 0.0)
    return FoldedNorm(folded, folded_bias, folded.float().sum(0), eps)


def fold_rms_norm(
    norm_weight: torch.Tensor,  # [K]: gamma
    eps: float,
    weight: torch.Tensor,  # [K, N] when weight_is_kn, else [N, K] (nn.Linear)
    bias: torch.Tensor | None,  # [N]
    *,
    weight_is_kn: bool,
) -> FoldedNorm:
    """The operands of linear_norm for `linear(rms_norm(x, gamma, eps), W, b)`:
    rms_norm(x) @ W + b = rstd * (x @ (gamma * W)) + b."""
    k = weight.shape[0] if weight_is_kn else weight.shape[1]
    assert weight.dim() == 2 and norm_weight.shape == (k,), "gamma must match W's K"
    gamma = norm_weight.float()[:, None] if weight_is_kn else norm_weight.float()[None, :]
    folded = (gamma * weight.float()).to(weight.dtype)
    folded_bias = bias.float() if bias is not None else None
    return FoldedNorm(folded, folded_bias, None, eps, weight_is_kn)


# How a launch takes part in the decode step's launch overlap (kernels.pdl), by W's layout
# and rows. [K, N] (GPT-2) at LATE_TRIGGER_ROWS_KN rows or fewer: every launch joins it,
# and lets the next kernel launch only after its K loop. Step mean ms on an H200
# (bench.engine), gpt2 fp16 at batch 1 / 8 / 16 / 64: split launches ending the
# overlap, the rest triggering at the top 0.323 / 0.347 / 0.394 / 0.538; all joining,
# triggering at the top 0.406 / 0.466 / 0.475 / 0.537; all joining, triggering after the
# K loop 0.311 / 0.339 / 0.377 / 0.547. The Llama family's [N, K] weights were slower that
# way (qwen3-0.6b bf16 at 1 / 4 / 16: 0.934 / 0.996 / 1.12 against 0.958 / 1.02 / 1.18),
# and keep the trigger at the top; there a split-K launch of fewer than
# SPLIT_OVERLAP_MIN_ROWS_NK rows ends the overlap (batch 1 0.935 against 1.09 joining,
# 8 1.07 against 1.09, 16 1.19 against 1.11). Why is not known.
LATE_TRIGGER_ROWS_KN = 16
SPLIT_OVERLAP_MIN_ROWS_NK = 9


def overlap_mode(tile: Tile, num_rows: int, weight_is_kn: bool) -> str:
    """How the launch takes part in the overlap: "late" (joins it, triggers the next launch
    after its K loop), "early" (joins it, triggers at the top, as every other kernel of the
    step does) or "none" (ends it)."""
    if weight_is_kn:
        return "late" if num_rows <= LATE_TRIGGER_ROWS_KN else "early"
    if tile.split_k == 1 or num_rows >= SPLIT_OVERLAP_MIN_ROWS_NK:
        return "early"
    return "none"


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_is_kn: bool,
    activation: str,
    out: torch.Tensor | None,
    tile: Tile | None,
    residual: torch.Tensor | None = None,
    stats_out: bool = False,
    norm: tuple[FoldedNorm, RowStats] | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, RowStats | None]:
    assert x.dim() == 2 and weight.dim() == 2, "x and weight must be 2-D"
    assert x.dtype in _DTYPES and weight.dtype == x.dtype, "fp16 or bf16 only, one dtype"
    assert x.stride(1) == 1, "the last dim of x must be contiguous"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}"
    num_rows, k = x.shape
    if weight_is_kn:
        assert weight.shape[0] == k, "weight must be [K, N]"
        weight_cols, stride_wk, stride_wn = weight.shape[1], weight.stride(0), weight.stride(1)
    else:
        assert weight.shape[1] == k, "weight must be [N, K]"
        weight_cols, stride_wk, stride_wn = weight.shape[0], weight.stride(1), weight.stride(0)
    if bias is not None:
        assert bias.shape == (weight_cols,) and bias.is_contiguous(), "bias must be [N], contiguous"
    gated = activation == "silu_mul"
    assert not gated or weight_cols % 2 == 0, "silu_mul: W's N must be 2 * I, gate then up"
    n = weight_cols // 2 if gated else weight_cols  # the output's columns
    if tile is None:
        tile = choose_tile(num_rows, weight_cols, k, weight_is_kn=weight_is_kn)
        tile = tile or Tile(64, 64, 64, 4, 4)
        tile = gated_tile(tile, x.element_size()) if gated else tile
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n) and out.dtype == x.dtype, "out: [M, N], x.dtype"
    assert out.stride(1) == 1, "the last dim of out must be contiguous"
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(num_rows, tile.block_m), tile.split_k)
    stats = None
    if stats_out:
        partials = torch.empty(num_rows, grid[0], 2, dtype=torch.float32, device=x.device)
        stats = RowStats(partials, tile.block_n)
    if num_rows == 0:
        return out, stats
    partials = semaphores = out  # unused without split K
    if tile.split_k > 1:
        assert grid[0] * grid[1] <= MAX_SPLIT_TILES, "too many output tiles to split K"
        shape = (tile.split_k, num_rows, weight_cols)  # gated: a row's gate, then its up
        partials = torch.empty(shape, dtype=torch.float32, device=x.device)
        semaphores = _semaphores(x.device)
    mode = overlap_mode(tile, num_rows, weight_is_kn)
    launch_pdl = pdl_launch(x.device, pdl and mode != "none")
    folded, stats_in = norm if norm is not None else (None, None)
    num_norm_tiles = stats_in.partials.shape[1] if stats_in is not None else 0
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, partials, semaphores,
        residual if residual is not None else out, stats.partials if stats else out,
        stats_in.partials if stats_in else out,
        folded.colsum if folded and not folded.rms else out,
        folded.eps if folded else 0.0,
        num_rows, n, k, x.stride(0), stride_wk, stride_wn, out.stride(0),
        residual.stride(0) if residual is not None else 0,
        num_norm_tiles, stats_in.tile_cols if stats_in else 0,
        HAS_BIAS=bias is not None, GELU_TANH=activation == "gelu_tanh", GATED=gated,
        ADD_RESIDUAL=residual is not None, STATS_OUT=stats_out,
        NORM_TILES_P2=triton.next_power_of_2(num_norm_tiles) if num_norm_tiles else 0,
        RMS=folded is not None and folded.rms,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        SPLIT_K=tile.split_k, TRIGGER_LATER=mode == "late", num_warps=tile.num_warps,
        num_stages=tile.num_stages, **launch_pdl,
    )  # fmt: skip
    return out, stats


def linear(
    x: torch.Tensor,  # [M, K], fp16 or bf16; row stride arbitrary, last dim contiguous
    weight: torch.Tensor,  # [K, N] when weight_is_kn, else [N, K] (nn.Linear); x.dtype
    bias: torch.Tensor | None = None,  # [N]
    *,
    weight_is_kn: bool,
    activation: str = "none",
    out: torch.Tensor | None = None,  # [M, N] ([M, N / 2] for "silu_mul"), x.dtype
    tile: Tile | None = None,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """act(x @ W + bias) in one launch, accumulated in fp32 and rounded once; returns out.
    "silu_mul" takes W's N = 2I columns as gate then up and returns [M, I]; a tile given
    for it is launched as given (gated_tile fits the table's)."""
    return _launch(x, weight, bias, weight_is_kn, activation, out, tile, pdl=pdl)[0]


def linear_add(
    x: torch.Tensor,  # [M, K], fp16 or bf16; last dim contiguous
    weight: torch.Tensor,  # [K, N] when weight_is_kn, else [N, K]; x.dtype
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor,  # [M, N], x.dtype, last dim contiguous; updated in place
    *,
    weight_is_kn: bool = True,
    tile: Tile | None = None,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> RowStats:
    """`residual += x @ W + bias` in one launch, the product rounded to x.dtype before the
    add, as two torch ops round; returns the new rows' statistics for linear_norm."""
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    assert residual.shape == (x.shape[0], n), "residual must be [M, N]"
    tile = tile or choose_tile(x.shape[0], n, x.shape[1], True, weight_is_kn)
    return _launch(
        x, weight, bias, weight_is_kn, "none", residual, tile, residual, stats_out=True, pdl=pdl
    )[1]


def linear_norm(
    x: torch.Tensor,  # [M, K], fp16 or bf16; last dim contiguous: the rows stats describes
    folded: FoldedNorm,  # the norm and the linear, folded
    stats: RowStats,  # x's rows, from the linear_add that wrote them
    *,
    activation: str = "none",
    out: torch.Tensor | None = None,  # [M, N] ([M, N / 2] for "silu_mul"), x.dtype
    tile: Tile | None = None,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """act(norm(x) @ W + b) in one launch, the norm (LayerNorm or RMSNorm) folded into W
    and b (the module docstring's identities), from the statistics of x's rows; returns
    out. "silu_mul" normalises both halves, then silu(gate) * up (as linear's)."""
    assert stats.partials.shape[0] == x.shape[0], "stats must describe x's rows"
    assert stats.partials.shape[1] * stats.tile_cols >= x.shape[1], "stats must cover K"
    norm = (folded, stats)
    return _launch(
        x,
        folded.weight,
        folded.bias,
        folded.weight_is_kn,
        activation,
        out,
        tile,
        norm=norm,
        pdl=pdl,
    )[0]


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_is_kn: bool,
    activation: str = "none",
) -> torch.Tensor:
    """The same product in float32, rounded once to x.dtype."""
    w = weight.float() if weight_is_kn else weight.float().t()
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    if activation == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    if activation == "silu_mul":
        gate, up = y.chunk(2, dim=1)
        y = torch.nn.functional.silu(gate) * up
    return y.to(x.dtype)
