"""bench.overlap's kernels: the persistent read sums exactly the bytes it claims to read, at
any grid; the candidate group attention computes the reference's paged decode attention."""

from __future__ import annotations

import pytest
import torch

from bench.overlap import CHUNK, read_fn


@pytest.mark.parametrize("programs,unroll", [(1, 1), (3, 2), (5, 4), (64, 1)])
def test_stream_read_covers_every_element_once(programs: int, unroll: int) -> None:
    gen = torch.Generator().manual_seed(programs * 7 + unroll)
    n = 3 * CHUNK * unroll + 123  # a ragged tail; some programs may get nothing
    x = torch.randint(-4, 5, (n,), generator=gen).half()  # integers: the sum is exact
    out = torch.full((programs,), float("nan"), dtype=torch.float32)
    read_fn(x, out, programs, unroll, warps=4)()
    assert not out.isnan().any(), "every program writes its partial"
    assert out.sum().item() == x.float().sum().item()


@pytest.mark.parametrize(
    "num_heads,heads,head_dim,block_size", [(12, 4, 64, 16), (4, 2, 32, 8), (3, 1, 16, 16)]
)
@pytest.mark.parametrize("programs", [None, 2])
def test_group_attention_matches_the_reference(num_heads, heads, head_dim, block_size, programs):
    from bench.overlap import group_attention
    from kernels.reference import paged_decode_attention_ref

    gen = torch.Generator().manual_seed(num_heads * 31 + head_dim + (programs or 0))
    num_rows, max_blocks = 5, 6
    num_blocks = num_rows * max_blocks + 3
    cache_shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).half()
    v_cache = torch.randn(cache_shape, generator=gen).half()
    block_table = torch.randperm(num_blocks, generator=gen)[: num_rows * max_blocks]
    block_table = block_table.view(num_rows, max_blocks).to(torch.int32)
    slot_mapping = torch.randperm(num_rows, generator=gen).to(torch.int32)
    # One token, a block's worth exactly, ragged, the whole table.
    lens = [1, block_size, block_size + 3, 2 * block_size - 1, max_blocks * block_size]
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(num_rows, num_heads, head_dim, generator=gen).half()
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    group_attention(q, k_cache, v_cache, block_table, slot_mapping, context_lens, scale, out,
                    heads=heads, programs=programs)  # fmt: skip
    expect = paged_decode_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), block_table, slot_mapping, context_lens,
        scale,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expect, atol=2e-3, rtol=2e-3)
