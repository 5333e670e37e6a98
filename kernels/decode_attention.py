"""Triton paged decode attention (one query token per sequence), GQA and split-KV.

A program owns one (sequence, kv head, split): it loads the query rows of every
query head that shares the kv head (padded to 16 rows for tl.dot), walks its
share of the context in tiles of BLOCK_N tokens gathered through the block
table, and keeps an online softmax in float32. With one split it writes the
output; with several (flash-decoding) it writes a partial output and its
log-sum-exp, and a second small kernel (merge_splits) merges the splits.
Given the step's new K/V (k_new / v_new), the program holding a row's newest
position writes them into the cache before its loop, so a decode step needs no
separate append launch.

Launch parameters (splits, tile, warps, stages) come from choose_decode_launch,
a pure function of shapes, so they are fixed per captured CUDA graph. The grid
depends only on shapes and host ints (batch, kv heads, num_splits): the
launcher never reads context_lens, so a launch is CUDA-graph capturable. A
split's token range is derived in the kernel from the sequence's actual
length, so splits past the end of a short sequence exit after writing an
empty partial (lse = -inf).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_quant import check_cache_dtype, f16_math, f16_queries, is_fp8, to_cache
from kernels.pdl import pdl_launch, pdl_prologue

_LOG2E = 1.4426950408889634
_MIN_QUERY_ROWS = 16  # tl.dot needs M >= 16

# Split-KV policy, set for H200 from the sweeps below (the sweep tool is in git history).
# A decode program is one (sequence, kv head, split); memory-bound work needs several
# programs per SM in flight to cover HBM latency.
SPLIT_PROGRAMS_PER_SM = 4  # split until about this many programs per SM
ONE_PASS_PROGRAMS_PER_SM = 2  # no split once batch * kv heads reaches this many per SM
# Per head_dim where measured: (ONE_PASS_PROGRAMS_PER_SM, SPLIT_PROGRAMS_PER_SM). On H200
# gpt2 (head_dim 64) at B=64, ctx 528 ran 1.31x faster in 2 splits (11.6 programs per SM)
# than in one pass (5.8), and at B=256, ctx 192, one pass (23 per SM) was best; qwen3
# (head_dim 128, twice the bytes a program reads per token) at B=64 was best in one pass
# at 3.9 programs per SM, with every row at one context. In serving the rows' contexts
# differ and a one-pass program's work is its row's whole context: qwen3's steady-state
# ITL at batch 64 (bench.engine, ages spread) was 2.40 ms in 3 splits against 2.85 in one
# pass, while the lockstep cohort went 2.37 against 2.20-2.27. Serving decides: head_dim
# 128 splits.
SPLIT_POLICY = {64: (8, 8), 128: (8, 8)}
MIN_TOKENS_PER_SPLIT = 128  # two 64-token tiles: a split shorter than this is all latency
MAX_SPLITS = 128
MERGE_DIM_BLOCK = 32  # head_dim slice per merge program


@dataclass(frozen=True)
class DecodeTiles:
    """Per-program launch parameters of the decode kernel."""

    block_n: int  # tokens per tile
    num_warps: int
    num_stages: int  # software-pipelining depth over the tile loop

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of 2 >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad num_warps/num_stages: {self.num_warps}/{self.num_stages}")


# Keyed by head_dim; swept on H200: one pass at B=256 ctx=1024: 32/2w/2s 98% (gpt2) and
# 102% (qwen3) of copy bandwidth against 96% / 94% for 64/4w/2s; split at B=1 ctx=8192:
# 64/4w/2s was best (50% / 52%).
ONE_PASS_TILES = {
    64: DecodeTiles(block_n=32, num_warps=2, num_stages=2),
    128: DecodeTiles(block_n=32, num_warps=2, num_stages=2),
}
SPLIT_TILES = {
    64: DecodeTiles(block_n=64, num_warps=4, num_stages=2),
    128: DecodeTiles(block_n=64, num_warps=4, num_stages=2),
}
# One pass over an fp8 cache (swept on H200; docs/design.md, "fp8 KV cache"): a tile of
# half the bytes is half the work in flight, so both take 64 tokens: gpt2 256 rows at ctx
# 192 33.5 us against 42.0 for 32/2w/2s; qwen3 (bf16 queries, once they multiply in fp16:
# f16_math) 256 rows at ctx 1024 168 against 254 us, and its engine step at 256 rows 2.58
# against 2.64 ms. Split tiles stay as above.
ONE_PASS_TILES_FP8 = {
    64: DecodeTiles(block_n=64, num_warps=2, num_stages=2),
    128: DecodeTiles(block_n=64, num_warps=2, num_stages=2),
}


@dataclass(frozen=True)
class DecodeLaunch:
    """Everything paged_decode_attention launches with; fixed per shape (and CUDA graph)."""

    num_splits: int
    tiles: DecodeTiles


def default_tiles(head_dim: int, split: bool, kv_fp8: bool = False) -> DecodeTiles:
    """The tuned tile for this head_dim (and cache dtype); other head dims scale block_n
    to ~8 KiB of K."""
    if kv_fp8 and not split and head_dim in ONE_PASS_TILES_FP8:
        return ONE_PASS_TILES_FP8[head_dim]
    table = SPLIT_TILES if split else ONE_PASS_TILES
    if head_dim in table:
        return table[head_dim]
    return DecodeTiles(block_n=max(16, min(64, 8192 // head_dim)), num_warps=4, num_stages=2)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context_len_hint: int,
    num_sms: int,
    head_dim: int | None = None,
) -> int:
    """How many KV splits per (sequence, kv head): a pure function of shapes.

    One pass when batch * num_kv_heads programs already give ONE_PASS_PROGRAMS_PER_SM
    per SM; otherwise enough splits for about SPLIT_PROGRAMS_PER_SM programs per SM,
    each covering at least MIN_TOKENS_PER_SPLIT tokens of the longest possible
    context, at most MAX_SPLITS. Non-increasing in batch. The two thresholds come
    from SPLIT_POLICY for a measured head_dim.
    """
    one_pass_per_sm, split_per_sm = SPLIT_POLICY.get(
        head_dim, (ONE_PASS_PROGRAMS_PER_SM, SPLIT_PROGRAMS_PER_SM)
    )
    base = batch * num_kv_heads
    if base >= one_pass_per_sm * num_sms:
        return 1
    by_occupancy = triton.cdiv(split_per_sm * num_sms, base)
    by_length = max(1, max_context_len_hint // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def choose_decode_launch(
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    max_context_len_hint: int,
    num_sms: int,
    kv_fp8: bool = False,
) -> DecodeLaunch:
    """Split count and tile for a decode shape: a pure function, chosen once per shape."""
    num_splits = choose_num_splits(batch, num_kv_heads, max_context_len_hint, num_sms, head_dim)
    return DecodeLaunch(num_splits, default_tiles(head_dim, num_splits > 1, kv_fp8))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (tl.dot would default to tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (cached); a small stand-in on CPU for the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter on CPU: small so that tests reach the split path


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, slot_mapping_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    k_new_ptr, v_new_ptr,  # APPEND: each row's newest K/V, at position ctx_len - 1
    qk_scale,  # scale * log2(e)
    num_splits,
    stride_q_row, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt,
    stride_out_row, stride_out_head,
    stride_new_row, stride_new_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    APPEND: tl.constexpr, KV_FP8: tl.constexpr, F16_MATH: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)  # kernels.pdl: the merge (or next) kernel launches while this one runs
    # The heads of one row are adjacent programs: a token's K (or V) for all kv heads is
    # one contiguous run of the cache, so programs running together read it together.
    kv_head = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    # Positions in int32 whatever the index dtype: the engine passes int64 rows, and over
    # an fp8 cache the fused append's code then took a gpt2 launch from 42 to 60 us (H200).
    ctx_len = tl.load(context_lens_ptr + row).to(tl.int32)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    bt_row = block_table_ptr + slot * stride_bt

    # Each split covers a whole number of tiles of this sequence's actual length.
    tiles = tl.cdiv(ctx_len, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx_len)

    g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query head within the group
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    q_ptrs = q_ptr + row * stride_q_row + head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    q, qk_scale = f16_queries(q, qk_scale, F16_MATH)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    head_off = kv_head * stride_cache_head
    if APPEND:
        # The split holding the newest token (position ctx_len - 1) writes it to the cache
        # first; the barrier makes the write visible to this program's own loads below.
        # No other program reads that position.
        last = ctx_len - 1
        if (start <= last) & (last < end):
            new_off = row * stride_new_row + kv_head * stride_new_head + d  # [HEAD_DIM]
            block = tl.load(bt_row + last // BLOCK_SIZE).to(tl.int64)
            dst = block * stride_cache_block + (last % BLOCK_SIZE) * stride_cache_slot + head_off
            k_new = to_cache(tl.load(k_new_ptr + new_off), k_cache_ptr, KV_FP8)
            v_new = to_cache(tl.load(v_new_ptr + new_off), v_cache_ptr, KV_FP8)
            tl.store(k_cache_ptr + dst + d, k_new)
            tl.store(v_cache_ptr + dst + d, v_new)
        tl.debug_barrier()
    for tile_start in range(start, end, BLOCK_N):
        tok = tile_start + n  # [BLOCK_N]
        tok_mask = tok < end
        block = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        tok_off = block * stride_cache_block + (tok % BLOCK_SIZE) * stride_cache_slot + head_off
        kv_off = tok_off[:, None] + d[None, :]  # [BLOCK_N, HEAD_DIM]
        # V is loaded with K (not after the softmax) so both tiles are in flight together.
        # An fp8 cache's tiles convert to q's dtype exactly (a no-op for a 16-bit cache).
        k = tl.load(k_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0).to(q.dtype)
        # [GROUP_PAD, BLOCK_N] scores in the log2 domain
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Empty split: l_i == 0, m_i == -inf -> partial 0 with lse -inf.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # log2 domain
        part_row = (row * tl.num_programs(0) * GROUP + head) * num_splits + split  # [GROUP_PAD]
        tl.store(part_lse_ptr + part_row, lse, mask=g_mask)
        part_ptrs = part_out_ptr + part_row[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
        tl.store(part_ptrs, acc / l_safe[:, None], mask=g_mask[:, None])
    else:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + row * stride_out_row + head[:, None] * stride_out_head + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_heads, num_splits,
    stride_out_row, stride_out_head,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)  # launched early (kernels.pdl): waits here for the split kernel
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.program_id(2) * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
    s_mask = s < num_splits
    base = (row * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 is never empty, so max is finite
    part_ptrs = part_out_ptr + (base + s)[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
    part = tl.load(part_ptrs, mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, DIM_BLOCK]
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    out_ptrs = out_ptr + row * stride_out_row + head * stride_out_head + d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq], int32
    slot_mapping: torch.Tensor,  # [B]: table row of batch row i
    context_lens: torch.Tensor,  # [B]: tokens in cache, the query's own included (>= 1)
    scale: float,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim]
    num_splits: int | None = None,
    max_context_len: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_new: torch.Tensor | None = None,  # [B, num_kv_heads, head_dim]
    v_new: torch.Tensor | None = None,
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Paged decode attention with GQA; split-KV (flash-decoding) when the batch is small.

    With k_new / v_new (head_dim contiguous, any row and head strides) the kernel
    appends each row's newest token too: the program whose split holds position
    context_lens[i] - 1 writes them there (what append_kv_slots does with positions =
    context_lens - 1) before its own loop reads it, so the cache need not hold that token
    yet. One launch instead of two; no program reads a position another one writes.

    Constraints: num_heads % num_kv_heads == 0; head_dim a power of 2 >= 16;
    head_dim contiguous in q, out and the caches; fp16/bf16/fp32 (accumulated in
    fp32); the caches in q's dtype or float8_e4m3fn (kernels.kv_quant). Launch
    parameters left None come from choose_decode_launch, with max_context_len
    (default: the block table width * block_size) as the length hint; explicit
    num_splits / block_n / num_warps / num_stages override them (the tile defaults
    then follow the given num_splits). workspace: optional
    (partial_out [B*num_heads*num_splits*head_dim] fp32, partial_lse
    [B*num_heads*num_splits] fp32) for the split path; allocated per call when
    absent. Never reads device data on the host.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.dtype == v_cache.dtype, "the K and V caches must share a dtype"
    check_cache_dtype(q, k_cache)
    append = k_new is not None
    if append:
        assert v_new is not None and k_new.shape == v_new.shape, "k_new and v_new together"
        assert k_new.shape == (num_rows, num_kv_heads, head_dim), "k_new: [B, kv heads, dim]"
        assert k_new.stride() == v_new.stride() and k_new.stride(2) == 1
        assert k_new.dtype == q.dtype == v_new.dtype, "k_new and v_new must share q's dtype"
    out = torch.empty_like(q) if out is None else out
    if num_rows == 0:
        return out
    kv_fp8 = is_fp8(k_cache)
    if num_splits is None:
        hint = max_context_len or block_table.shape[1] * block_size
        sms = num_sms(q.device)
        launch = choose_decode_launch(num_rows, num_kv_heads, head_dim, hint, sms, kv_fp8)
    else:
        launch = DecodeLaunch(num_splits, default_tiles(head_dim, num_splits > 1, kv_fp8))
    num_splits, tiles = launch.num_splits, launch.tiles
    group = num_heads // num_kv_heads
    split = num_splits > 1
    if split:
        part_out, part_lse = workspace or _workspace(num_rows, num_heads, num_splits, head_dim, q)
    else:
        part_out = part_lse = out
    new = (k_new, v_new) if append else (q, q)
    _decode_kernel[(num_kv_heads, num_rows, num_splits)](
        q, k_cache, v_cache, block_table, slot_mapping, context_lens,
        out, part_out, part_lse, *new,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        new[0].stride(0), new[0].stride(1),
        GROUP=group, GROUP_PAD=max(_MIN_QUERY_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n or tiles.block_n, SPLIT=split,
        APPEND=append, KV_FP8=kv_fp8, F16_MATH=f16_math(q, k_cache),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or tiles.num_warps, num_stages=num_stages or tiles.num_stages,
        **pdl_launch(q.device, pdl),
    )  # fmt: skip
    if split:
        merge_splits(part_out, part_lse, out, num_splits, pdl=pdl)
    return out


def merge_splits(
    part_out: torch.Tensor,  # [B * num_heads * num_splits * head_dim] fp32
    part_lse: torch.Tensor,  # [B * num_heads * num_splits] fp32, log2 domain
    out: torch.Tensor,  # [B, num_heads, head_dim]
    num_splits: int,
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> None:
    """Combine split partials into out: one program per (row, head, 32-wide slice of head_dim).

    At B=1 this is a latency-bound kernel: slicing head_dim gives it 2-4x more
    programs, each loading all splits of its slice at once (every program reloads
    the splits' log-sum-exps, a few hundred bytes).
    """
    num_rows, num_heads, head_dim = out.shape
    splits_pad = triton.next_power_of_2(num_splits)
    dim_block = min(head_dim, MERGE_DIM_BLOCK)
    _merge_kernel[(num_rows, num_heads, head_dim // dim_block)](
        part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=splits_pad, DIM_BLOCK=dim_block,
        num_warps=max(1, min(8, splits_pad * dim_block // (32 * 64))),
        **pdl_launch(out.device, pdl),
    )  # fmt: skip


def _workspace(
    num_rows: int, num_heads: int, num_splits: int, head_dim: int, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_parts = num_rows * num_heads * num_splits
    part_out = torch.empty(num_parts * head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_parts, dtype=torch.float32, device=q.device)
    return part_out, part_lse
