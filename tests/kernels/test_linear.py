"""kernels.linear against its float32 reference: layouts, bias, GELU, tiles, strides."""

from __future__ import annotations

import pytest
import torch

from kernels.layer_norm import layer_norm
from kernels.linear import MAX_ROWS, Tile, _semaphores, choose_tile, linear, linear_ref

DTYPES = [torch.float16, torch.bfloat16]
# One rounding of an fp32 result whose magnitude stays below ~8.
TOL = {torch.float16: dict(atol=8e-3, rtol=4e-3), torch.bfloat16: dict(atol=6e-2, rtol=1.6e-2)}


def _operands(rows: int, k: int, n: int, weight_is_kn: bool, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x_base = torch.full((rows, k + 24), float("nan"), dtype=dtype)
    x = x_base[:, 8 : 8 + k]  # row stride k + 24: the kernel must take x's stride
    x.copy_(torch.randn(rows, k, generator=gen).to(dtype))
    shape = (k, n) if weight_is_kn else (n, k)
    weight = (torch.randn(*shape, generator=gen) / k**0.5).to(dtype)
    bias = (torch.randn(n, generator=gen) * 0.5).to(dtype)
    return x_base.to(device)[:, 8 : 8 + k], weight.to(device), bias.to(device)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (7, 100, 70), (33, 128, 64), (70, 192, 160)])
