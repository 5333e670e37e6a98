"""LayerNorm kernels vs their torch references: strided views, NaN-poisoned outputs, in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.layer_norm import (
    embed_add_layer_norm,
    embed_add_layer_norm_ref,
    fused_add_layer_norm,
    fused_add_layer_norm_ref,
    layer_norm,
    layer_norm_ref,
)
from replica.models.layers import LayerNorm
from tests.kernels.kernel_helpers import NORM_TOL, bits, nan_tensor, norm_tol, randn, strided_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
# Inputs get a non-zero mean, so a kernel that skips centring (or centres padding) fails.
MEAN = 1.5
SHAPES = [(1, 64), (7, 768), (5, 96), (64, 200), (3, 3072)]


def _weight_bias(hidden, dtype, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    return weight, randn(hidden, dtype, gen, device)


def test_ref_matches_model_layer():
    """The reference is GPT-2's ln_* (nn.LayerNorm): bitwise in float32, to rounding in half."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        layer = LayerNorm(96, EPS).to(dtype)
        weight, bias = _weight_bias(96, dtype, gen, "cpu")
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        x = randn((5, 96), dtype, gen, "cpu", mean=MEAN)
        expect = F.layer_norm(x, (96,), weight, bias, EPS)
        assert torch.equal(layer(x).detach(), expect)
        if dtype == torch.float32:
            assert torch.equal(layer_norm_ref(x, weight, bias, EPS), expect)
        else:
            torch.testing.assert_close(
                layer_norm_ref(x, weight, bias, EPS), expect, **NORM_TOL[dtype]
            )


@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(num_tokens, hidden, dtype, device):
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    base, x = strided_rows(num_tokens, hidden, dtype, gen, device, mean=MEAN)
    before = base.clone()
    weight, bias = _weight_bias(hidden, dtype, gen, device)
    out_base = nan_tensor((num_tokens, hidden + 16), dtype, device)
    out = out_base[:, 16:]  # row stride hidden + 16

    assert layer_norm(x, weight, bias, EPS, out=out) is out

    torch.testing.assert_close(out, layer_norm_ref(x, weight, bias, EPS), **norm_tol(dtype, device))
    assert torch.equal(bits(base), bits(before)), "x must not be written"
    assert out_base[:, :16].isnan().all(), "only out may be written"


def test_layer_norm_allocates_in_x_dtype_with_fp32_params(device):
    """bf16 activations with fp32 weight and bias produce bf16, as torch's layer_norm does."""
    gen = torch.Generator().manual_seed(1)
    x = randn((4, 200), torch.bfloat16, gen, device, mean=MEAN)
    weight, bias = _weight_bias(200, torch.float32, gen, device)
    out = layer_norm(x, weight, bias, EPS)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_contiguous()
    expect = layer_norm_ref(x, weight, bias, EPS)
    torch.testing.assert_close(out, expect, **norm_tol(torch.bfloat16, device))


def test_layer_norm_in_place(device):
    gen = torch.Generator().manual_seed(2)
    x = randn((7, 768), torch.float16, gen, device, mean=MEAN)
    weight, bias = _weight_bias(768, torch.float16, gen, device)
    expect = layer_norm_ref(x, weight, bias, EPS)
    assert layer_norm(x, weight, bias, EPS, out=x) is x
    torch.testing.assert_close(x, expect, **NORM_TOL[torch.float16])


def test_layer_norm_no_rows(device):
    x = torch.empty(0, 96, device=device)
    weight, bias = torch.ones(96, device=device), torch.zeros(96, device=device)
    assert layer_norm(x, weight, bias, EPS).shape == (0, 96)


