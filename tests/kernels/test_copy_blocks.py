"""copy_blocks vs the torch reference: every layer's K and V, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.copy_blocks import copy_blocks
from tests.kernels.kernel_helpers import bits


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim",
    [(torch.float32, 16, 2, 64), (torch.bfloat16, 32, 4, 64), (torch.float16, 8, 1, 128)],
)
def test_copy_blocks(dtype, block_size, num_kv_heads, head_dim, device):
    gen = torch.Generator().manual_seed(5)
    num_layers, num_blocks = 3, 12
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    src, dst = perm[:4].to(torch.int32).to(device), perm[4:8].to(torch.int32).to(device)
    expect = kv_cache.clone()
    ref.copy_blocks_ref(expect, src, dst)
    copy_blocks(kv_cache, src, dst)
    assert torch.equal(bits(kv_cache), bits(expect))


def test_copy_blocks_empty(device):
    kv_cache = torch.zeros(1, 2, 4, 8, 1, 16, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    copy_blocks(kv_cache, empty, empty)
    assert not kv_cache.any()
