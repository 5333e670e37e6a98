"""Triton LayerNorm with torch's nn.LayerNorm semantics, plain and fused with the residual add.

    mean = mean(x.float()); var = mean((x.float() - mean) ** 2)    # biased, as torch
    out = ((x.float() - mean) * rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)

Everything is computed in float32 and rounded once to x.dtype, as torch's CUDA
layer_norm does (weight and bias may be any of fp32 / fp16 / bf16), so float32
matches torch to reduction order and half precision to ~1 ulp.

x is [num_tokens, hidden] with any row stride; the last dim must be contiguous. A
program owns ROWS rows of one BLOCK = next_pow2(hidden) tile each; the grid depends
on shapes only and nothing is read on the host, so every launch is CUDA-graph
capturable.

embed_add_layer_norm is GPT-2's embedding stage and first LayerNorm in one launch:
the same kernel gathers its two addends' rows from the position and token
embedding tables instead of reading them in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.rms_norm import row_tiling

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _layer_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr,
    x_rows_ptr, res_rows_ptr, res_out_ptr,  # GATHER: row indices of x and residual; the sum
    num_rows, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    col = tl.arange(0, BLOCK)
    col_mask = col < HIDDEN
    row_mask = row < num_rows
    mask = row_mask[:, None] & col_mask[None, :]
    row = row.to(tl.int64)
    x_row = row
    res_row = row
    if GATHER:
        x_row = tl.load(x_rows_ptr + row, mask=row_mask, other=0).to(tl.int64)
        res_row = tl.load(res_rows_ptr + row, mask=row_mask, other=0).to(tl.int64)
    x = tl.load(x_ptr + (x_row * stride_x)[:, None] + col[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # residual = x + residual, rounded to x.dtype as torch's add is.
        res_ptrs = residual_ptr + (res_row * stride_res)[:, None] + col[None, :]
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + (row * stride_res_out)[:, None] + col[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / HIDDEN  # [ROWS]
    centered = tl.where(col_mask[None, :], xf - mean[:, None], 0.0)
    variance = tl.sum(centered * centered, axis=1) / HIDDEN  # [ROWS]
    y = centered * tl.math.rsqrt(variance + eps)[:, None]
    w = tl.load(weight_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + (row * stride_out)[:, None] + col[None, :]
    tl.store(out_ptrs, (y * w[None, :] + b[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual: torch.Tensor | None,
    gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """gather: (x_rows, residual_rows, residual_out): rows are read at those indices of x
    and residual, and the sum goes to residual_out, as out does, in order."""
    assert x.dim() == 2, "x must be [T, hidden]"
    assert x.dtype in _DTYPES and weight.dtype in _DTYPES, "fp32, fp16 or bf16 only"
    assert bias.dtype in _DTYPES, "fp32, fp16 or bf16 only"
    hidden = x.shape[1]
    assert weight.shape == (hidden,) and weight.stride(0) == 1, "weight must be [hidden]"
    assert bias.shape == (hidden,) and bias.stride(0) == 1, "bias must be [hidden]"
    assert x.stride(1) == 1, "the normalised (last) dim of x must be contiguous"
    num_rows = x.shape[0] if gather is None else gather[0].shape[0]
    x_rows, res_rows, res_out = (x, x, residual) if gather is None else gather
    if gather is not None:
        assert residual is not None and x_rows.shape == res_rows.shape == (num_rows,)
        assert residual.shape[1] == hidden and residual.dtype == x.dtype, "residual must match x"
        assert res_out.shape == (num_rows, hidden) and res_out.dtype == x.dtype
        assert res_out.stride(1) == 1, "the last dim of residual_out must be contiguous"
    elif residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
    if residual is not None:
        assert residual.stride(1) == 1, "the last dim of residual must be contiguous"
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, hidden) and out.stride(1) == 1, "out: [T, hidden] contiguous"
    assert out.dtype == x.dtype, f"out must be {x.dtype} (torch's layer_norm keeps x.dtype)"
    block, rows, num_warps = row_tiling(hidden, x.element_size())
    if num_rows == 0:
        return out
    res = residual if residual is not None else x
    res_out = res_out if res_out is not None else x
    _layer_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, res, weight, bias, out,
        x_rows, res_rows, res_out,
        num_rows, eps,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        HIDDEN=hidden, BLOCK=block, ROWS=rows,
        ADD_RESIDUAL=residual is not None, GATHER=gather is not None,
        num_warps=num_warps, **pdl_launch(x.device, pdl),
    )  # fmt: skip
    return out


def layer_norm(
    x: torch.Tensor,  # [T, hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,  # [T, hidden], x.dtype, last dim contiguous
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """LayerNorm of every row over the last dim, one launch; returns out.

    out may be x itself (each program reads its rows before writing them).
    """
    return _launch(x, weight, bias, eps, out, residual=None, pdl=pdl)


def fused_add_layer_norm(
    x: torch.Tensor,  # [T, hidden], last dim contiguous
    residual: torch.Tensor,  # like x, same dtype; updated in place
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,  # [T, hidden], x.dtype, last dim contiguous
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; normed = layer_norm(residual)` in one launch.

    residual is overwritten with the sum (rounded to x.dtype, as torch's add), and
    the normalised sum is returned with it: (normed, residual). out must not alias
    residual; it may alias x.
    """
    normed = _launch(x, weight, bias, eps, out, residual=residual, pdl=pdl)
    return normed, residual


def embed_add_layer_norm(
    ids: torch.Tensor,  # [T] int: token rows of wte
    positions: torch.Tensor,  # [T] int: rows of wpe
    wte: torch.Tensor,  # [vocab, hidden], last dim contiguous
    wpe: torch.Tensor,  # [max_positions, hidden], wte's dtype
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,  # [hidden]
    eps: float,
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, residual), [T, hidden] each
    """`residual = wpe[positions] + wte[ids]; normed = layer_norm(residual)` in one launch:
    GPT-2's embedding sum and its first block's ln_1."""
    residual = torch.empty((ids.shape[0], wte.shape[1]), dtype=wte.dtype, device=wte.device)
    normed = _launch(wpe, weight, bias, eps, None, wte, gather=(positions, ids, residual), pdl=pdl)
    return normed, residual


def embed_add_layer_norm_ref(
    ids: torch.Tensor,
    positions: torch.Tensor,
    wte: torch.Tensor,
    wpe: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = wpe[positions] + wte[ids]
    return layer_norm_ref(residual, weight, bias, eps), residual


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """nn.LayerNorm over the last dim, computed in float32 and rounded to x.dtype."""
    xf = x.to(torch.float32)
    normed = F.layer_norm(xf, (x.shape[-1],), weight.to(torch.float32), bias.to(torch.float32), eps)
    return normed.to(x.dtype)


def fused_add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = h + x; normed = norm(h)`, with h (residual) updated in place."""
    residual.copy_(x + residual)
    return layer_norm_ref(residual, weight, bias, eps), residual
