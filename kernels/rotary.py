"""Triton rotary embedding (neox style), optionally fused with Qwen3's per-head q/k RMSNorm.

Semantics are those of replica.models: `q = q_norm(q)` (LlamaRMSNorm over head_dim,
skipped without norm weights), then RotaryEmbedding.forward

    q_rot = q * cos[positions] + rotate_half(q) * sin[positions],
    rotate_half(q) = cat(-q[..., D/2:], q[..., :D/2]),

written back into q (and likewise k). Every product and sum is rounded to the
dtype torch would compute it in (promote(q, norm weight), then promote(that, cos)),
so float32 matches the torch code exactly up to the norm's reduction order and
half precision to ~1 ulp.

One launch covers q and k: grid (token, head group), the first groups over q's heads,
the rest over k's. A program loads its token's cos/sin row once and works on
HEADS heads as two [HEADS, D/2] halves. q and k may be strided views of one fused
qkv output (any token and head stride, head_dim contiguous); only their elements
are written. Positions are read on the device and the grid depends on shapes only,
so a launch is CUDA-graph capturable. Positions are not bounds-checked: they must
be < cos.shape[0].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.rms_norm import rms_norm_ref

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _rope_heads(
    x_ptr, weight_ptr, tok, head0, num_heads, stride_tok, stride_head,
    cos1, cos2, sin1, sin2, eps,  # [1, BLOCK_HALF] float32 each
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr, NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr,
):  # fmt: skip
    head = head0 + tl.arange(0, HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    mask = (head < num_heads)[:, None] & d_mask[None, :]
    ptrs = x_ptr + tok * stride_tok + head.to(tl.int64)[:, None] * stride_head + d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [HEADS, BLOCK_HALF]
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # Each `.to(DTYPE).to(tl.float32)` rounds to the precision torch computes that op in.
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv_rms = tl.math.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        y1 = (x1 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        y2 = (x2 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        x1 = (w1 * y1).to(NORM_DTYPE).to(tl.float32)
        x2 = (w2 * y2).to(NORM_DTYPE).to(tl.float32)
    # cat(-x2, x1) * sin: negation is exact, so round(-x2 * sin) == -round(x2 * sin).
    a1 = (x1 * cos1).to(ROPE_DTYPE).to(tl.float32)
    b1 = (x2 * sin1).to(ROPE_DTYPE).to(tl.float32)
    a2 = (x2 * cos2).to(ROPE_DTYPE).to(tl.float32)
    b2 = (x1 * sin2).to(ROPE_DTYPE).to(tl.float32)
    out1 = (a1 - b1).to(ROPE_DTYPE)
    out2 = (a2 + b2).to(ROPE_DTYPE)
    tl.store(ptrs, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, NUM_Q_GROUPS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr, NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos_ptrs = cos_ptr + pos * stride_cos + d
    sin_ptrs = sin_ptr + pos * stride_sin + d
    cos1 = tl.load(cos_ptrs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptrs + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptrs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptrs + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if group < NUM_Q_GROUPS:
        _rope_heads(
            q_ptr, q_weight_ptr, tok, group * HEADS, NUM_Q_HEADS, stride_q_tok, stride_q_head,
            cos1, cos2, sin1, sin2, eps,
            HALF, BLOCK_HALF, HEADS, HAS_NORM, NORM_DTYPE, ROPE_DTYPE,
        )  # fmt: skip
    else:
        _rope_heads(
            k_ptr, k_weight_ptr, tok, (group - NUM_Q_GROUPS) * HEADS, NUM_K_HEADS,
            stride_k_tok, stride_k_head,
            cos1, cos2, sin1, sin2, eps,
            HALF, BLOCK_HALF, HEADS, HAS_NORM, NORM_DTYPE, ROPE_DTYPE,
        )  # fmt: skip


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> None:
    assert q.dim() == 3 and k.dim() == 3, "q, k must be [T, num_heads, head_dim]"
    num_tokens, _, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, "q and k must share T, head_dim"
    assert head_dim % 2 == 0, "head_dim must be even"
    assert q.dtype == k.dtype and q.dtype in _TL_DTYPES, "q, k: one dtype of fp32, fp16, bf16"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim of q and k must be contiguous"
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype and cos.dtype in _TL_DTYPES, "cos, sin: one float dtype"
    assert cos.stride(1) == 1 and sin.stride(1) == 1, "cos, sin rows must be contiguous"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    assert positions.dtype in (torch.int32, torch.int64), "positions must be int32 or int64"
    assert (q_norm_weight is None) == (k_norm_weight is None), "give both norm weights or none"
    if q_norm_weight is not None:
        for w in (q_norm_weight, k_norm_weight):
            assert w.shape == (head_dim,) and w.stride(0) == 1, "norm weights must be [head_dim]"
        assert q_norm_weight.dtype == k_norm_weight.dtype, "q and k norm weights: one dtype"
        assert q_norm_weight.dtype in _TL_DTYPES


def apply_rotary(
    q: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous; rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], head_dim contiguous; rotated in place
    cos: torch.Tensor,  # [max_positions, head_dim], neox layout (halves duplicated)
    sin: torch.Tensor,  # [max_positions, head_dim]
    positions: torch.Tensor,  # [T], int32 or int64, each < max_positions
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]: Qwen3 q_norm
    k_norm_weight: torch.Tensor | None = None,  # [head_dim]: Qwen3 k_norm
    eps: float = 1e-6,
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Optional per-head RMSNorm, then) neox RoPE on q and k in place, one launch; returns (q, k).

    The results are stored in q.dtype. q and k must not overlap each other.
    """
    _check(q, k, cos, sin, positions, q_norm_weight, k_norm_weight)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    has_norm = q_norm_weight is not None
    norm_dtype = torch.promote_types(q_norm_weight.dtype, q.dtype) if has_norm else q.dtype
    rope_dtype = torch.promote_types(norm_dtype, cos.dtype)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = max(1, min(triton.next_power_of_2(min(num_q_heads, num_k_heads)), 1024 // block_half))
    num_q_groups = triton.cdiv(num_q_heads, heads)
    grid = (num_tokens, num_q_groups + triton.cdiv(num_k_heads, heads))
    if num_tokens == 0 or grid[1] == 0:
        return q, k
    vec = 16 // q.element_size()
    num_warps = max(1, min(4, 2 * heads * block_half // (vec * 32)))
    _rotary_kernel[grid](
        q, k, cos, sin, positions,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, NUM_Q_GROUPS=num_q_groups,
        HALF=half, BLOCK_HALF=block_half, HEADS=heads,
        HAS_NORM=has_norm, NORM_DTYPE=_TL_DTYPES[norm_dtype], ROPE_DTYPE=_TL_DTYPES[rope_dtype],
        num_warps=num_warps, **pdl_launch(q.device, pdl),
    )  # fmt: skip
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_norm/k_norm (LlamaRMSNorm) then RotaryEmbedding.forward, copied back into q and k."""
    q_in, k_in = q, k
    if q_norm_weight is not None:
        q_in = rms_norm_ref(q, q_norm_weight, eps)
        k_in = rms_norm_ref(k, k_norm_weight, eps)
    cos_t = cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
    sin_t = sin.index_select(0, positions).unsqueeze(1)
    q.copy_((q_in * cos_t) + (_rotate_half(q_in) * sin_t))
    k.copy_((k_in * cos_t) + (_rotate_half(k_in) * sin_t))
    return q, k
