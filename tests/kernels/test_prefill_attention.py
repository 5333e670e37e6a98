"""Paged prefill attention vs the torch reference: fresh prompts, prefix hits, chunks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels import reference as ref
from kernels.prefill_attention import (
    paged_prefill_attention,
    prefill_block_q,
    prefill_short_q,
    prefill_tiles,
    prefill_work_capacity,
    prefill_work_list,
)
from tests.kernels.kernel_helpers import (
    TOL,
    filled_cache,
    poison_outside_context,
    random_block_table,
    shuffled_slots,
)


def _run_case(
    dtype, num_heads, num_kv_heads, head_dim, block_size, chunks, device, seed=0, pad_tokens=None,
    cache_dtype=None, short_q=None, long_context=None,
):  # fmt: skip
    """chunks: (cached prefix length, chunk length) per sequence.
    cache_dtype: the caches' dtype (None: dtype; float8_e4m3fn: an fp8 cache).

    pad_tokens: None for the grid launch form; else the work-list form over a
    token bucket with pad_tokens padding rows, which must stay unwritten. short_q:
    the work list's short chunks (None: the engine's prefill_short_q; 0: none).
    long_context: chunks of that many keys or more go on the long list (None: no list).
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(chunks)
    ctx_lens = [prefix + q_len for prefix, q_len in chunks]
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    num_blocks = (num_seqs + 1) * max_blocks
    k_cache, v_cache = filled_cache(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, gen, device, cache_dtype
    )
    block_table = random_block_table(num_seqs, max_blocks, num_blocks, gen, device)
    slot_mapping = shuffled_slots(num_seqs, gen, device)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    poison_outside_context(k_cache, block_table, slot_mapping, context_lens)
    poison_outside_context(v_cache, block_table, slot_mapping, context_lens)
    q_lens = [q_len for _, q_len in chunks]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    expect = ref.paged_prefill_attention_ref(
        q, k_cache, v_cache, block_table, slot_mapping, cu, context_lens, scale
    )
    if pad_tokens is None:
        out = torch.full_like(q, float("nan"))
        got = paged_prefill_attention(
            q, k_cache, v_cache, block_table, slot_mapping, cu, context_lens, scale, out=out,
            max_q_len=max(q_lens),
        )  # fmt: skip
    else:
        num_tokens = sum(q_lens) + pad_tokens
        block_q = prefill_block_q(num_heads, num_kv_heads)
        if short_q is None:
            short_q = prefill_short_q(num_heads, num_kv_heads)
        work = np.zeros((prefill_work_capacity(num_tokens, num_seqs + 2, block_q), 2), np.int64)
        short = np.zeros((num_seqs + 2, 2), np.int64)
        long_q, long = 0, None
        if long_context is not None:
            rows = prefill_tiles(head_dim, cache_dtype or dtype).long.rows
            long_q = prefill_block_q(num_heads, num_kv_heads, rows)
            long = np.zeros((prefill_work_capacity(num_tokens, num_seqs, long_q), 2), np.int64)
        num_work = prefill_work_list(
            np.array(q_lens), block_q, work, short, short_q, context_lens=np.array(ctx_lens),
            long_out=long, long_q=long_q, long_context=long_context or 0,
        )  # fmt: skip
        is_long = [n > short_q and c >= (long_context or 1 << 30) for n, c in zip(q_lens, ctx_lens)]
        assert num_work == sum(
            1 if n <= short_q else -(-n // (long_q if b else block_q))
            for n, b in zip(q_lens, is_long)
        )
        assert (short[:, 0] >= 0).sum() == sum(n <= short_q for n in q_lens)
        if long is not None:
            assert sorted(set(long[long[:, 0] >= 0, 0])) == [i for i, b in enumerate(is_long) if b]
        q_bucket = torch.cat([q, q.new_zeros(pad_tokens, num_heads, head_dim)])
        out = torch.full_like(q_bucket, float("nan"))
        got = paged_prefill_attention(
            q_bucket, k_cache, v_cache, block_table, slot_mapping, cu, context_lens, scale,
            out=out, work=torch.from_numpy(work).to(device),
            short_work=torch.from_numpy(short).to(device),
            long_work=None if long is None else torch.from_numpy(long).to(device),
        )  # fmt: skip
        assert out[len(q) :].isnan().all(), "padding rows must stay unwritten"
        out = out[: len(q)]
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), **TOL[dtype])


