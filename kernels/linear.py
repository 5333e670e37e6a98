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

The decode step's norms and residual adds ride on the projections around them:
`norm` LayerNorms x's rows over K in the prologue (one unrolled pass of row
statistics, then each loaded x tile normalised before its product) and
`residual` adds the rounded result to the residual stream in the epilogue, in
place. A GPT-2 block is then c_attn, attention, c_proj, c_fc and mlp.c_proj:
five launches where a separate LayerNorm + residual-add kernel made seven.

Under PDL each program prefetches its slice of W into L2 (prefetch.global.L2, one
address per 128-byte line) after it lets its dependents launch and before it
waits for its predecessor: the weights are the step's constants, so their HBM
latency overlaps the previous kernel instead of heading this one's K loop.

`choose_tile(M, N, K)` is the tile table, measured on an H200 by bench.gemm;
`linear` uses it unless a tile is given (the benchmark's sweep gives one). On
Hopper the kernel takes part in the decode step's launch overlap (kernels.pdl):
the next kernel touches memory only after this grid completed, so a split
launch's semaphores are back at zero for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.pdl import pdl_launch

_DTYPES = (torch.float16, torch.bfloat16)
# A launch under PDL prefetches its slice of W into L2 before waiting on its predecessor
# (bench --no-weight-prefetch turns it off for A/B runs).
PREFETCH_WEIGHTS = True
ACTIVATIONS = ("none", "gelu_tanh")


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # K slices, each its own program; the last to finish reduces

    def __str__(self) -> str:
        split = f"/k{self.split_k}" if self.split_k > 1 else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}/{self.num_warps}w/{self.num_stages}s"
            + split
        )


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); |x| > 15 is +-1 in float32 already.
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _prefetch_l2(ptrs):
    # Fire and forget: the line holding each address is brought into L2. The dummy
    # output is what inline asm needs; is_pure=False keeps the instruction.
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, semaphore_ptr,
    norm_w_ptr, norm_b_ptr, residual_ptr, eps,
    num_rows, N, K, stride_xm, stride_wk, stride_wn, stride_om, stride_rm,
    HAS_BIAS: tl.constexpr, GELU_TANH: tl.constexpr,
    NORM_K: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PREFETCH_LINES_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Programs along N are adjacent in launch order, so the x rows of one program
    # row stay in L2 while every column tile of W streams through once per row tile.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # This program's K slice: whole BLOCK_K steps, so only the end of K is masked.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PDL:
        gdc_launch_dependents()
        if PREFETCH_LINES_N > 0:
            # The weights are constants of the step: this program's slice of W (rows of
            # W [K, N], one address per 128-byte line) goes to L2 while the previous
            # kernel still runs, so the K loop below starts on L2 hits, not HBM misses.
            lines = pid_n * BLOCK_N + tl.arange(0, PREFETCH_LINES_N) * (128 // 2)
            lines = tl.minimum(lines, N - 1)
            for k0 in range(k_begin, k_end, BLOCK_K):
                k_rows = tl.minimum(k0 + tl.arange(0, BLOCK_K), K - 1)
                _prefetch_l2(w_ptr + k_rows.to(tl.int64)[:, None] * stride_wk + lines[None, :])
        gdc_wait()  # the predecessor finished: x (and residual) are written
    row_mask = rows < num_rows
    col_mask = cols < N
    if NORM_K > 0:
        # LayerNorm of x's rows over all of K (every K slice needs the whole row):
        # one pass, each BLOCK_K chunk's mean and centred sum of squares merged into
        # the running ones (Chan et al.), unrolled so that the loads overlap.
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c0 in tl.static_range(0, NORM_K, BLOCK_K):
            count = tl.minimum(NORM_K - c0, BLOCK_K).to(tl.float32)  # the last may be short
            ks = c0 + tl.arange(0, BLOCK_K)
            chunk_mask = row_mask[:, None] & (ks < NORM_K)[None, :]
            chunk_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
            chunk = tl.load(chunk_ptrs, mask=chunk_mask, other=0.0).to(tl.float32)
            chunk_mean = tl.sum(chunk, axis=1) / count
            centred = tl.where(chunk_mask, chunk - chunk_mean[:, None], 0.0)
            delta = chunk_mean - mean
            mean += delta * (count / (c0 + count))
            m2 += tl.sum(centred * centred, axis=1) + delta * delta * (c0 * count / (c0 + count))
        rstd = tl.math.rsqrt(m2 / NORM_K + eps)
    ks = k_begin + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + ks[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = (k0 - k_begin + ks) < K
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM_K > 0:  # rounded to x's dtype, as the norm's output would be
            gamma = tl.load(norm_w_ptr + k0 - k_begin + ks, mask=k_mask, other=0.0)
            beta = tl.load(norm_b_ptr + k0 - k_begin + ks, mask=k_mask, other=0.0)
            normed = (a.to(tl.float32) - mean[:, None]) * rstd[:, None]
            normed = normed * gamma.to(tl.float32)[None, :] + beta.to(tl.float32)[None, :]
            a = normed.to(x_ptr.dtype.element_ty)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K > 1:
        partial_ptrs = partial_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(partial_ptrs + pid_k * num_rows * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        semaphore = semaphore_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(semaphore, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        out_mask = out_mask & last  # the others are done: only the last one goes on
        for split in tl.static_range(SPLIT_K):  # slice order: a deterministic sum
            acc += tl.load(
                partial_ptrs + split * num_rows * N, mask=out_mask, other=0.0, cache_modifier=".cg"
            )
        tl.store(semaphore, 0, mask=last)  # zero again for the next launch
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GELU_TANH:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + _tanh(inner))
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:  # the rounded product plus the residual, rounded again: torch's add
        res_ptrs = residual_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :]
        res = tl.load(res_ptrs, mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, y, mask=out_mask)


MAX_SPLIT_TILES = 1 << 16  # output tiles of one split-K launch: one semaphore each


@functools.cache
def _semaphores(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kernels.linear: the first split-K launch on a device makes its semaphores; "
            "run it once outside CUDA graph capture (a warm-up forward) first"
        )
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


MAX_ROWS = 256  # above this cuBLAS's large tiles have enough of them to fill the GPU


def choose_tile(num_rows: int, n: int, k: int) -> Tile | None:
    """The tile for an [num_rows, k] x [k, n] product, or None where cuBLAS is faster.

    From bench.gemm on an H200, GPT-2's projections. 2026-11-22 (M = 1..512): this
    table's tiles were within ~6% of the sweep's best; alone they match or beat
    cuBLAS up to M = 64 and trail it by up to 12% above (c_attn at M = 256: 6.5
    against 5.8 us); fc + GELU wins at every M, cuBLAS needing a separate GELU
    kernel. In the engine they also join the launch overlap (kernels.pdl): the
    gpt2 decode step at 256 rows took 0.925 ms against 0.977 with cuBLAS.
    2026-11-24 (M = 64 and 256, split K in the sweep): 8 warps / 5 stages took
    c_attn and fc at M = 64 from 5.3 / 5.8 us to 4.5 / 4.8, and attn.c_proj at
    M = 256 from 5.0 to 4.2; mlp.c_proj (a long K over a narrow N) at M = 64 in
    4 K slices took 6.6 us against cuBLAS's 7.5. At M = 256 it is 8.6 us in 2
    slices against cuBLAS's 7.9 alone, yet the engine's step was 0.2-0.7% shorter
    with it (three paired runs): a Triton kernel keeps the launch overlap going.
    cuBLAS keeps mlp.c_proj at M <= 16 (not measured split) and every M > 256
    (prefill).
    """
    if num_rows > MAX_ROWS:
        return None
    if k > 2 * n:
        if num_rows <= 16:
            return None
        if num_rows <= 64:
            return Tile(64, 64, 128, 4, 4, split_k=4)
        return Tile(64, 64, 128, 4, 5, split_k=2)
    if num_rows <= 16:
        return Tile(16, 32, 128, 4, 5)
    if num_rows <= 64:
        return Tile(64, 32, 128, 8, 5) if n >= 2048 else Tile(64, 32, 128, 4, 4)
    if n < 2048:
        return Tile(64, 32, 128, 8, 5)
    if num_rows <= 128:
        return Tile(64, 64, 128, 4, 4)
    return Tile(64, 64, 64, 4, 5)


def linear(
    x: torch.Tensor,  # [M, K], fp16 or bf16; row stride arbitrary, last dim contiguous
    weight: torch.Tensor,  # [K, N] when weight_is_kn, else [N, K] (nn.Linear); x.dtype
    bias: torch.Tensor | None = None,  # [N]
    *,
    weight_is_kn: bool,
    activation: str = "none",
    out: torch.Tensor | None = None,  # [M, N], x.dtype; last dim contiguous
    tile: Tile | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # LayerNorm (weight, bias, eps)
    residual: torch.Tensor | None = None,  # [M, N], x.dtype; last dim contiguous
) -> torch.Tensor:
    """act(norm(x) @ W + bias) + residual in one launch; returns out.

    The product is accumulated in fp32 and rounded once. With `norm`, x's rows are
    LayerNorm'd over K first, in fp32 and rounded to x.dtype: what a separate norm
    kernel would hand the GEMM. With `residual`, the rounded result is added to it
    and rounded again, as a separate add would; out may be residual itself (each
    element is read and written by the same program), which makes it an in-place
    residual add.
    """
    assert x.dim() == 2 and weight.dim() == 2, "x and weight must be 2-D"
    assert x.dtype in _DTYPES and weight.dtype == x.dtype, "fp16 or bf16 only, one dtype"
    assert x.stride(1) == 1, "the last dim of x must be contiguous"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}"
    num_rows, k = x.shape
    if weight_is_kn:
        assert weight.shape[0] == k, "weight must be [K, N]"
        n, stride_wk, stride_wn = weight.shape[1], weight.stride(0), weight.stride(1)
    else:
        assert weight.shape[1] == k, "weight must be [N, K]"
        n, stride_wk, stride_wn = weight.shape[0], weight.stride(1), weight.stride(0)
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), "bias must be [N], contiguous"
    norm_weight, norm_bias, eps = norm if norm is not None else (x, x, 0.0)
    if norm is not None:
        for name, t in (("norm weight", norm_weight), ("norm bias", norm_bias)):
            assert t.shape == (k,) and t.is_contiguous(), f"{name} must be [K], contiguous"
    if residual is not None:
        assert residual.shape == (num_rows, n) and residual.dtype == x.dtype, (
            "residual: [M, N], x.dtype"
        )
        assert residual.stride(1) == 1, "the last dim of residual must be contiguous"
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n) and out.dtype == x.dtype, "out: [M, N], x.dtype"
    assert out.stride(1) == 1, "the last dim of out must be contiguous"
    if num_rows == 0:
        return out
    tile = tile or choose_tile(num_rows, n, k) or Tile(64, 64, 64, 4, 4)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(num_rows, tile.block_m), tile.split_k)
    partials = semaphores = out  # unused without split K
    if tile.split_k > 1:
        assert grid[0] * grid[1] <= MAX_SPLIT_TILES, "too many output tiles to split K"
        partials = torch.empty(tile.split_k, num_rows, n, dtype=torch.float32, device=x.device)
        semaphores = _semaphores(x.device)
    # W's rows are prefetched (the [K, N] layout, one address per 128-byte line of a row).
    prefetch_lines_n = max(1, tile.block_n // 64) if PREFETCH_WEIGHTS and stride_wn == 1 else 0
    res = residual if residual is not None else out
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, partials, semaphores,
        norm_weight, norm_bias, res, eps,
        num_rows, n, k, x.stride(0), stride_wk, stride_wn, out.stride(0), res.stride(0),
        HAS_BIAS=bias is not None, GELU_TANH=activation == "gelu_tanh",
        NORM_K=k if norm is not None else 0, ADD_RESIDUAL=residual is not None,
        PREFETCH_LINES_N=prefetch_lines_n,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        SPLIT_K=tile.split_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_is_kn: bool,
    activation: str = "none",
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in float32, rounded to x.dtype where the kernel rounds (the norm's
    output, the product, the residual sum)."""
    if norm is not None:
        w, b, eps = norm
        x = F.layer_norm(x.float(), (x.shape[1],), w.float(), b.float(), eps).to(x.dtype)
    w = weight.float() if weight_is_kn else weight.float().t()
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    y = y.to(x.dtype)
    return y if residual is None else (y.float() + residual.float()).to(x.dtype)
