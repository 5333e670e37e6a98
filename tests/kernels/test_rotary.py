"""Fused q/k norm + RoPE kernel vs its torch reference, in place on views of a fused qkv buffer."""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import apply_rotary, apply_rotary_ref
from replica.models.config import RopeConfig
from replica.models.layers import RMSNorm
from replica.models.rope import RotaryEmbedding
from tests.kernels.kernel_helpers import bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Triton's interpreter truncates float32 -> bf16 where the GPU rounds to nearest even; the
# norm + RoPE chain rounds five times, so on CPU bf16 may be off by up to ~4 ulp (2**-6 each).
INTERPRETER_BF16_TOL = dict(atol=5e-2, rtol=4e-2)


def _tol(dtype: torch.dtype, device: torch.device) -> dict:
    return INTERPRETER_BF16_TOL if dtype == torch.bfloat16 and device.type == "cpu" else TOL[dtype]


EPS = 1e-6
MAX_POSITIONS = 2048
ROPE = RopeConfig(theta=1_000_000.0)


def _tables(head_dim, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, ROPE, dtype, torch.device("cpu"))
    return rotary.cos.to(device), rotary.sin.to(device)


def _weight(head_dim, dtype, gen, device) -> torch.Tensor:
    return (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device)


def _qk_views(base, num_heads, num_kv_heads, head_dim):
    """q, k inside a fused qkv row that starts 8 elements into each row of base."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = base[:, 8 : 8 + width].view(base.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]


def _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, device, pad=40):
    """q, k as views of a fused qkv output inside a wider buffer; v and the padding are NaN."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    base = torch.full((num_tokens, width + pad), float("nan"), dtype=dtype, device=device)
    q, k = _qk_views(base, num_heads, num_kv_heads, head_dim)
    q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
    k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
    return base, q, k


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_matches_model_layers(dtype):
    """apply_rotary_ref == Qwen3 q_norm/k_norm, then RotaryEmbedding.forward, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    head_dim = 64
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, ROPE, dtype, torch.device("cpu"))
    q_norm, k_norm = RMSNorm(head_dim, EPS).to(dtype), RMSNorm(head_dim, EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(_weight(head_dim, dtype, gen, "cpu"))
        k_norm.weight.copy_(_weight(head_dim, dtype, gen, "cpu"))
    q = torch.randn(5, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(5, 2, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 17, 900, MAX_POSITIONS - 1])
    with torch.no_grad():
        q_model, k_model = rotary(positions, q_norm(q), k_norm(k))
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(
        q_ref, k_ref, rotary.cos, rotary.sin, positions,
        q_norm.weight.detach(), k_norm.weight.detach(), EPS,
    )  # fmt: skip
    assert torch.equal(q_ref, q_model) and torch.equal(k_ref, k_model)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(q_ref, k_ref, rotary.cos, rotary.sin, positions)
    q_model, k_model = rotary(positions, q, k)
    assert torch.equal(q_ref, q_model) and torch.equal(k_ref, k_model)


SHAPES = [(1, 8, 2, 64), (7, 8, 4, 128), (3, 4, 2, 96)]  # (T, num_heads, num_kv_heads, head_dim)
CASES = [(*shape, dtype, qk_norm) for shape in SHAPES for dtype in DTYPES for qk_norm in (0, 1)]
# A prefill-sized batch, one case: the interpreter runs each (token, head group) program in Python.
CASES += [(64, 4, 4, 64, torch.float16, 1)]


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,dtype,qk_norm", CASES)
def test_apply_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype, qk_norm, device):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_heads * 10 + num_kv_heads)
    base, q, k = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, device)
    cos, sin = _tables(head_dim, dtype, device)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, dtype=torch.int32)
    positions = positions.to(device)
    weights = (None, None)
    if qk_norm:
        weights = (_weight(head_dim, dtype, gen, device), _weight(head_dim, dtype, gen, device))
    expect = base.clone()
    q_expect, k_expect = _qk_views(expect, num_heads, num_kv_heads, head_dim)
    apply_rotary_ref(q_expect, k_expect, cos, sin, positions, *weights, eps=EPS)

    q_out, k_out = apply_rotary(q, k, cos, sin, positions, *weights, eps=EPS)

    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_expect, **_tol(dtype, device))
    torch.testing.assert_close(k, k_expect, **_tol(dtype, device))
    untouched = torch.ones_like(base, dtype=torch.bool)
    for view in _qk_views(untouched, num_heads, num_kv_heads, head_dim):
        view.fill_(False)
    assert torch.equal(bits(base[untouched]), bits(expect[untouched])), "only q, k are written"


@pytest.mark.parametrize("qk_norm", [False, True])
def test_apply_rotary_fp32_table_and_weights_int64_positions(qk_norm, device):
    """bf16 q/k with float32 tables and norm weights: torch computes in float32, stores bf16."""
    gen = torch.Generator().manual_seed(11)
    _, q, k = _qkv(5, 4, 2, 64, torch.bfloat16, gen, device)
    cos, sin = _tables(64, torch.float32, device)
    positions = torch.tensor([3, 0, 2047, 64, 3], device=device)  # int64, repeats allowed
    weights = (None, None)
    if qk_norm:
        weights = (_weight(64, torch.float32, gen, device), _weight(64, torch.float32, gen, device))
    q_expect, k_expect = q.clone(), k.clone()
    apply_rotary_ref(q_expect, k_expect, cos, sin, positions, *weights, eps=EPS)
    apply_rotary(q, k, cos, sin, positions, *weights, eps=EPS)
    torch.testing.assert_close(q, q_expect, **_tol(torch.bfloat16, device))
    torch.testing.assert_close(k, k_expect, **_tol(torch.bfloat16, device))


def test_apply_rotary_any_head_stride(device):
    """q and k as every other head of separate buffers (head stride 2 * head_dim)."""
    gen = torch.Generator().manual_seed(12)
    q_base = torch.randn(3, 8, 64, generator=gen).to(device)
    k_base = torch.randn(3, 4, 64, generator=gen).to(device)
    q, k = q_base[:, ::2], k_base[:, 1::2]
    cos, sin = _tables(64, torch.float32, device)
    positions = torch.tensor([5, 6, 7], dtype=torch.int32, device=device)
    q_expect, k_expect = q_base.clone(), k_base.clone()
    apply_rotary_ref(q_expect[:, ::2], k_expect[:, 1::2], cos, sin, positions)
    apply_rotary(q, k, cos, sin, positions)
    torch.testing.assert_close(q_base, q_expect, **TOL[torch.float32])
    torch.testing.assert_close(k_base, k_expect, **TOL[torch.float32])
    assert torch.equal(q_base[:, 1::2], q_expect[:, 1::2])
    assert torch.equal(k_base[:, ::2], k_expect[:, ::2])


@pytest.mark.gpu
def test_apply_rotary_cuda_graph():
    """Captured once; new positions and q/k written into the same buffers are honoured."""
    gen = torch.Generator().manual_seed(13)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    _, q, k = _qkv(8, 16, 8, 128, dtype, gen, device)
    cos, sin = _tables(128, dtype, device)
    weights = (_weight(128, dtype, gen, device), _weight(128, dtype, gen, device))
    positions = torch.zeros(8, dtype=torch.int32, device=device)
    apply_rotary(q, k, cos, sin, positions, *weights)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(q, k, cos, sin, positions, *weights)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        positions.copy_(torch.randint(0, MAX_POSITIONS, (8,), generator=gen))
        q_expect, k_expect = q.clone(), k.clone()
        apply_rotary_ref(q_expect, k_expect, cos, sin, positions, *weights)
        graph.replay()
        torch.testing.assert_close(q, q_expect, **_tol(dtype, device))
        torch.testing.assert_close(k, k_expect, **_tol(dtype, device))