CASES = [
    (torch.float32, 2, 2, 64, 16),
    (torch.float16, 4, 2, 128, 32),
    (torch.bfloat16, 8, 2, 64, 64),
    (torch.float16, 4, 1, 64, 16),
]


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_prefill_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, device):
    bs = block_size
    # fresh prompt of 1 token, a block, a block + 1; prefix-cache hit; chunked prefill.
    chunks = [(0, 1), (0, bs), (0, bs + 1), (2 * bs, 5), (bs + 3, 2 * bs + 7)]
    _run_case(dtype, num_heads, num_kv_heads, head_dim, block_size, chunks, device)


@pytest.mark.parametrize("seed", range(6))
def test_prefill_random_shapes(seed, device):
    """Seeded random configs: block sizes 8..128, GQA 1..4, random prefixes and chunks."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4])
    head_dim, block_size = rng.choice([64, 128]), rng.choice([8, 16, 32, 64, 128])
    chunks = [(rng.choice([0, rng.randint(1, 100)]), rng.randint(1, 80)) for _ in range(3)]
    _run_case(dtype, num_kv_heads * group, num_kv_heads, head_dim, block_size, chunks, device, seed)


def test_prefill_long_chunk_many_query_blocks(device):
    _run_case(torch.float32, 2, 1, 32, 16, [(0, 150), (37, 70)], device, seed=1)


def test_prefill_whole_tiles_before_the_diagonal(device):
    """Long chunks over long prefixes: most key tiles are visible to every row of their
    program and go unmasked, the diagonal ones masked (both forms)."""
    chunks = [(200, 300), (0, 257), (64, 64)]
    _run_case(torch.float16, 4, 2, 64, 16, chunks, device, seed=3)
    _run_case(torch.float16, 4, 2, 64, 16, chunks, device, seed=4, pad_tokens=5)


def test_prefill_group_3_not_power_of_two(device):
    _run_case(torch.float16, 6, 2, 64, 16, [(0, 20), (16, 9)], device, seed=2)


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_prefill_work_list_form(dtype, num_heads, num_kv_heads, head_dim, block_size, device):
    """The CUDA-graph form: a padded work list over a token bucket gives the same output."""
    bs = block_size
    chunks = [(0, 1), (0, bs + 1), (2 * bs, 5), (bs + 3, 2 * bs + 7)]
    _run_case(dtype, num_heads, num_kv_heads, head_dim, bs, chunks, device, pad_tokens=9)


@pytest.mark.parametrize("short", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2)])
def test_prefill_short_chunks(short, num_heads, num_kv_heads, device):
    """Decode rows riding in a prefill forward (one-token chunks over long contexts),
    chunks of exactly short_q and short_q + 1 tokens, beside long chunks: the short
    launch's 16-row programs give what the BLOCK_M programs give (short=False)."""
    short_q = prefill_short_q(num_heads, num_kv_heads)
    chunks = [(0, 40), (130, 1), (0, 1), (77, 1), (5, short_q), (9, short_q + 1), (64, 1)]
    _run_case(
        torch.float16, num_heads, num_kv_heads, 64, 16, chunks, device, seed=5, pad_tokens=3,
        short_q=None if short else 0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype,cache_dtype,num_heads,num_kv_heads,head_dim",
    [
        (torch.float16, None, 4, 2, 128),  # qwen3's head_dim: 128-row programs, 8 warps
        (torch.bfloat16, ref.FP8_KV_DTYPE, 2, 2, 64),  # gpt2's over an fp8 cache
        (torch.float16, ref.FP8_KV_DTYPE, 6, 2, 128),
    ],
)
def test_prefill_long_chunks(dtype, cache_dtype, num_heads, num_kv_heads, head_dim, device):
    """Chunks past long_context (here 96 keys) in the long launch's wider programs, beside
    ordinary and short chunks: a chunk after a long prefix, a long fresh prompt, a chunk
    that reaches the threshold exactly, and a decode row (short, whatever its context)."""
    chunks = [(0, 40), (100, 30), (0, 150), (90, 6), (200, 1), (10, 20)]
    _run_case(
        dtype, num_heads, num_kv_heads, head_dim, 16, chunks, device, seed=6, pad_tokens=4,
        cache_dtype=cache_dtype, long_context=96,
    )  # fmt: skip