@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_layer_norm(num_tokens, hidden, dtype, device):
    gen = torch.Generator().manual_seed(7 * hidden + num_tokens)
    x_base, x = strided_rows(num_tokens, hidden, dtype, gen, device, mean=MEAN)
    res_base, residual = strided_rows(num_tokens, hidden, dtype, gen, device, pad=40, mean=MEAN)
    x_before = x_base.clone()
    expect_residual = residual.clone()
    weight, bias = _weight_bias(hidden, dtype, gen, device)
    expect_normed, _ = fused_add_layer_norm_ref(x, expect_residual, weight, bias, EPS)
    out = nan_tensor((num_tokens, hidden), dtype, device)

    normed, res_out = fused_add_layer_norm(x, residual, weight, bias, EPS, out=out)

    assert normed is out and res_out is residual
    if dtype == torch.bfloat16 and device.type == "cpu":  # the interpreter truncates to bf16
        torch.testing.assert_close(residual, expect_residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(bits(residual), bits(expect_residual)), "residual = x + residual"
    torch.testing.assert_close(normed, expect_normed, **norm_tol(dtype, device))
    assert torch.equal(bits(x_base), bits(x_before)), "x must not be written"
    assert res_base[:, :8].isnan().all() and res_base[:, 8 + hidden :].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_add_layer_norm_gathers_both_tables(dtype, device):
    """GPT-2's embedding stage: rows of wte and wpe at each token's id and position, summed
    (and kept as the residual), then normalised; the tables are only read."""
    gen = torch.Generator().manual_seed(11)
    vocab, max_positions, hidden = 50, 40, 200
    wte = randn((vocab, hidden), dtype, gen, device, mean=MEAN)
    wpe = randn((max_positions, hidden), dtype, gen, device)
    tables = (wte.clone(), wpe.clone())
    ids = torch.tensor([3, 49, 0, 3, 17, 8, 8], device=device)
    positions = torch.tensor([0, 39, 5, 6, 1, 2, 2], device=device)
    weight, bias = _weight_bias(hidden, dtype, gen, device)
    expect_normed, expect_residual = embed_add_layer_norm_ref(
        ids, positions, wte, wpe, weight, bias, EPS
    )

    normed, residual = embed_add_layer_norm(ids, positions, wte, wpe, weight, bias, EPS)

    if dtype == torch.bfloat16 and device.type == "cpu":  # the interpreter truncates to bf16
        torch.testing.assert_close(residual, expect_residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(bits(residual), bits(expect_residual))
    torch.testing.assert_close(normed, expect_normed, **norm_tol(dtype, device))
    assert torch.equal(wte, tables[0]) and torch.equal(wpe, tables[1])


def test_fused_add_layer_norm_out_aliases_x(device):
    """The fused GPT-2 path may normalise into the sublayer output it just consumed."""
    gen = torch.Generator().manual_seed(3)
    x = randn((5, 200), torch.float32, gen, device)
    residual = randn((5, 200), torch.float32, gen, device, mean=MEAN)
    weight, bias = _weight_bias(200, torch.float32, gen, device)
    expect_residual = residual.clone()
    expect, _ = fused_add_layer_norm_ref(x.clone(), expect_residual, weight, bias, EPS)

    normed, _ = fused_add_layer_norm(x, residual, weight, bias, EPS, out=x)

    assert normed is x
    torch.testing.assert_close(x, expect, **NORM_TOL[torch.float32])
    assert torch.equal(residual, expect_residual)


@pytest.mark.gpu
def test_fused_add_layer_norm_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers."""
    gen = torch.Generator().manual_seed(4)
    device = torch.device("cuda")
    x = randn((8, 768), torch.bfloat16, gen, device)
    residual = randn((8, 768), torch.bfloat16, gen, device)
    weight, bias = _weight_bias(768, torch.bfloat16, gen, device)
    out = torch.empty_like(x)
    fused_add_layer_norm(x, residual.clone(), weight, bias, EPS, out=out)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_layer_norm(x, residual, weight, bias, EPS, out=out)
    for seed in (5, 6):
        g = torch.Generator().manual_seed(seed)
        x.copy_(randn((8, 768), torch.bfloat16, g, device))
        residual.copy_(randn((8, 768), torch.bfloat16, g, device, mean=MEAN))
        expect_residual = residual.clone()
        expect, _ = fused_add_layer_norm_ref(x, expect_residual, weight, bias, EPS)
        graph.replay()
        torch.testing.assert_close(out, expect, **norm_tol(torch.bfloat16, device))
        torch.testing.assert_close(residual, expect_residual, atol=0, rtol=0)
