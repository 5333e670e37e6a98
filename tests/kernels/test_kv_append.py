"""KV append kernels vs their torch references, on NaN-poisoned caches."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.kv_append import append_kv, append_kv_prefill, append_kv_slots
from tests.kernels.kernel_helpers import bits, random_block_table, shuffled_slots

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _setup(num_rows, num_kv_heads, head_dim, block_size, dtype, seed, device, num_blocks=64):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_rows, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_rows, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    return gen, k, v, k_cache, v_cache


def _assert_same(k_cache, v_cache, k_expect, v_expect) -> None:
    assert torch.equal(bits(k_cache), bits(k_expect))
    assert torch.equal(bits(v_cache), bits(v_expect))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_src_rows", [False, True])
def test_append_kv_generic(dtype, with_src_rows, device):
    gen, k, v, k_cache, v_cache = _setup(11, 2, 64, 16, dtype, seed=1, device=device)
    num_writes = 7
    flat = torch.randperm(64 * 16, generator=gen)[:num_writes]
    block_ids = (flat // 16).to(torch.int32).to(device)
    offsets = (flat % 16).to(torch.int32).to(device)
    src_rows = torch.randperm(11, generator=gen)[:num_writes].to(torch.int32).to(device)
    src_rows = src_rows if with_src_rows else None
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_ref(k, v, k_expect, v_expect, block_ids, offsets, src_rows)
    append_kv(k, v, k_cache, v_cache, block_ids, offsets, src_rows)
    _assert_same(k_cache, v_cache, k_expect, v_expect)


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,block_size",
    [
        (torch.float32, 2, 64, 16),
        (torch.float16, 12, 64, 32),  # GPT-2 row: 768 wide, not a power of 2
        (torch.bfloat16, 8, 128, 64),
        (torch.float16, 20, 128, 16),  # 2560-wide row: split across programs
    ],
)
@pytest.mark.parametrize("const_position", [False, True])
def test_append_kv_slots(dtype, num_kv_heads, head_dim, block_size, const_position, device):
    num_rows, max_blocks = 5, 4
    gen, k, v, k_cache, v_cache = _setup(
        num_rows, num_kv_heads, head_dim, block_size, dtype, seed=2, device=device
    )
    block_table = random_block_table(num_rows, max_blocks, 64, gen, device)
    slot_mapping = shuffled_slots(num_rows, gen, device)
    if const_position:
        positions = block_size + 3
    else:
        hi = max_blocks * block_size
        positions = torch.tensor([0, block_size - 1, block_size, hi - 1, 7], dtype=torch.int32)
        positions = positions.to(device)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_slots_ref(k, v, k_expect, v_expect, block_table, slot_mapping, positions)
    append_kv_slots(k, v, k_cache, v_cache, block_table, slot_mapping, positions)
    _assert_same(k_cache, v_cache, k_expect, v_expect)


def test_append_kv_slots_strided_input(device):
    """k/v as views into a fused qkv projection (row stride > num_kv_heads * head_dim)."""
    gen = torch.Generator().manual_seed(3)
    num_rows, num_kv_heads, head_dim, block_size = 3, 2, 64, 16
    qkv = torch.randn(num_rows, 8, head_dim, generator=gen).to(torch.float16).to(device)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    shape = (16, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float16, device=device)
    v_cache = k_cache.clone()
    block_table = random_block_table(num_rows, 2, 16, gen, device)
    slot_mapping = shuffled_slots(num_rows, gen, device)
    positions = torch.tensor([0, 17, 31], dtype=torch.int32, device=device)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_slots_ref(k, v, k_expect, v_expect, block_table, slot_mapping, positions)
    append_kv_slots(k, v, k_cache, v_cache, block_table, slot_mapping, positions)
    _assert_same(k_cache, v_cache, k_expect, v_expect)


@pytest.mark.parametrize(
    "dtype,block_size,seq_lens,starts",
    [
        (torch.float32, 16, [1, 16, 17], [0, 5, 16]),
        (torch.float16, 32, [40, 3], [0, 31]),
        (torch.bfloat16, 64, [2, 65, 1], [63, 0, 100]),
    ],
)
def test_append_kv_prefill(dtype, block_size, seq_lens, starts, device):
    num_seqs, max_blocks = len(seq_lens), 4
    num_tokens = sum(seq_lens)
    gen, k, v, k_cache, v_cache = _setup(
        num_tokens, 2, 64, block_size, dtype, seed=4, device=device
    )
    block_table = random_block_table(num_seqs, max_blocks, 64, gen, device)
    slot_mapping = shuffled_slots(num_seqs, gen, device)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu, start_positions = cu.to(device), torch.tensor(starts, dtype=torch.int32, device=device)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_prefill_ref(
        k, v, k_expect, v_expect, block_table, slot_mapping, cu, start_positions
    )
    # An overestimated max_seqlen only adds masked programs.
    max_seqlen = max(seq_lens) + 5
    append_kv_prefill(
        k, v, k_cache, v_cache, block_table, slot_mapping, cu, start_positions, max_seqlen
    )
    _assert_same(k_cache, v_cache, k_expect, v_expect)