def test_prefill_tiles_table():
    """Every tuned model has a short tile of 16 rows; the long tile, where there is one,
    has more rows than the main one (or it would not be worth a list of its own)."""
    for head_dim in (64, 128):
        for cache_dtype in (torch.float16, ref.FP8_KV_DTYPE):
            tiles = prefill_tiles(head_dim, cache_dtype)
            assert tiles.short.rows == 16
            assert tiles.long is None or tiles.long.rows > tiles.main.rows
    assert prefill_tiles(64, torch.float16).long is None  # gpt2: the main tile was best
    assert prefill_tiles(256, torch.bfloat16).main.block_n == 32  # untuned: the defaults


def test_prefill_work_list_layout():
    out = np.zeros((prefill_work_capacity(40, 4, 16), 2), np.int64)
    assert out.shape[0] == 3 + 4
    # Longest first, by the keys each program reads (ties in list order).
    assert prefill_work_list(np.array([1, 33, 16]), 16, out) == 1 + 3 + 1
    assert out.tolist() == [[1, 2], [1, 1], [1, 0], [2, 0], [0, 0], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="work"):
        prefill_work_list(np.array([64, 64]), 16, out[:7])
    # Chunks of 1..short_q tokens: one entry each on the short list; empty chunks none.
    short = np.zeros((4, 2), np.int64)
    assert prefill_work_list(np.array([1, 33, 0, 4, 5]), 16, out, short, 4) == 3 + 1 + 2
    assert out.tolist() == [[1, 2], [1, 1], [1, 0], [4, 0], [-1, -1], [-1, -1], [-1, -1]]
    assert short.tolist() == [[3, 0], [0, 0], [-1, -1], [-1, -1]]
    # A cached prefix counts: a chunk after 100 tokens reads more keys than a whole prompt.
    ctx = np.array([1, 33, 0, 40, 5 + 100])
    assert prefill_work_list(np.array([1, 33, 0, 4, 5]), 16, out, short, 4, context_lens=ctx) == 6
    assert out.tolist() == [[4, 0], [1, 2], [1, 1], [1, 0], [-1, -1], [-1, -1], [-1, -1]]
    assert short.tolist() == [[3, 0], [0, 0], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="short_work"):
        prefill_work_list(np.array([1, 1, 1, 1, 1]), 16, out, short, 4)
    # Long chunks (context >= long_context, not short) in blocks of long_q on their own list.
    long = np.zeros((4, 2), np.int64)
    q_lens, ctx = np.array([40, 3, 20, 50]), np.array([40, 300, 120, 100])
    n = prefill_work_list(
        q_lens, 16, out, short, 4, context_lens=ctx, long_out=long, long_q=32, long_context=100
    )
    assert n == 3 + 1 + (1 + 2)
    assert out.tolist()[:3] == [[0, 2], [0, 1], [0, 0]] and short.tolist()[0] == [1, 0]
    assert long.tolist() == [[2, 0], [3, 1], [3, 0], [-1, -1]]
    with pytest.raises(ValueError, match="long_work"):
        prefill_work_list(q_lens, 16, out, short, 4, context_lens=ctx, long_out=long[:2],
                          long_q=32, long_context=100)  # fmt: skip
