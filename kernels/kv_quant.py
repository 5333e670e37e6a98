"""fp8 KV cache elements: the Triton side of kernels.reference.quantize_kv_ref.

A cache of dtype torch.float8_e4m3fn (an engine's kv_cache_dtype "fp8") holds each K/V
element as e4m3 with no scale: rounded to nearest, ties to even, saturated at +-448
(vLLM's "fp8" cache at its default scale of 1.0). The kernels that write the cache
(kv_append, decode attention's fused append) convert with `to_cache`; the kernels that
read it convert loaded tiles back to the query's dtype, which is exact.

The conversion is done on the bits rather than with a float8 cast because the
interpreter (TRITON_INTERPRET=1) rounds its fp8 casts differently from the GPU and
from torch; on the bits the CPU tests, the GPU and the torch reference agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.reference import FP8_KV_DTYPE

E4M3_MAX = tl.constexpr(reference.E4M3_MAX)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
_E4M3_SUBNORMAL_STEPS = tl.constexpr(512.0)  # subnormals are multiples of 2^-9


@triton.jit
def e4m3(x):
    """float8e4nv of x (any float dtype): round to nearest even, saturating at +-448."""
    x = x.to(tl.float32)
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits, rounding half to even (a carry
    # moves into the exponent), then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Below 2^-6: the nearest multiple of 2^-9, half to even (8 is 2^-6's code).
    y = a * _E4M3_SUBNORMAL_STEPS
    whole = y.to(tl.int32)
    frac = y - whole.to(tl.float32)
    sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    code = tl.where(a < _E4M3_MIN_NORMAL, sub, normal)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def to_cache(x, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache at cache_ptr stores it (e4m3 for an fp8 cache, else a cast)."""
    if KV_FP8:
        return e4m3(x)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def f16_queries(q, qk_scale, F16_MATH: tl.constexpr):
    """(q, qk_scale) as an attention kernel multiplies them: under F16_MATH (f16_math) the
    scale goes into q in fp32 before q's one rounding to fp16, and the scores need none."""
    if F16_MATH:
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    return q, qk_scale


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds e4m3 elements (the launchers' KV_FP8 constexpr)."""
    return cache.dtype == FP8_KV_DTYPE


def f16_math(compute: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether attention multiplies an fp8 cache's tiles in fp16, not in the queries'
    bf16 (the kernels' F16_MATH constexpr). e4m3 widens to fp16 exactly in one
    instruction per pair (to bf16 it took the qwen3 decode kernel 14% longer on an
    H200); the queries are scaled by the softmax scale before their fp16 rounding, so
    only |q| past 65504 / scale (~5e5 at head_dim 128) would overflow."""
    return is_fp8(cache) and compute.dtype == torch.bfloat16


def check_cache_dtype(compute: torch.Tensor, cache: torch.Tensor) -> None:
    """A cache holds the compute dtype or e4m3; anything else is a caller's bug."""
    assert cache.dtype in (compute.dtype, FP8_KV_DTYPE), (
        f"the cache must be {compute.dtype} (the query's) or {FP8_KV_DTYPE}, got {cache.dtype}"
    )
