"""Random paged-cache fixtures shared by the kernel tests."""

from __future__ import annotations

import torch

from kernels.reference import quantize_kv_ref

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def random_block_table(
    num_seqs: int, max_blocks_per_seq: int, num_blocks: int, gen: torch.Generator, device
) -> torch.Tensor:  # [num_seqs + 1, max_blocks_per_seq] int32, every block used once
    assert num_blocks >= num_seqs * max_blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)[: (num_seqs + 1) * max_blocks_per_seq]
    perm = torch.cat([perm, torch.zeros((num_seqs + 1) * max_blocks_per_seq - perm.numel())])
    return perm.view(num_seqs + 1, max_blocks_per_seq).to(torch.int32).to(device)


def shuffled_slots(num_seqs: int, gen: torch.Generator, device) -> torch.Tensor:  # [num_seqs]
    return torch.randperm(num_seqs + 1, generator=gen)[:num_seqs].to(torch.int32).to(device)


def filled_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen, device,
    cache_dtype=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random K/V caches of dtype, stored as cache_dtype (None: dtype; fp8: quantized)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    k = quantize_kv_ref(torch.randn(shape, generator=gen).to(dtype), cache_dtype).to(device)
    v = quantize_kv_ref(torch.randn(shape, generator=gen).to(dtype), cache_dtype).to(device)
    return k, v


def poison_outside_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """NaN every cache row that no sequence's context covers, so a stray read fails."""
    block_size = cache.shape[1]
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for slot, ctx_len in zip(slot_mapping.tolist(), context_lens.tolist()):
        for pos in range(ctx_len):
            keep[block_table[slot, pos // block_size].long(), pos % block_size] = True
    if cache.dtype == torch.float8_e4m3fn:  # no masked_fill for fp8 on CPU: its NaN code
        cache.view(torch.uint8)[~keep] = 0x7F
    else:
        cache[~keep] = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so NaN-poisoned tensors compare exactly."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# Row-norm kernels (RMSNorm, LayerNorm): tolerances against their fp32 references.
NORM_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Triton's interpreter truncates float32 -> bf16 where the GPU rounds to nearest even.
INTERPRETER_BF16_NORM_TOL = dict(atol=3e-2, rtol=2e-2)


def norm_tol(dtype: torch.dtype, device: torch.device) -> dict:
    if dtype == torch.bfloat16 and device.type == "cpu":
        return INTERPRETER_BF16_NORM_TOL
    return NORM_TOL[dtype]


def randn(shape, dtype, gen, device, mean=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) + mean).to(dtype).to(device)


def nan_tensor(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def strided_rows(num_tokens, hidden, dtype, gen, device, pad=24, mean=0.0):
    """x as a view into a wider NaN-padded buffer (row stride hidden + pad, offset 8)."""
    base = nan_tensor((num_tokens, hidden + pad), dtype, device)
    x = base[:, 8 : 8 + hidden]
    x.copy_(randn((num_tokens, hidden), dtype, gen, device, mean))
    return base, x
