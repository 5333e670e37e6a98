"""SiLU-and-mul kernel vs its torch reference, on strided inputs and NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul, silu_and_mul_ref
from tests.kernels.kernel_helpers import bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def test_ref_is_the_llama_mlp_activation():
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    up = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    assert torch.equal(silu_and_mul_ref(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


@pytest.mark.parametrize("num_tokens,intermediate", [(1, 64), (7, 1000), (64, 512), (2, 3000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(num_tokens, intermediate, dtype, device):
    gen = torch.Generator().manual_seed(num_tokens * 10_000 + intermediate)
    width = 2 * intermediate
    x_base = torch.full((num_tokens, width + 24), float("nan"), dtype=dtype, device=device)
    x = x_base[:, 8 : 8 + width]  # row stride width + 24
    x.copy_((3 * torch.randn(num_tokens, width, generator=gen)).to(dtype))
    x_before = x_base.clone()
    out_base = torch.full((num_tokens, intermediate + 16), float("nan"), dtype=dtype, device=device)
    out = out_base[:, 16:]

    assert silu_and_mul(x, out=out) is out

    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])
    assert torch.equal(bits(x_base), bits(x_before)), "x must not be written"
    assert out_base[:, :16].isnan().all(), "only out may be written"


def test_silu_and_mul_allocates(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=gen).to(torch.float16).to(device)
    out = silu_and_mul(x)
    assert out.shape == (5, 128) and out.dtype == torch.float16 and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[torch.float16])


@pytest.mark.gpu
def test_silu_and_mul_cuda_graph():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 2 * 1536, generator=gen).to(torch.bfloat16).cuda()
    out = silu_and_mul(x)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu_and_mul(x, out=out)
    x.copy_(torch.randn(x.shape, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[torch.bfloat16])
