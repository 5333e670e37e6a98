"""Paged decode attention vs the torch reference; split-KV, GQA, dtypes, ragged lengths."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference as ref
from kernels.decode_attention import (
    DecodeLaunch,
    DecodeTiles,
    choose_decode_launch,
    choose_num_splits,
    default_tiles,
    paged_decode_attention,
)
from tests.kernels.kernel_helpers import (
    TOL,
    bits,
    filled_cache,
    poison_outside_context,
    random_block_table,
    shuffled_slots,
)


def _run_case(
    dtype, num_heads, num_kv_heads, head_dim, block_size, ctx_lens, num_splits, device, seed=0,
    append=False, cache_dtype=None, index_dtype=torch.int32, **launch,
):  # fmt: skip
    """cache_dtype: the caches' dtype (None: dtype; float8_e4m3fn: an fp8 cache).
    index_dtype: slot_mapping's and context_lens' (the engine passes int64 rows).
    append: the newest token of each row comes as k_new / v_new (strided views of one
    qkv tensor, as a model's projection gives them), its cache position holds NaN before
    the launch, and the caches must equal the reference's append afterwards."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(ctx_lens)
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    num_blocks = (num_rows + 1) * max_blocks
    k_cache, v_cache = filled_cache(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, gen, device, cache_dtype
    )
    block_table = random_block_table(num_rows, max_blocks, num_blocks, gen, device)
    slot_mapping = shuffled_slots(num_rows, gen, device).to(index_dtype)
    context_lens = torch.tensor(ctx_lens, dtype=index_dtype, device=device)
    poison_outside_context(k_cache, block_table, slot_mapping, context_lens)
    poison_outside_context(v_cache, block_table, slot_mapping, context_lens)
    q = torch.randn(num_rows, num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    if append:
        kv_width = num_kv_heads * head_dim
        qkv = torch.randn(num_rows, 3 * kv_width + 8, generator=gen).to(dtype).to(device)
        k_new = qkv[:, 8 : 8 + kv_width].view(num_rows, num_kv_heads, head_dim)
        v_new = qkv[:, 8 + kv_width : 8 + 2 * kv_width].view(num_rows, num_kv_heads, head_dim)
        launch |= {"k_new": k_new, "v_new": v_new}
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        positions = context_lens.long() - 1
        ref.append_kv_slots_ref(
            k_new, v_new, expect_k, expect_v, block_table, slot_mapping, positions
        )
        blocks = block_table[slot_mapping.long(), positions // block_size].long()
        k_cache[blocks, positions % block_size] = float("nan")  # written before it is read
        v_cache[blocks, positions % block_size] = float("nan")
        expect = ref.paged_decode_attention_ref(
            q, expect_k, expect_v, block_table, slot_mapping, context_lens, scale
        )
    else:
        expect = ref.paged_decode_attention_ref(
            q, k_cache, v_cache, block_table, slot_mapping, context_lens, scale
        )
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(
        q, k_cache, v_cache, block_table, slot_mapping, context_lens, scale, out=out,
        num_splits=num_splits, **launch,
    )  # fmt: skip
    assert got is out
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), **TOL[dtype])
    if append:
        assert torch.equal(bits(k_cache), bits(expect_k)), "K cache after the append"
        assert torch.equal(bits(v_cache), bits(expect_v)), "V cache after the append"


# (dtype, num_heads, num_kv_heads, head_dim, block_size): GQA 1/2/4, every dtype,
# block sizes 16/32/64, head_dim 64/128; contexts 1, a block, a block + 1, many blocks.
CASES = [
    (torch.float32, 2, 2, 64, 16),
    (torch.float16, 4, 2, 128, 32),
    (torch.bfloat16, 8, 2, 64, 64),
    (torch.float16, 4, 1, 64, 16),
    (torch.bfloat16, 2, 1, 128, 16),
]


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(
    dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits, device
):
    ctx_lens = [1, block_size, block_size + 1, 5 * block_size - 3]
    _run_case(dtype, num_heads, num_kv_heads, head_dim, block_size, ctx_lens, num_splits, device)


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_append_matches_append_then_decode(
    dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits, device
):
    """The newest token at every place in a block: first, last, a block's first, one token."""
    ctx_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1]
    _run_case(
        dtype, num_heads, num_kv_heads, head_dim, block_size, ctx_lens, num_splits, device,
        seed=num_splits, append=True,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_decode_with_append_random_shapes(seed, device):
    rng = random.Random(100 + seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4])
    head_dim, block_size = rng.choice([64, 128]), rng.choice([8, 16, 32])
    ctx_lens = [rng.randint(1, 200) for _ in range(rng.randint(1, 4))]
    _run_case(
        dtype, num_kv_heads * group, num_kv_heads, head_dim, block_size, ctx_lens,
        rng.choice([1, 2, 7, None]), device, seed=seed, append=True,
    )  # fmt: skip


def test_decode_append_rejects_mismatched_new_rows(device):
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=device)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device=device)
    table = torch.zeros(3, 2, dtype=torch.int32, device=device)
    rows = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="k_new"):
        paged_decode_attention(
            q, cache, cache, table, rows, rows + 1, 0.1,
            k_new=torch.zeros(2, 4, 64, dtype=torch.float16, device=device),
            v_new=torch.zeros(2, 4, 64, dtype=torch.float16, device=device),
        )  # fmt: skip


def test_decode_more_splits_than_tiles(device):
    """Splits past the end of a short sequence write empty partials that the merge ignores."""
    _run_case(torch.float32, 4, 2, 64, 16, [1, 3, 70], 8, device)


def test_decode_auto_splits(device):
    _run_case(torch.float16, 2, 1, 64, 32, [33, 200], None, device)


