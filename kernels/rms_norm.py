"""Triton RMSNorm with Hugging Face LlamaRMSNorm semantics, plain and fused with the residual add.

    y = x.float() * rsqrt(mean(x.float() ** 2) + eps)
    out = weight * y.to(x.dtype)            # in torch.promote_types(weight.dtype, x.dtype)

Every rounding torch performs is reproduced in the kernel (the sum of squares is
accumulated in float32, y is rounded to x.dtype, the product to the output dtype),
so float32 matches the reference to reduction order and half precision to ~1 ulp.

x is [num_tokens, hidden] or [num_tokens, num_heads, head_dim] (Qwen3's q_norm /
k_norm: each head normalised on its own). Any token and head stride is accepted;
the last dim must be contiguous. A program owns ROWS rows of one BLOCK =
next_pow2(last dim) tile each; the grid depends on shapes only and nothing is read
on the host, so every launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 32768  # one row lives in registers: hidden sizes up to 32k


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    num_rows, eps,
    stride_x_tok, stride_x_head,
    stride_res_tok, stride_res_head,
    stride_out_tok, stride_out_head,
    NUM_HEADS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] flat (token, head) index
    col = tl.arange(0, BLOCK)
    col_mask = col < HIDDEN
    mask = (row < num_rows)[:, None] & col_mask[None, :]
    tok = (row // NUM_HEADS).to(tl.int64)
    head = (row % NUM_HEADS).to(tl.int64)
    x_ptrs = x_ptr + (tok * stride_x_tok + head * stride_x_head)[:, None] + col[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # residual = x + residual, rounded to x.dtype as torch's add is.
        res_ptrs = residual_ptr + (tok * stride_res_tok + head * stride_res_head)[:, None]
        res_ptrs = res_ptrs + col[None, :]
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / HIDDEN  # [ROWS]
    y = xf * tl.math.rsqrt(variance + eps)[:, None]
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: .to(input_dtype) before the weight
    w = tl.load(weight_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + (tok * stride_out_tok + head * stride_out_head)[:, None] + col[None, :]
    tl.store(out_ptrs, (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


def row_tiling(hidden: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) of a row-wise norm kernel over rows of `hidden` elements.

    One row lives in registers (BLOCK = hidden rounded up to a power of 2). Short rows
    (head_dim) are batched so a program moves >= ~2K elements; independent of the number
    of rows, so every batch size shares one compiled variant.
    """
    block = triton.next_power_of_2(hidden)
    assert block <= _MAX_BLOCK, f"hidden size {hidden} exceeds {_MAX_BLOCK}"
    rows = max(1, min(16, 2048 // block))
    vec = 16 // element_size
    return block, rows, max(1, min(8, rows * block // (vec * 32)))


def _strides(t: torch.Tensor) -> tuple[int, int]:  # (token stride, head stride)
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual: torch.Tensor | None,
    pdl: bool,
) -> torch.Tensor:
    assert x.dim() in (2, 3), "x must be [T, hidden] or [T, num_heads, head_dim]"
    assert x.dtype in _DTYPES and weight.dtype in _DTYPES, "fp32, fp16 or bf16 only"
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.stride(0) == 1, "weight must be [hidden]"
    assert x.stride(-1) == 1, "the normalised (last) dim of x must be contiguous"
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.stride(-1) == 1, "out must match x, last dim contiguous"
    assert out.dtype == out_dtype, f"out must be {out_dtype} (weight * x promotes)"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        assert residual.stride(-1) == 1, "the last dim of residual must be contiguous"
    num_heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * num_heads
    block, rows, num_warps = row_tiling(hidden, x.element_size())
    if num_rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, res, weight, out,
        num_rows, eps,
        *_strides(x), *_strides(res), *_strides(out),
        NUM_HEADS=num_heads, HIDDEN=hidden, BLOCK=block, ROWS=rows,
        ADD_RESIDUAL=residual is not None,
        num_warps=num_warps, **pdl_launch(x.device, pdl),
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor,  # [T, hidden] or [T, num_heads, head_dim], last dim contiguous
    weight: torch.Tensor,  # [last dim of x]
    eps: float,
    out: torch.Tensor | None = None,  # like x, dtype promote_types(weight.dtype, x.dtype)
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """RMSNorm of every row (every head of every token for 3-D x) over the last dim.

    One launch; out may be x itself (each program reads its rows before writing them).
    """
    return _launch(x, weight, eps, out, residual=None, pdl=pdl)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, hidden] (or [T, num_heads, head_dim]), last dim contiguous
    residual: torch.Tensor,  # like x, same dtype; updated in place
    weight: torch.Tensor,  # [last dim of x]
    eps: float,
    out: torch.Tensor | None = None,  # like x, dtype promote_types(weight.dtype, x.dtype)
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; normed = rms_norm(residual)` in one launch.

    residual is overwritten with the sum (rounded to x.dtype, as torch's add), and
    the normalised sum is returned with it: (normed, residual). out must not alias
    residual; it may alias x.
    """
    normed = _launch(x, weight, eps, out, residual=residual, pdl=pdl)
    return normed, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """replica.models.layers.RMSNorm.forward (LlamaRMSNorm), over the last dim."""
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(input_dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = h + x; normed = norm(h)`, with h (residual) updated in place."""
    residual.copy_(x + residual)
    return rms_norm_ref(residual, weight, eps), residual
