"""RMSNorm kernels vs their torch references: strided views, NaN-poisoned outputs, in place."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from replica.models.layers import RMSNorm
from tests.kernels.kernel_helpers import NORM_TOL, bits, nan_tensor, norm_tol, randn, strided_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _weight(hidden, dtype, gen, device) -> torch.Tensor:
    return (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)


def test_ref_matches_model_layer():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        layer = RMSNorm(96, EPS).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(_weight(96, dtype, gen, "cpu"))
        x = randn((5, 96), dtype, gen, "cpu")
        assert torch.equal(rms_norm_ref(x, layer.weight.detach(), EPS), layer(x).detach())


@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 1000), (64, 128), (3, 3072)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(num_tokens, hidden, dtype, device):
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    base, x = strided_rows(num_tokens, hidden, dtype, gen, device)
    before = base.clone()
    weight = _weight(hidden, dtype, gen, device)
    out = nan_tensor((num_tokens, hidden), dtype, device)
    assert rms_norm(x, weight, EPS, out=out) is out
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **norm_tol(dtype, device))
    assert torch.equal(bits(base), bits(before)), "x must not be written"


def test_rms_norm_promotes_to_fp32_weight(device):
    """bf16 activations with an fp32 weight produce fp32, as `weight * x.to(bf16)` does."""
    gen = torch.Generator().manual_seed(1)
    x = randn((4, 256), torch.bfloat16, gen, device)
    weight = _weight(256, torch.float32, gen, device)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, rms_norm_ref(x, weight, EPS), **norm_tol(torch.bfloat16, device)
    )


def test_rms_norm_in_place(device):
    gen = torch.Generator().manual_seed(2)
    x = randn((7, 1000), torch.float16, gen, device)
    weight = _weight(1000, torch.float16, gen, device)
    expect = rms_norm_ref(x, weight, EPS)
    rms_norm(x, weight, EPS, out=x)
    torch.testing.assert_close(x, expect, **NORM_TOL[torch.float16])


@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 8, 64), (7, 4, 128), (64, 2, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head(num_tokens, num_heads, head_dim, dtype, device):
    """Qwen3 q_norm on q sliced out of a fused qkv output: [T, num_heads, head_dim] view."""
    gen = torch.Generator().manual_seed(num_heads * head_dim + num_tokens)
    qkv = randn((num_tokens, 3 * num_heads + 1, head_dim), dtype, gen, device)
    q = qkv[:, 1 : 1 + num_heads]  # token stride (3 * num_heads + 1) * head_dim, offset one head
    weight = _weight(head_dim, dtype, gen, device)
    out = nan_tensor(q.shape, dtype, device)
    rms_norm(q, weight, EPS, out=out)
    torch.testing.assert_close(out, rms_norm_ref(q, weight, EPS), **norm_tol(dtype, device))


def test_rms_norm_per_head_any_head_stride(device):
    """Heads need not be adjacent: every other head of a buffer, written to a strided out."""
    gen = torch.Generator().manual_seed(3)
    x = randn((5, 8, 64), torch.float32, gen, device)[:, ::2]  # head stride 128
    weight = _weight(64, torch.float32, gen, device)
    out_base = nan_tensor((5, 8, 64), torch.float32, device)
    out = out_base[:, 1::2]
    rms_norm(x, weight, EPS, out=out)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **NORM_TOL[torch.float32])
    assert out_base[:, ::2].isnan().all(), "only out's heads may be written"


@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 1000), (64, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(num_tokens, hidden, dtype, device):
    gen = torch.Generator().manual_seed(7 * hidden + num_tokens)
    x_base, x = strided_rows(num_tokens, hidden, dtype, gen, device)
    res_base, residual = strided_rows(num_tokens, hidden, dtype, gen, device, pad=40)
    x_before = x_base.clone()
    expect_residual = residual.clone()
    weight = _weight(hidden, dtype, gen, device)
    expect_normed, _ = fused_add_rms_norm_ref(x, expect_residual, weight, EPS)
    out = nan_tensor((num_tokens, hidden), dtype, device)

    normed, res_out = fused_add_rms_norm(x, residual, weight, EPS, out=out)

    assert normed is out and res_out is residual
    if dtype == torch.bfloat16 and device.type == "cpu":  # the interpreter truncates to bf16
        torch.testing.assert_close(residual, expect_residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(bits(residual), bits(expect_residual)), "residual = x + residual"
    torch.testing.assert_close(normed, expect_normed, **norm_tol(dtype, device))
    assert torch.equal(bits(x_base), bits(x_before)), "x must not be written"
    assert res_base[:, :8].isnan().all() and res_base[:, 8 + hidden :].isnan().all()


@pytest.mark.gpu
def test_fused_add_rms_norm_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers."""
    gen = torch.Generator().manual_seed(4)
    device = torch.device("cuda")
    x = randn((8, 1024), torch.bfloat16, gen, device)
    residual = randn((8, 1024), torch.bfloat16, gen, device)
    weight = _weight(1024, torch.bfloat16, gen, device)
    out = torch.empty_like(x)
    fused_add_rms_norm(x, residual.clone(), weight, EPS, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rms_norm(x, residual, weight, EPS, out=out)
    for seed in (5, 6):
        g = torch.Generator().manual_seed(seed)
        x.copy_(randn((8, 1024), torch.bfloat16, g, device))
        residual.copy_(randn((8, 1024), torch.bfloat16, g, device))
        expect_residual = residual.clone()
        expect, _ = fused_add_rms_norm_ref(x, expect_residual, weight, EPS)
        graph.replay()
        torch.testing.assert_close(out, expect, **norm_tol(torch.bfloat16, device))
        torch.testing.assert_close(residual, expect_residual, atol=0, rtol=0)
