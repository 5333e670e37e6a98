"""Triton SiLU-and-mul: the gated MLP activation on a fused gate_up projection output.

    out = F.silu(x[:, :I]) * x[:, I:]

computed like torch in x.dtype: silu(gate) = gate / (1 + exp(-gate)) in float32,
rounded to x.dtype, then the product in float32, rounded to x.dtype. Grid
(token, BLOCK-wide slice of I); shapes only, so CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x_tok, stride_out_tok,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < INTERMEDIATE
    gate_ptrs = x_ptr + tok * stride_x_tok + col
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + tok * stride_out_tok + col, (act * up).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]: gate then up; row stride arbitrary, last dim contiguous
    out: torch.Tensor | None = None,  # [T, I], x.dtype; row stride arbitrary
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """silu(gate) * up for every token, one launch; returns out."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, "x must be [T, 2 * intermediate]"
    assert x.dtype in _DTYPES, "fp32, fp16 or bf16 only"
    assert x.stride(1) == 1, "the last dim of x must be contiguous"
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, intermediate) and out.dtype == x.dtype, "out: [T, I], x.dtype"
    assert out.stride(1) == 1, "the last dim of out must be contiguous"
    block = min(triton.next_power_of_2(intermediate), _MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(intermediate, block))
    if num_tokens == 0 or intermediate == 0:
        return out
    vec = 16 // x.element_size()
    num_warps = max(1, min(4, block // (vec * 32)))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0),
        INTERMEDIATE=intermediate, BLOCK=block, num_warps=num_warps, **pdl_launch(x.device, pdl),
    )  # fmt: skip
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """The Llama MLP's F.silu(gate_proj(x)) * up_proj(x) on the concatenated projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
