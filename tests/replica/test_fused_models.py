"""The fused model path (Triton norm / RoPE / activation kernels over concatenated
projections, the CUDA default) computes what the HF-exact torch path computes.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from kernels.linear_tiles import MAX_ROWS
from replica.attention import AttentionMetadata, TorchAttention
from replica.models import gpt2, layers, llama, load_model
from replica.models.config import ModelConfig
from replica.models.layers import RMSNorm
from replica.options import EngineOptions

PRESETS = ["gpt2-tiny", "llama-tiny", "qwen3-tiny"]
BLOCK_SIZE = 8
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def prefill_meta(lengths: list[int], block_table: torch.Tensor) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    return AttentionMetadata(
        is_decode=False, block_table=block_table,
        slot_mapping=torch.arange(len(lengths), device=DEVICE),
        context_lens=torch.tensor(lengths, device=DEVICE), positions=positions, cu_seqlens_q=cu,
        start_positions=torch.zeros(len(lengths), dtype=torch.long, device=DEVICE),
        max_q_len=max(lengths),
    )  # fmt: skip


def decode_meta(lengths: list[int], block_table: torch.Tensor) -> AttentionMetadata:
    positions = torch.tensor(lengths, device=DEVICE)  # each sequence's next position
    return AttentionMetadata(
        is_decode=True, block_table=block_table,
        slot_mapping=torch.arange(len(lengths), device=DEVICE),
        context_lens=positions + 1, positions=positions,
    )  # fmt: skip


def perturb_norms(model: nn.Module) -> None:
    """Norm weights away from ones and biases away from zeros (the loader's init), seeded,
    so that a fused norm that drops or misplaces its weight or bias changes the logits."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm | RMSNorm):
                weight = 1 + 0.2 * torch.randn(module.weight.shape, generator=gen)
                module.weight.copy_(weight)
            if isinstance(module, nn.LayerNorm):
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))