@pytest.mark.parametrize("weight_is_kn", [True, False])
@pytest.mark.parametrize("activation", ["none", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(rows, k, n, weight_is_kn, activation, dtype, device):
    x, weight, bias = _operands(rows, k, n, weight_is_kn, dtype, device, rows * 1000 + k)
    out_base = torch.full((rows, n + 16), float("nan"), dtype=dtype, device=device)
    out = out_base[:, 16:]

    got = linear(x, weight, bias, weight_is_kn=weight_is_kn, activation=activation, out=out)

    assert got is out
    want = linear_ref(x, weight, bias, weight_is_kn=weight_is_kn, activation=activation)
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert out_base[:, :16].isnan().all(), "only out may be written"


def _norm(k: int, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    bias = (0.2 * torch.randn(k, generator=gen)).to(dtype)
    return weight.to(device), bias.to(device), 1e-5


@pytest.mark.parametrize(
    "rows,k,n,tile",
    [
        (5, 128, 96, Tile(16, 32, 64, 2, 2)),
        (33, 192, 64, Tile(32, 64, 128, 4, 2)),  # K = 1.5 chunks: a short last chunk
        (70, 256, 160, Tile(64, 32, 64, 4, 3, split_k=2)),  # every K slice needs the whole row
        (45, 200, 100, Tile(16, 32, 32, 2, 2, split_k=3)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_prologue_and_residual_epilogue(rows, k, n, tile, dtype, device):
    """norm(x) @ W + b + residual equals LayerNorm, product and add done apart, each
    rounded; the rows are offset (mean 3) so that a one-pass E[x^2] - E[x]^2 would show."""
    x, weight, bias = _operands(rows, k, n, True, dtype, device, rows + k)
    x.add_(3.0)
    norm = _norm(k, dtype, device, rows)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(3)).to(dtype)
    residual = residual.to(device)
    want = linear_ref(
        x, weight, bias, weight_is_kn=True, activation="gelu_tanh", norm=norm, residual=residual
    )
    # out is residual: the residual add in place
    got = linear(
        x, weight, bias, weight_is_kn=True, activation="gelu_tanh", tile=tile, norm=norm,
        residual=residual, out=residual,
    )  # fmt: skip
    assert got is residual
    torch.testing.assert_close(got, want, **TOL[dtype])
    normed = linear(x, weight, bias, weight_is_kn=True, tile=tile, norm=norm)
    want_normed = linear_ref(x, weight, bias, weight_is_kn=True, norm=norm)
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])
    plain = linear(x, weight, bias, weight_is_kn=True, tile=tile)
    assert not torch.allclose(plain.float(), normed.float(), atol=0.1), "the norm was applied"


def test_norm_prologue_equals_the_layer_norm_kernel_then_linear(device):
    """The fused prologue hands the product what kernels.layer_norm would: same outputs
    to one rounding of the final result."""
    x, weight, bias = _operands(24, 256, 128, True, torch.float16, device, 21)
    norm = _norm(256, torch.float16, device, 22)
    apart = linear(layer_norm(x, *norm), weight, bias, weight_is_kn=True)
    fused = linear(x, weight, bias, weight_is_kn=True, norm=norm)
    torch.testing.assert_close(fused, apart, atol=4e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "tile",
    [
        Tile(16, 32, 32, 2, 2),
        Tile(32, 64, 64, 4, 3),
        Tile(64, 32, 128, 4, 2),
        Tile(16, 32, 64, 2, 2, split_k=2),
        Tile(32, 64, 32, 4, 2, split_k=3),
        Tile(64, 32, 32, 4, 2, split_k=8),  # K = 200 in 32-wide slices: the last one is empty
    ],
    ids=str,
)
def test_every_tile_covers_the_same_product(tile, device):
    """Row, column and K tails that no tile divides: masks, not the tile, decide the result."""
    x, weight, bias = _operands(45, 200, 100, True, torch.float16, device, 5)
    got = linear(x, weight, bias, weight_is_kn=True, tile=tile)
    want = linear_ref(x, weight, bias, weight_is_kn=True)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


@pytest.mark.parametrize("activation", ["none", "gelu_tanh"])
def test_split_k_is_deterministic_and_leaves_its_semaphores_at_zero(activation, device):
    """The last slice to finish sums every slice's partial in slice order, so two launches
    agree bit for bit; bias and GELU apply once, to the sum."""
    x, weight, bias = _operands(70, 384, 96, False, torch.bfloat16, device, 9)
    tile = Tile(32, 32, 32, 4, 2, split_k=4)
    first = linear(x, weight, bias, weight_is_kn=False, activation=activation, tile=tile)
    second = linear(x, weight, bias, weight_is_kn=False, activation=activation, tile=tile)
    assert torch.equal(first, second)
    want = linear_ref(x, weight, bias, weight_is_kn=False, activation=activation)
    torch.testing.assert_close(first, want, **TOL[torch.bfloat16])
    assert not _semaphores(torch.device(device)).any()


def test_without_bias_and_the_reference_is_torch(device):
    x, weight, _ = _operands(9, 64, 48, False, torch.float16, device, 6)
    got = linear(x, weight, None, weight_is_kn=False, activation="gelu_tanh")
    want = torch.nn.functional.gelu(x.float() @ weight.float().t(), approximate="tanh")
    torch.testing.assert_close(got, want.half(), **TOL[torch.float16])
    assert got.shape == (9, 48) and got.is_contiguous()


def test_gelu_saturates_without_nan(device):
    """Large pre-activations: tanh's exp overflows unless clamped; GELU(x) is x or 0 there."""
    x = torch.tensor([[60.0, -60.0, 0.0, 3.0]], dtype=torch.float16, device=device)
    eye = torch.eye(4, dtype=torch.float16, device=device)
    got = linear(x, eye, None, weight_is_kn=True, activation="gelu_tanh").float()
    want = torch.nn.functional.gelu(x.float(), approximate="tanh")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)


def test_bad_arguments_are_named(device):
    x, weight, bias = _operands(4, 64, 32, True, torch.float16, device, 7)
    with pytest.raises(AssertionError, match="fp16 or bf16"):
        linear(x.float(), weight.float(), None, weight_is_kn=True)
    with pytest.raises(AssertionError, match=r"weight must be \[N, K\]"):
        linear(x, weight, bias, weight_is_kn=False)
    with pytest.raises(AssertionError, match="activation"):
        linear(x, weight, bias, weight_is_kn=True, activation="relu")
    with pytest.raises(AssertionError, match="bias"):
        linear(x, weight, bias[:8], weight_is_kn=True)
    with pytest.raises(AssertionError, match="norm weight"):
        linear(x, weight, bias, weight_is_kn=True, norm=(bias, bias, 1e-5))
    with pytest.raises(AssertionError, match="residual"):
        linear(x, weight, bias, weight_is_kn=True, residual=x)


def test_choose_tile_leaves_large_batches_and_long_k_to_cublas():
    assert choose_tile(MAX_ROWS + 1, 768, 768) is None
    assert choose_tile(8, 768, 3072) is None  # K = 4N at few rows: cuBLAS
    assert choose_tile(64, 768, 3072).split_k > 1  # K = 4N: split K
    assert choose_tile(256, 768, 3072).split_k > 1
    for rows in (1, 8, 24, 64, 128, MAX_ROWS):
        for n, k in ((2304, 768), (768, 768), (3072, 768)):
            tile = choose_tile(rows, n, k)
            assert tile is not None and tile.block_m <= 64 and tile.block_k <= k, (rows, n, k)


@pytest.mark.gpu
def test_linear_cuda_graph():
    x, weight, bias = _operands(64, 768, 2304, True, torch.float16, "cuda", 8)
    out = linear(x, weight, bias, weight_is_kn=True)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, weight, bias, weight_is_kn=True, activation="gelu_tanh", out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = linear_ref(x, weight, bias, weight_is_kn=True, activation="gelu_tanh")
    torch.testing.assert_close(out, want, **TOL[torch.float16])


@pytest.mark.gpu
def test_split_k_cuda_graph_replays():
    x, weight, bias = _operands(256, 3072, 768, True, torch.float16, "cuda", 10)
    tile = Tile(64, 64, 64, 4, 4, split_k=4)
    out = linear(x, weight, bias, weight_is_kn=True, tile=tile)  # compile, make semaphores
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, weight, bias, weight_is_kn=True, out=out, tile=tile)
    for seed in (11, 12):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).half())
        graph.replay()
        torch.cuda.synchronize()
        want = linear_ref(x, weight, bias, weight_is_kn=True)
        torch.testing.assert_close(out, want, **TOL[torch.float16])
    assert not _semaphores(torch.device("cuda")).any()