def test_decode_block_size_8_head_dim_32(device):
    _run_case(torch.float32, 4, 4, 32, 8, [9, 24], 2, device)


@pytest.mark.parametrize("seed", range(8))
def test_decode_random_shapes(seed, device):
    """Seeded random configs: block sizes 8..128, GQA 1..8, any split count."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4, 8])
    head_dim, block_size = rng.choice([64, 128]), rng.choice([8, 16, 32, 64, 128])
    ctx_lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 3))]
    num_splits = rng.choice([1, 2, 5, None])
    _run_case(
        dtype, num_kv_heads * group, num_kv_heads, head_dim, block_size, ctx_lens, num_splits,
        device, seed=seed,
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 6])
def test_decode_ragged_batch(num_splits, device):
    """Lengths from 1 token to many tiles in one batch: short rows get empty splits."""
    _run_case(torch.float16, 4, 2, 64, 16, [1, 300, 17, 64, 2], num_splits, device, seed=3)


def test_decode_many_splits(device):
    """33 splits (merge pads to 64) over a context of 35 tiles of 16 tokens."""
    _run_case(torch.float32, 2, 1, 64, 16, [560, 40], 33, device, block_n=16)


@pytest.mark.parametrize("block_n", [16, 32, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_tile_overrides(block_n, num_splits, device):
    _run_case(
        torch.bfloat16, 4, 2, 128, 16, [5, 129, 200], num_splits, device,
        block_n=block_n, num_warps=2, num_stages=3,
    )  # fmt: skip


def test_choose_num_splits_one_pass_when_grid_fills_gpu():
    assert choose_num_splits(256, 8, 1024, 132) == 1
    assert choose_num_splits(64, 12, 8192, 132) == 1
    assert choose_num_splits(256, 8, 8192, 132, head_dim=128) == 1  # qwen3 at 15.5 per SM
    assert choose_num_splits(256, 12, 8192, 132, head_dim=64) == 1
    assert choose_num_splits(96, 12, 8192, 132, head_dim=64) == 1  # 8.7 programs per SM


def test_choose_num_splits_splits_gpt2_at_batch_64():
    # head_dim 64 at batch 64: 5.8 programs per SM in one pass; two splits measured 1.31x.
    assert choose_num_splits(64, 12, 8192, 132, head_dim=64) == 2
    assert choose_num_splits(64, 12, 128, 132, head_dim=64) == 1  # too short to split
    launch = choose_decode_launch(64, 12, 64, 1024, 132)
    assert launch.num_splits == 2 and launch.tiles == default_tiles(64, split=True)


def test_choose_num_splits_splits_qwen3_at_batch_64():
    # head_dim 128 at batch 64, contexts spread as in serving: 3 splits measured 1.19x.
    assert choose_num_splits(64, 8, 2048, 132, head_dim=128) == 3


def test_choose_num_splits_fills_gpu_at_batch_one():
    for num_kv_heads in (8, 12):
        splits = choose_num_splits(1, num_kv_heads, 8192, 132)
        assert splits * num_kv_heads >= 2 * 132  # several programs per SM in flight
        assert splits <= 8192 // 64  # every split has at least one 64-token tile


def test_choose_num_splits_bounded_by_context_and_monotone():
    assert choose_num_splits(1, 8, 128, 132) == 1  # too short to be worth splitting
    assert choose_num_splits(1, 1, 10**6, 132) <= 128
    for num_kv_heads in (1, 4, 8, 12):
        counts = [choose_num_splits(b, num_kv_heads, 8192, 132) for b in (1, 2, 4, 8, 16, 32, 64)]
        assert counts == sorted(counts, reverse=True)
        assert all(c >= 1 for c in counts)


def test_choose_decode_launch_is_a_pure_function_of_shapes():
    launch = choose_decode_launch(1, 8, 128, 8192, 132)
    assert launch == choose_decode_launch(1, 8, 128, 8192, 132)
    assert launch.num_splits == choose_num_splits(1, 8, 8192, 132) > 1
    one_pass = choose_decode_launch(256, 8, 128, 1024, 132)
    assert one_pass.num_splits == 1
    for head_dim in (32, 64, 128, 256):
        tiles = choose_decode_launch(1, 8, head_dim, 8192, 132).tiles
        assert tiles.block_n * head_dim <= 128 * 128  # a K tile stays in registers


def test_fp8_caches_take_their_own_one_pass_tiles():
    from kernels.decode_attention import ONE_PASS_TILES, ONE_PASS_TILES_FP8

    assert choose_decode_launch(256, 12, 64, 1024, 132).tiles == ONE_PASS_TILES[64]
    fp8 = choose_decode_launch(256, 12, 64, 1024, 132, kv_fp8=True)
    assert fp8 == DecodeLaunch(1, ONE_PASS_TILES_FP8[64]) != DecodeLaunch(1, ONE_PASS_TILES[64])
    # A head_dim without an fp8 entry keeps the tile of its cache in the model's dtype.
    assert 256 not in ONE_PASS_TILES_FP8
    fp8 = choose_decode_launch(256, 4, 256, 1024, 132, kv_fp8=True)
    assert fp8 == choose_decode_launch(256, 4, 256, 1024, 132)
    # Splits keep their tiles whatever the cache holds.
    split = choose_decode_launch(1, 8, 128, 8192, 132, kv_fp8=True)
    assert split.tiles == choose_decode_launch(1, 8, 128, 8192, 132).tiles


def test_decode_tiles_reject_bad_values():
    with pytest.raises(ValueError):
        DecodeTiles(block_n=48, num_warps=4, num_stages=2)
    with pytest.raises(ValueError):
        DecodeTiles(block_n=64, num_warps=3, num_stages=2)