def count_calls(monkeypatch, owner, names, counter: Counter, tiles: list | None = None) -> None:
    """Count each call of owner.<name> in counter[name]; tiles gets each call's tile."""
    for name in names:
        fn = getattr(owner, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            counter[_name] += 1
            if tiles is not None:
                tiles.append(kwargs["tile"])
            return _fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


HALF_TOL = {torch.float16: dict(atol=3e-2, rtol=3e-2), torch.bfloat16: dict(atol=0.15, rtol=0.1)}


def assert_same_logits(logits: list[tuple[torch.Tensor, torch.Tensor]], dtype) -> None:
    """Two paths' (prefill, decode) logits agree to half-precision rounding."""
    (p0, d0), (p1, d1) = logits
    torch.testing.assert_close(p1.float(), p0.float(), **HALF_TOL[dtype])
    torch.testing.assert_close(d1.float(), d0.float(), **HALF_TOL[dtype])


def run_prefill_and_decode(
    model: nn.Module, config: ModelConfig, lengths: list[int], decode: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:  # prefill and decode logits
    blocks_per_seq = 4
    block_table = torch.arange(len(lengths) * blocks_per_seq, device=DEVICE).view(len(lengths), -1)
    shape = (config.num_layers, 2, block_table.numel(), BLOCK_SIZE,
             config.num_kv_heads, config.head_dim)  # fmt: skip
    dtype = next(model.parameters()).dtype
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=gen).to(DEVICE)
    with torch.inference_mode():
        meta = prefill_meta(lengths, block_table)
        prefill = model.compute_logits(model(ids, meta.positions, kv_cache, meta))
        if not decode:
            return prefill, None
        next_ids = prefill[torch.tensor(lengths, device=DEVICE).cumsum(0) - 1].argmax(-1)
        meta = decode_meta(lengths, block_table)
        decode = model.compute_logits(model(next_ids, meta.positions, kv_cache, meta))
    return prefill, decode


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_path_matches_torch_path(preset):
    lengths = [5, 17, 9]
    logits = []
    for fused in (False, True):
        model, config = load_model(preset, torch.float32, DEVICE, 3, TorchAttention(), fused)
        perturb_norms(model)
        logits.append(run_prefill_and_decode(model, config, lengths))
    (p0, d0), (p1, d1) = logits
    torch.testing.assert_close(p1, p0, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(d1, d0, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_gpt2_norms_run_the_chosen_path(fused, monkeypatch):
    """Fused GPT-2 runs every norm as one fused add + LayerNorm kernel (each residual add
    folded in; the first one gathers the embedding rows too) and never torch's layer_norm;
    the torch path the reverse."""
    calls = Counter()

    def count(key: str, owner: object, name: str) -> None:
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    count("kernel", layers, "fused_add_layer_norm")
    count("kernel", layers, "layer_norm")
    count("kernel", gpt2, "embed_add_layer_norm")
    count("torch", layers.F, "layer_norm")
    model, config = load_model("gpt2-tiny", torch.float32, DEVICE, 3, TorchAttention(), fused)

    run_prefill_and_decode(model, config, [5, 17, 9])

    norms = 2 * (2 * config.num_layers + 1)  # ln_1, ln_2 per block and ln_f; two passes
    assert calls == ({"kernel": norms} if fused else {"torch": norms})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt2_triton_linear_matches_cublas_path(dtype, monkeypatch):
    """Half precision: GPT-2's projections through kernels.linear (bias and GELU fused)
    give the logits that addmm + GELU give, to half-precision rounding. In the 31-token
    prefill and the 3-row decode kernels.linear runs all four projections (mlp.c_proj,
    K = 4N, in split K), so the block runs folded: ln_1 / ln_2 inside c_attn / c_fc
    (linear_norm) and the residual adds inside both c_proj (linear_add), no add + norm
    kernel. With cuBLAS the blocks run their add + norm kernels."""
    calls = Counter()
    count_calls(
        monkeypatch, layers, ("linear", "linear_add", "linear_norm", "fused_add_layer_norm"), calls
    )
    logits, counts = [], []
    for triton_linear in (False, True):
        model, config = load_model(
            "gpt2-tiny", dtype, DEVICE, 3, TorchAttention(), True, triton_linear=triton_linear
        )
        perturb_norms(model)
        if model.fold_norms:  # folded at load, before the perturbation: fold again
            for block in model.transformer.h:
                block.fold_norms()
        calls.clear()
        prefill = run_prefill_and_decode(model, config, [5, 17, 9], decode=False)[0]
        counts.append(calls.copy())
        calls.clear()
        logits.append((prefill, run_prefill_and_decode(model, config, [5, 17, 9])[1]))
        counts.append(calls.copy())
    assert_same_logits(logits, dtype)
    layers_ = config.num_layers
    assert counts[2] == {  # prefill, folded
        "linear": 1,  # the first block's c_attn, its ln_1 run with the embedding
        "linear_norm": 2 * layers_ - 1,  # the other c_attn, and every c_fc
        "linear_add": 2 * layers_,  # both c_proj
    }
    assert counts[3] == counts[2] + counts[2]  # a prefill, then the decode, both folded
    assert counts[0] == {"fused_add_layer_norm": 2 * layers_}  # cuBLAS: add + norm kernels
    assert counts[1] == counts[0] + counts[0]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_triton_linear_matches_cublas_path(preset, dtype, monkeypatch):
    """Half precision: the Llama family's projections ([N, K] weights) through
    kernels.linear give the logits that F.linear and the RMSNorm kernels give, to
    half-precision rounding. The 31-token prefill and the 3-row decode are within the
    [N, K] tile table, so every layer runs folded: both RMSNorms inside qkv_proj and
    gate_up_proj (linear_norm; the first layer's qkv_proj after the one norm kernel)
    and both residual adds inside o_proj and down_proj (linear_add), split K at 3 rows.
    With cuBLAS the layers run their add + norm kernels."""
    calls, norm_kernels, tiles = Counter(), Counter(), []
    count_calls(monkeypatch, layers, ("linear", "linear_add", "linear_norm"), calls, tiles)
    count_calls(monkeypatch, layers, ("rms_norm_fused", "add_rms_norm_fused"), norm_kernels)
    logits, counts, norms = [], [], []
    for triton_linear in (False, True):
        model, config = load_model(
            preset, dtype, DEVICE, 3, TorchAttention(), True, triton_linear=triton_linear
        )
        perturb_norms(model)
        if model.fold_norms:  # folded at load, before the perturbation: fold the new gammas
            for layer in model.model.layers:
                layer.fold_norms()
        for record in (calls, tiles, norm_kernels):
            record.clear()
        logits.append(run_prefill_and_decode(model, config, [5, 17, 9]))
        counts.append(calls.copy())
        norms.append(norm_kernels.copy())
    assert_same_logits(logits, dtype)
    num_layers = config.num_layers
    assert counts[0] == {}
    assert norms[0] == {"rms_norm_fused": 2, "add_rms_norm_fused": 2 * (2 * num_layers)}
    per_pass = {"linear": 1, "linear_norm": 2 * num_layers - 1, "linear_add": 2 * num_layers}
    assert counts[1] == {name: 2 * n for name, n in per_pass.items()}  # prefill and decode
    assert norms[1] == {"rms_norm_fused": 2 * 2}  # the first layer's and the final norm
    decode_tiles = tiles[len(tiles) // 2 :]
    assert all(tile.split_k > 1 and tile.block_m == 16 for tile in decode_tiles)


@pytest.mark.parametrize(
    "preset,dtype", [("llama-tiny", torch.float16), ("qwen3-tiny", torch.bfloat16)]
)
def test_llama_silu_fused_into_gate_up_matches_silu_and_mul(preset, dtype, monkeypatch):
    """Folded layers with options.fuse_silu run SiLU * up in gate_up_proj's epilogue (one
    "silu_mul" linear_norm launch, in gated_tile's tile) and no silu_and_mul kernel:
    the logits that the gate_up launch, then silu_and_mul, give, to half-precision
    rounding (the fused path rounds once where the kernels round gate, up and silu)."""
    calls, activations, tiles = Counter(), [], []
    count_calls(monkeypatch, llama, ("silu_and_mul",), calls)
    linear_norm = layers.linear_norm

    def recorded(*args, **kwargs):
        activations.append(kwargs.get("activation", "none"))
        tiles.append(kwargs["tile"])
        return linear_norm(*args, **kwargs)

    monkeypatch.setattr(layers, "linear_norm", recorded)
    logits, counts, gated = [], [], []
    for fuse_silu in (False, True):
        options = EngineOptions(fuse_silu=fuse_silu)
        model, config = load_model(preset, dtype, DEVICE, 3, TorchAttention(), True, True, options)
        perturb_norms(model)
        for layer in model.model.layers:  # folded at load, before the perturbation
            layer.fold_norms()
        for record in (calls, activations, tiles):
            record.clear()
        logits.append(run_prefill_and_decode(model, config, [5, 17, 9]))
        counts.append(calls.copy())
        gated.append([tile for tile, act in zip(tiles, activations) if act == "silu_mul"])
    assert_same_logits(logits, dtype)
    num_layers = config.num_layers
    assert counts[0] == {"silu_and_mul": 2 * num_layers} and gated[0] == []  # two passes
    assert counts[1] == {} and len(gated[1]) == 2 * num_layers
    mlp = model.model.layers[0].mlp
    assert gated[1][-1] == mlp.gate_up_proj.triton_tile(3, gated=True)  # the decode's


def test_triton_linear_is_off_in_float32():
    model, _ = load_model("gpt2-tiny", torch.float32, DEVICE, 3, TorchAttention(), True)
    assert not layers.uses_triton_linear(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv1d_gelu_beyond_the_tile_table_takes_the_gemm_epilogue(dtype, monkeypatch):
    """Above kernels.linear's rows (prefill), the half-precision fc runs bias + tanh GELU
    in the GEMM's epilogue: the addmm-then-GELU result, to half-precision rounding."""
    gen = torch.Generator().manual_seed(4)
    layer = layers.Conv1D(64, 256)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 256, generator=gen) / 8)
        layer.bias.copy_(torch.randn(256, generator=gen) * 0.1)
    layer = layer.to(dtype)
    x = torch.randn(MAX_ROWS + 3, 64, generator=gen).to(dtype)
    expect = torch.nn.functional.gelu(torch.addmm(layer.bias, x, layer.weight), approximate="tanh")
    layer.triton_linear = True
    calls = []
    epilogue = torch._addmm_activation
    monkeypatch.setattr(
        torch, "_addmm_activation", lambda *a, **k: calls.append(k) or epilogue(*a, **k)
    )
    with torch.no_grad():
        got = layer(x, activation="gelu_tanh")
    assert calls == [{"use_gelu": True}]
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.float16 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got, expect, **tol)
