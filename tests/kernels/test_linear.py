"""kernels.linear against its float32 reference: layouts, bias, GELU, SiLU * up, tiles,
strides."""

from __future__ import annotations

import pytest
import torch

from kernels.layer_norm import layer_norm, layer_norm_ref
from kernels.linear import (
    _semaphores,
    fold_layer_norm,
    fold_rms_norm,
    linear,
    linear_add,
    linear_norm,
    linear_ref,
    overlap_mode,
)
from kernels.linear_tiles import MAX_ROWS, SMEM_BYTES, Tile, choose_tile, gated_tile
from kernels.rms_norm import rms_norm_ref

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


def _layer_norm_params(k: int, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    bias = (0.2 * torch.randn(k, generator=gen)).to(dtype)
    return weight.to(device), bias.to(device)


@pytest.mark.parametrize(
    "rows,k,n,add_tile,norm_tile",
    [
        (5, 128, 96, Tile(16, 32, 64, 2, 2), Tile(16, 32, 64, 2, 2)),
        (33, 200, 64, Tile(32, 64, 32, 4, 2), Tile(32, 32, 64, 4, 2)),  # a 8-column last tile
        (70, 256, 160, Tile(64, 32, 64, 4, 3, split_k=2), Tile(64, 64, 64, 4, 3)),
        (45, 96, 100, Tile(16, 32, 32, 2, 2, split_k=3), Tile(16, 32, 32, 2, 2, split_k=2)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_then_linear_norm(rows, k, n, add_tile, norm_tile, dtype, device):
    """A sublayer boundary: `residual += o @ W1 + b1`, then `gelu(layer_norm(residual) @ W2
    + b2)` with the norm folded into W2 and the statistics from the first launch, against
    the add, LayerNorm and product done apart in fp32, rounded where the ops round. The
    residual rows are offset (mean 3) so that a lost mean term would show."""
    o, w1, b1 = _operands(rows, k, k, True, dtype, device, rows + k)
    _, w2, b2 = _operands(rows, k, n, True, dtype, device, rows + n)
    gamma, beta = _layer_norm_params(k, dtype, device, rows)
    residual = (torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) + 3).to(dtype)
    residual = residual.to(device)
    want_residual = (linear_ref(o, w1, b1, weight_is_kn=True).float() + residual.float()).to(dtype)
    normed = layer_norm_ref(want_residual, gamma, beta, 1e-5)
    want = linear_ref(normed, w2, b2, weight_is_kn=True, activation="gelu_tanh")

    stats = linear_add(o, w1, b1, residual, tile=add_tile)
    folded = fold_layer_norm(gamma, beta, 1e-5, w2, b2)
    got = linear_norm(residual, folded, stats, activation="gelu_tanh", tile=norm_tile)

    torch.testing.assert_close(residual, want_residual, **TOL[dtype])
    assert stats.partials.shape == (rows, -(-k // add_tile.block_n), 2)
    torch.testing.assert_close(got, want, **TOL[dtype])
    plain = linear(residual, w2, b2, weight_is_kn=True, activation="gelu_tanh")
    assert not torch.allclose(plain.float(), got.float(), atol=0.1), "the norm was applied"


@pytest.mark.parametrize(
    "rows,k,n,add_tile,norm_tile",
    [
        (1, 128, 96, Tile(16, 32, 64, 2, 2, split_k=2), Tile(16, 64, 64, 4, 2, split_k=2)),
        (3, 192, 64, Tile(16, 64, 64, 4, 2), Tile(16, 32, 64, 2, 2, split_k=3)),
        (33, 200, 160, Tile(32, 64, 32, 4, 2), Tile(32, 32, 64, 4, 2)),  # 8-column last tile
    ],
    ids=str,
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_folded_into_nk_weights(rows, k, n, add_tile, norm_tile, with_bias, dtype, device):
    """The Llama family's boundary, nn.Linear weights ([N, K]): `residual += o @ W1.T`,
    then `rms_norm(residual) @ W2.T + b2` with gamma folded into W2. The residual rows are
    offset (mean 3), so the mean square differs from the variance: a norm that took one
    for the other would show."""
    o, w1, _ = _operands(rows, k, k, False, dtype, device, rows + k)
    _, w2, b2 = _operands(rows, k, n, False, dtype, device, rows + n)
    b2 = b2 if with_bias else None
    gamma, _ = _layer_norm_params(k, dtype, device, rows)
    residual = (torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) + 3).to(dtype)
    residual = residual.to(device)
    want_residual = (linear_ref(o, w1, weight_is_kn=False).float() + residual.float()).to(dtype)
    want = linear_ref(rms_norm_ref(want_residual, gamma, 1e-6), w2, b2, weight_is_kn=False)

    stats = linear_add(o, w1, None, residual, weight_is_kn=False, tile=add_tile)
    folded = fold_rms_norm(gamma, 1e-6, w2, b2, weight_is_kn=False)
    got = linear_norm(residual, folded, stats, tile=norm_tile)

    torch.testing.assert_close(residual, want_residual, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert folded.rms and folded.colsum is None and folded.weight.shape == w2.shape


def test_row_stats_are_each_column_tiles_mean_and_centred_sum_of_squares(device):
    o, w, b = _operands(9, 64, 80, True, torch.float16, device, 30)
    residual = torch.randn(9, 80, generator=torch.Generator().manual_seed(31)).half().to(device)
    stats = linear_add(o, w, b, residual, tile=Tile(16, 32, 64, 2, 2))
    assert stats.tile_cols == 32
    for t, cols in enumerate((slice(0, 32), slice(32, 64), slice(64, 80))):
        part = residual[:, cols].float()
        mean = part.mean(1)
        torch.testing.assert_close(stats.partials[:, t, 0], mean)
        torch.testing.assert_close(stats.partials[:, t, 1], ((part - mean[:, None]) ** 2).sum(1))


def test_linear_norm_equals_the_layer_norm_kernel_then_linear(device):
    """The folded norm hands back what kernels.layer_norm and then the product give, to
    half-precision rounding of the result."""
    o, w1, b1 = _operands(24, 256, 256, True, torch.float16, device, 21)
    _, w2, b2 = _operands(24, 256, 128, True, torch.float16, device, 22)
    gamma, beta = _layer_norm_params(256, torch.float16, device, 23)
    residual = torch.zeros(24, 256, dtype=torch.float16, device=device)
    stats = linear_add(o, w1, b1, residual)
    apart = linear(layer_norm(residual, gamma, beta, 1e-5), w2, b2, weight_is_kn=True)
    fused = linear_norm(residual, fold_layer_norm(gamma, beta, 1e-5, w2, b2), stats)
    torch.testing.assert_close(fused, apart, atol=8e-3, rtol=4e-3)


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


def _silu_mul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, I], float32: silu(x @ Wg.T + bg) * (x @ Wu.T + bu), W [2I, K]
    gate_up = x.float() @ weight.float().t()
    if bias is not None:
        gate_up = gate_up + bias.float()
    gate, up = gate_up.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize(
    "rows,k,inter,tile",
    [
        (3, 64, 64, Tile(16, 32, 64, 2, 2)),
        (7, 100, 40, Tile(16, 32, 32, 2, 2)),  # I = 40: an 8-column last tile, K masked
        (20, 96, 48, Tile(16, 32, 32, 2, 2, split_k=3)),  # a 16-column last tile, split K
    ],
    ids=str,
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(rows, k, inter, tile, with_bias, dtype, device):
    """The gated launch: W's rows 0..I-1 are gate and I..2I-1 up (nn.Linear layout), bias
    b[n] and b[I + n]; the [M, I] result against the float32 torch formula, rounded once.
    Only out's I columns are written."""
    x, weight, bias = _operands(rows, k, 2 * inter, False, dtype, device, rows * 100 + inter)
    bias = bias if with_bias else None
    out_base = torch.full((rows, inter + 16), float("nan"), dtype=dtype, device=device)
    out = out_base[:, 16:]

    got = linear(x, weight, bias, weight_is_kn=False, activation="silu_mul", out=out, tile=tile)

    assert got is out
    torch.testing.assert_close(out, _silu_mul_ref(x, weight, bias).to(dtype), **TOL[dtype])
    assert out_base[:, :16].isnan().all(), "only out may be written"
    gate_only = torch.nn.functional.silu(x.float() @ weight[:inter].float().t())
    assert not torch.allclose(out.float(), gate_only, atol=0.1), "up multiplies"


@pytest.mark.parametrize(
    "rows,k,inter,add_tile,norm_tile",
    [
        (1, 128, 64, Tile(16, 32, 64, 2, 2, split_k=2), Tile(16, 64, 64, 4, 2, split_k=2)),
        (5, 192, 40, Tile(16, 64, 64, 4, 2), Tile(16, 32, 64, 2, 2)),  # I = 40: masked
    ],
    ids=str,
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_with_the_rms_norm_folded(
    rows, k, inter, add_tile, norm_tile, with_bias, dtype, device
):
    """The Llama MLP's first launch: silu(gate) * up of rms_norm(residual) @ W.T + b with
    gamma folded into W, the statistics from the linear_add that wrote the residual
    (offset by 3, so the mean square is not the variance): rstd applies to both halves."""
    o, w1, _ = _operands(rows, k, k, False, dtype, device, rows + k)
    _, w2, b2 = _operands(rows, k, 2 * inter, False, dtype, device, rows + inter)
    b2 = b2 if with_bias else None
    gamma, _ = _layer_norm_params(k, dtype, device, rows)
    residual = (torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) + 3).to(dtype)
    residual = residual.to(device)
    want_residual = (linear_ref(o, w1, weight_is_kn=False).float() + residual.float()).to(dtype)
    want = _silu_mul_ref(rms_norm_ref(want_residual, gamma, 1e-6), w2, b2).to(dtype)

    stats = linear_add(o, w1, None, residual, weight_is_kn=False, tile=add_tile)
    folded = fold_rms_norm(gamma, 1e-6, w2, b2, weight_is_kn=False)
    got = linear_norm(residual, folded, stats, activation="silu_mul", tile=norm_tile)

    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, **TOL[dtype])
    unnormed = _silu_mul_ref(residual, folded.weight, b2)
    assert not torch.allclose(got.float(), unnormed, atol=0.1), "the norm was applied"


def test_silu_mul_with_a_layer_norm_folded_into_kn_weights(device):
    """The gated epilogue's LayerNorm terms (mean * colsum for each half, beta @ W in the
    bias) in GPT-2's [K, N] layout, where W's columns I.. are up."""
    o, w1, b1 = _operands(6, 96, 96, True, torch.float16, device, 40)
    _, w2, b2 = _operands(6, 96, 2 * 48, True, torch.float16, device, 41)
    gamma, beta = _layer_norm_params(96, torch.float16, device, 42)
    residual = (torch.randn(6, 96, generator=torch.Generator().manual_seed(43)) + 3).half()
    residual = residual.to(device)
    stats = linear_add(o, w1, b1, residual, tile=Tile(16, 32, 32, 2, 2))
    folded = fold_layer_norm(gamma, beta, 1e-5, w2, b2)
    got = linear_norm(residual, folded, stats, activation="silu_mul", tile=Tile(16, 32, 32, 2, 2))
    want = linear_ref(
        layer_norm_ref(residual, gamma, beta, 1e-5), w2, b2, weight_is_kn=True,
        activation="silu_mul",
    )  # fmt: skip
    torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_silu_mul_split_k_is_deterministic_and_leaves_its_semaphores_at_zero(device):
    x, weight, bias = _operands(18, 256, 2 * 48, False, torch.bfloat16, device, 44)
    tile = Tile(16, 32, 32, 2, 2, split_k=4)
    first = linear(x, weight, bias, weight_is_kn=False, activation="silu_mul", tile=tile)
    second = linear(x, weight, bias, weight_is_kn=False, activation="silu_mul", tile=tile)
    assert torch.equal(first, second)
    want = _silu_mul_ref(x, weight, bias).to(torch.bfloat16)
    torch.testing.assert_close(first, want, **TOL[torch.bfloat16])
    assert not _semaphores(torch.device(device)).any()


def test_gated_tile_halves_the_columns_and_cuts_the_stages_to_the_shared_memory():
    # Half the columns: the table tile's grid and W bytes per stage (two W tiles).
    assert gated_tile(Tile(64, 64, 128, 4, 5), 2) == Tile(64, 32, 128, 4, 5)
    assert gated_tile(Tile(16, 64, 64, 4, 4, split_k=4), 2) == Tile(16, 32, 64, 4, 4, split_k=4)
    assert gated_tile(Tile(16, 16, 64, 2, 3), 2).block_n == 16  # tl.dot's least
    # bf16 64x(128 / 2)x128: a stage is 2 * (64 * 128 + 2 * 128 * 64) = 48 KiB, 4 fit in
    # 227 KiB; 5 asked for 240 KiB and failed at start-up on an H200.
    assert gated_tile(Tile(64, 128, 128, 4, 5), 2) == Tile(64, 64, 128, 4, 4)
    assert gated_tile(Tile(64, 128, 128, 4, 5), 4).num_stages == 2  # float32: 96 KiB a stage
    assert gated_tile(Tile(128, 512, 256, 8, 3), 2).num_stages == 1  # none fit: one, not zero
    assert gated_tile(Tile(16, 32, 64, 2, 3), 2).num_stages == 3  # never more than its own


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("inter,k", [(3072, 1024), (14336, 4096)])  # qwen3-0.6b, llama-3-8b
def test_gated_tables_tiles_fit_in_shared_memory(rows, inter, k):
    tile = gated_tile(choose_tile(rows, 2 * inter, k, weight_is_kn=False), 2)
    stage_bytes = 2 * (tile.block_m * tile.block_k + 2 * tile.block_k * tile.block_n)
    assert tile.num_stages * stage_bytes <= SMEM_BYTES


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
    with pytest.raises(AssertionError, match="2 \\* I"):
        linear(x, weight[:, :31], None, weight_is_kn=True, activation="silu_mul")
    with pytest.raises(AssertionError, match="bias"):
        linear(x, weight, bias[:8], weight_is_kn=True)
    with pytest.raises(AssertionError, match="residual must be"):
        linear_add(x, weight, bias, x)
    stats = linear_add(x, torch.eye(64, dtype=x.dtype, device=device), None, x.clone())
    folded = fold_layer_norm(bias.new_ones(64), bias.new_zeros(64), 1e-5, weight, bias)
    with pytest.raises(AssertionError, match="stats must describe"):
        linear_norm(x[:2], folded, stats)


def test_choose_tile_leaves_large_batches_to_cublas_and_splits_long_k():
    assert choose_tile(MAX_ROWS + 1, 768, 768) is None
    assert choose_tile(8, 768, 3072).split_k > 1  # K = 4N: split K
    assert choose_tile(64, 768, 3072).split_k > 1
    assert choose_tile(256, 768, 3072).split_k > 1
    for rows in (1, 8, 24, 64, 128, MAX_ROWS):
        for n, k in ((2304, 768), (768, 768), (3072, 768), (768, 3072)):
            tile = choose_tile(rows, n, k)
            assert choose_tile(rows, n, k, row_stats=True) is not None, "linear_add runs too"
            assert tile is not None and tile.block_m <= 64 and tile.block_k <= k, (rows, n, k)


def test_the_launch_overlap_by_the_weights_layout_and_rows():
    split, whole = Tile(16, 32, 64, 2, 4, split_k=6), Tile(16, 32, 128, 4, 5)
    # GPT-2's [K, N]: every launch of a few rows joins, triggering the next after its K loop.
    assert overlap_mode(split, 1, weight_is_kn=True) == "late"
    assert overlap_mode(whole, 16, weight_is_kn=True) == "late"
    assert overlap_mode(split, 17, weight_is_kn=True) == "early"
    # Llama's [N, K]: split launches below 9 rows end it; the rest trigger at the top.
    assert overlap_mode(split, 8, weight_is_kn=False) == "none"
    assert overlap_mode(split, 9, weight_is_kn=False) == "early"
    assert overlap_mode(whole, 1, weight_is_kn=False) == "early"


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
