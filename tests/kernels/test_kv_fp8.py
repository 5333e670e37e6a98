"""fp8 (e4m3) KV caches: every kernel that writes or reads the cache, against the references.

Writes must equal kernels.reference.quantize_kv_ref bit for bit (the same rounding on
the GPU, in the interpreter and in torch); reads attend the stored values exactly, so
the attention kernels meet the same tolerances as with a cache in the query's dtype.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.copy_blocks import copy_blocks
from kernels.decode_attention import paged_decode_attention
from kernels.kv_append import append_kv, append_kv_prefill, append_kv_slots
from tests.kernels import test_decode_attention, test_prefill_attention
from tests.kernels.kernel_helpers import bits, random_block_table, shuffled_slots

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _every_rounding_case() -> torch.Tensor:
    """Each finite e4m3 value, the midpoints between neighbours (ties), the floats just
    either side of each midpoint, values past the +-448 saturation, signed zeros, and a
    random spread over 1e-5..1e3."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=gen) * torch.logspace(-5, 3, 4096)
    extremes = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e6, -1e6, 0.0, -0.0, 1e-9, -1e-9])
    return torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down), extremes, spread])


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_rounds_like_torch(dtype, device):
    """The kernels' e4m3 conversion (on the bits) against torch's cast, over every case."""
    x = _every_rounding_case().to(dtype)
    width = 64
    x = torch.cat([x, x.new_zeros(-len(x) % width)]).view(-1, 1, width).to(device)
    num_rows = x.shape[0]
    k_cache = torch.full((num_rows, 1, 1, width), float("nan"), dtype=FP8, device=device)
    v_cache = k_cache.clone()
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    zeros = torch.zeros_like(rows)
    append_kv(x, -x, k_cache, v_cache, rows, zeros)
    k_expect, v_expect = ref.quantize_kv_ref(x, FP8), ref.quantize_kv_ref(-x, FP8)
    assert torch.equal(bits(k_cache[:, 0]), bits(k_expect))
    assert torch.equal(bits(v_cache[:, 0]), bits(v_expect))
    # Saturation, not overflow to NaN; the cast the reference defines.
    assert k_cache.float().abs().max() == 448.0


def test_quantize_ref_is_a_cast_for_other_dtypes():
    x = torch.randn(5, 3)
    assert torch.equal(ref.quantize_kv_ref(x, torch.float16), x.to(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_slots_and_prefill_forms(dtype, device):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks = 12, 64, 16, 32  # GPT-2's 768-wide row
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_rows, max_blocks = 5, 4
    k = (3 * torch.randn(num_rows, num_kv_heads, head_dim, generator=gen)).to(dtype).to(device)
    v = torch.randn(num_rows, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    block_table = random_block_table(num_rows, max_blocks, num_blocks, gen, device)
    slots = shuffled_slots(num_rows, gen, device)
    positions = torch.tensor([0, 15, 16, 63, 7], dtype=torch.int32, device=device)
    k_cache = torch.full(shape, float("nan"), dtype=FP8, device=device)
    v_cache = k_cache.clone()
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_slots_ref(k, v, k_expect, v_expect, block_table, slots, positions)
    append_kv_slots(k, v, k_cache, v_cache, block_table, slots, positions)
    assert torch.equal(bits(k_cache), bits(k_expect))
    assert torch.equal(bits(v_cache), bits(v_expect))

    # Packed prefill: two sequences of 3 and 2 tokens from positions 5 and 30.
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    starts = torch.tensor([5, 30], dtype=torch.int32, device=device)
    seq_slots = slots[:2].contiguous()
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.append_kv_prefill_ref(k, v, k_expect, v_expect, block_table, seq_slots, cu, starts)
    append_kv_prefill(k, v, k_cache, v_cache, block_table, seq_slots, cu, starts, max_seqlen=3)
    assert torch.equal(bits(k_cache), bits(k_expect))
    assert torch.equal(bits(v_cache), bits(v_expect))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,head_dim,block_size",
    [(torch.float16, 4, 4, 64, 16), (torch.bfloat16, 8, 2, 128, 16), (torch.float32, 4, 1, 64, 8)],
)
def test_decode_attention_fp8_cache(
    dtype, num_heads, num_kv_heads, head_dim, block_size, append, num_splits, index_dtype, device
):
    """The fused append quantizes (the cache equals the reference's bit for bit) and the
    loop attends the stored e4m3 values, as the reference does in fp32; with the int32
    index tensors of the tests and the int64 ones the engine passes."""
    test_decode_attention._run_case(
        dtype, num_heads, num_kv_heads, head_dim, block_size, [1, 17, 70, 33], num_splits,
        device, seed=4, append=append, cache_dtype=FP8, index_dtype=index_dtype,
    )  # fmt: skip


@pytest.mark.parametrize("pad_tokens", [None, 5])
@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,head_dim,block_size",
    [(torch.float16, 4, 4, 64, 16), (torch.bfloat16, 8, 2, 128, 32)],
)
def test_prefill_attention_fp8_cache(
    dtype, num_heads, num_kv_heads, head_dim, block_size, pad_tokens, device
):
    """Both launch forms: fresh prompts, a prefix hit, a chunk over a long prefix."""
    bs = block_size
    chunks = [(0, 1), (0, bs + 1), (2 * bs, 5), (bs + 3, 2 * bs + 7)]
    test_prefill_attention._run_case(
        dtype, num_heads, num_kv_heads, head_dim, block_size, chunks, device, seed=5,
        pad_tokens=pad_tokens, cache_dtype=FP8,
    )  # fmt: skip


def test_copy_blocks_fp8_moves_bytes(device):
    """Blocks move as bytes: NaN codes and signed zeros arrive unchanged."""
    gen = torch.Generator().manual_seed(6)
    shape = (2, 2, 6, 8, 2, 16)
    kv_cache = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(FP8)
    kv_cache = kv_cache.to(device)
    src = torch.tensor([0, 2], dtype=torch.int32, device=device)
    dst = torch.tensor([5, 3], dtype=torch.int32, device=device)
    expect = kv_cache.clone()
    ref.copy_blocks_ref(expect, src, dst)
    copy_blocks(kv_cache, src, dst)
    assert torch.equal(bits(kv_cache), bits(expect))


def test_cache_of_another_float_dtype_is_refused(device):
    q = torch.zeros(1, 2, 64, dtype=torch.float32, device=device)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device=device)
    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="the cache must be"):
        paged_decode_attention(q, cache, cache, table, one - 1, one, 0.125)
