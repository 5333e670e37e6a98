"""Triton paged prefill attention: packed chunks over their cached prefix and themselves.

Flash-attention tiling: a program owns BLOCK_Q query tokens of one sequence and
all GROUP query heads of one kv head (BLOCK_M = BLOCK_Q * GROUP_PAD rows, so
K/V are read once per kv head), and walks the sequence's keys through the block
table in tiles of BLOCK_N with an online softmax in float32: first the tiles every
row sees whole, with no mask, then the causal diagonal, masked. The chunk's own
K/V must already be in the cache, so prefix-cache hits and chunked prefill are
the same case: query j of a chunk of q_len sits at position
context_len - q_len + j and sees keys 0..that position.

Two launch forms. Grid form: (query blocks of max_q_len, sequences, kv heads),
sized by host ints. Work-list form: a device list of (sequence, query block)
pairs, built on the host by prefill_work_list and padded with sequence -1, so
the grid depends only on the list's capacity: the launch is CUDA-graph
capturable for a bucket of token counts, whatever the chunk lengths.

Short chunks (up to prefill_short_q tokens: decode rows riding in a prefill forward)
have a list and a launch of their own, in 16-row programs (tl.dot's least) on
a tile of their own: in the BLOCK_M programs a decode row paid for 63 empty
rows, and in one kernel with both shapes the short programs would get the long
ones' registers and shared memory, so as few of them per SM. Long chunks (a
context of LONG_CONTEXT keys or more) have a third list where the model's tiles
(prefill_tiles) give them wider programs: 128 query rows reuse each K/V tile
twice as often, which pays over long contexts and costs over short ones.

Each list comes longest program first, and a work-list launch's grid runs its
entries in that order with the kv head fastest, so that a causal launch's last
wave holds its shortest programs (with the kv head slowest, as the grid form
still has it, the last heads' longest programs ran last, into a ragged tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.kv_quant import FP8_KV_DTYPE, check_cache_dtype, f16_math, f16_queries

_LOG2E = 1.4426950408889634
_SHORT_ROWS = 16  # tl.dot's least
# A chunk whose context (cached prefix + chunk) reaches this many keys goes on the long
# list, where the model has a long tile (on an H200 the 128-row tiles gain 2-6% on
# 2048-token prompts and 12-14% at 8192, and lose 3-7% on 1024-token ones;
# docs/design.md, "Prefill attention").
LONG_CONTEXT = 2048


@dataclass(frozen=True)
class PrefillTile:
    rows: int  # query rows per program: query tokens x the padded query heads of a kv head
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillTiles:
    """One model's launch tiles: every chunk's, long chunks' (None: no long list, they go
    with every chunk) and short chunks'."""

    main: PrefillTile
    long: PrefillTile | None
    short: PrefillTile


# (head_dim, fp8 cache) -> the main, long and short launches' tiles (rows, keys, warps,
# stages), from sweeps on an H200 (docs/design.md, "Prefill attention").
_T = PrefillTile
_TILES = {
    (64, False): PrefillTiles(_T(64, 64, 4, 2), None, _T(16, 64, 2, 2)),
    (64, True): PrefillTiles(_T(64, 64, 4, 2), _T(128, 128, 4, 2), _T(16, 64, 2, 3)),
    (128, False): PrefillTiles(_T(64, 64, 4, 2), _T(128, 128, 8, 2), _T(16, 64, 2, 2)),
    (128, True): PrefillTiles(_T(64, 64, 4, 2), _T(128, 128, 8, 3), _T(16, 32, 1, 2)),
}


def prefill_tiles(head_dim: int, cache_dtype: torch.dtype) -> PrefillTiles:
    """The launch tiles for a head_dim and cache dtype; untuned head dims get the defaults
    (64 rows, 64 keys up to head_dim 128 else 32, 4 warps, 2 stages) and no long list."""
    tiles = _TILES.get((head_dim, cache_dtype == FP8_KV_DTYPE))
    if tiles is None:
        main = PrefillTile(64, 64 if head_dim <= 128 else 32, 4, 2)
        tiles = PrefillTiles(main, None, PrefillTile(16, 64, 2, 2))
    return tiles


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, tile_start, kv_end, q_pos, bt_row, k_cache_ptr, v_cache_ptr, head_off,
    stride_cache_block, stride_cache_slot, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One key tile's online-softmax update. Unmasked (MASKED False): every key of the
    tile is in the context and visible to every row, so no mask is built or applied."""
    tok = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    tok_mask = tok < kv_end
    if MASKED:
        block = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0)
    else:
        block = tl.load(bt_row + tok // BLOCK_SIZE)
    tok_off = block.to(tl.int64) * stride_cache_block + (tok % BLOCK_SIZE) * stride_cache_slot
    kv_off = (tok_off + head_off)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
    k = k.to(q.dtype)  # an fp8 cache's tile, exactly (a no-op otherwise)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = tok_mask[None, :] & (tok[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, slot_mapping_ptr, cu_seqlens_q_ptr,
    context_lens_ptr, out_ptr, work_ptr,
    qk_scale,  # scale * log2(e)
    stride_q_row, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt,
    stride_out_row, stride_out_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WORK: tl.constexpr, F16_MATH: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
):  # fmt: skip
    if HAS_WORK:  # grid (entries x kv heads,), kv head fastest: the list's order across heads
        entry = tl.program_id(0) // NUM_KV_HEADS
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        seq = tl.load(work_ptr + 2 * entry)
        q_block = tl.load(work_ptr + 2 * entry + 1)
        if seq < 0:
            return
    else:
        kv_head = tl.program_id(2)
        q_block = tl.program_id(0)
        seq = tl.program_id(1)
    row_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - row_start
    q_start = q_block * BLOCK_Q
    if q_start >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
    bt_row = block_table_ptr + slot * stride_bt

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [BLOCK_M] row = (query token, head in group)
    q_idx = q_start + r // GROUP_PAD
    g = r % GROUP_PAD
    row_mask = (q_idx < q_len) & (g < GROUP)
    q_pos = ctx_len - q_len + q_idx  # [BLOCK_M]
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_row = (row_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + q_row[:, None] * stride_q_row + (head * stride_q_head)[:, None] + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q, qk_scale = f16_queries(q, qk_scale, F16_MATH)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    kv_end = tl.minimum(ctx_len - q_len + tl.minimum(q_start + BLOCK_Q, q_len), ctx_len)
    # Keys up to the program's first query position are visible to all its rows: whole
    # tiles of them go unmasked, the causal diagonal (and the context's end) masked.
    full_end = (ctx_len - q_len + q_start + 1) // BLOCK_N * BLOCK_N
    head_off = kv_head * stride_cache_head
    for tile_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile_start, kv_end, q_pos, bt_row, k_cache_ptr, v_cache_ptr,
            head_off, stride_cache_block, stride_cache_slot, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, MASKED=False,
        )  # fmt: skip
    for tile_start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile_start, kv_end, q_pos, bt_row, k_cache_ptr, v_cache_ptr,
            head_off, stride_cache_block, stride_cache_slot, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, MASKED=True,
        )  # fmt: skip

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + q_row[:, None] * stride_out_row + (head * stride_out_head)[:, None]
    out_ptrs += d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq], int32
    slot_mapping: torch.Tensor,  # [num_seqs]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]: cached prefix + this chunk, all in cache
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    max_q_len: int | None = None,  # >= the longest chunk; None: num_tokens
    work: torch.Tensor | None = None,  # [capacity, 2] (seq, query block); seq -1 = padding
    short_work: torch.Tensor | None = None,  # [capacity, 2]: the short chunks' list
    long_work: torch.Tensor | None = None,  # [capacity, 2]: the long chunks' list
    block_n: int | None = None,  # overrides of the main launch's tile (benchmarks' sweeps)
    block_q: int | None = None,  # with work: the block_q the work list was built with
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged prefill attention (flash-attention tiling, online softmax in fp32).

    Without work: grid (query blocks of max_q_len, sequences, kv heads); query
    blocks past a chunk's length exit at once, so an overestimated max_q_len
    only costs empty programs. With work (from prefill_work_list): one program
    per entry and kv head, in the list's order with the kv head fastest;
    max_q_len unused; rows of q no entry covers (token padding) are left
    unwritten. short_work and long_work (with work): a launch each over the short
    and the long chunks, on prefill_tiles' tiles (long_work only where the tiles
    have a long one). Constraints as paged_decode_attention: GQA with num_heads a
    multiple of num_kv_heads, head_dim a power of 2 >= 16, fp16/bf16/fp32, the
    caches in q's dtype or float8_e4m3fn.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.dtype == v_cache.dtype, "the K and V caches must share a dtype"
    check_cache_dtype(q, k_cache)
    out = torch.empty_like(q) if out is None else out
    num_seqs = slot_mapping.shape[0]
    max_q_len = num_tokens if max_q_len is None else max_q_len
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tiles = prefill_tiles(head_dim, k_cache.dtype)
    main = PrefillTile(
        (block_q or prefill_block_q(num_heads, num_kv_heads, tiles.main.rows)) * group_pad,
        block_n or tiles.main.block_n,
        num_warps or tiles.main.num_warps,
        num_stages or tiles.main.num_stages,
    )
    # (grid, tile, work list); the grid form reads no list.
    if work is None:
        grid = (triton.cdiv(max_q_len, main.rows // group_pad), num_seqs, num_kv_heads)
        launches = [(grid, main, cu_seqlens_q)]
    else:
        launches = []
        for tile, work_list in ((main, work), (tiles.long, long_work), (tiles.short, short_work)):
            if work_list is None or work_list.shape[0] == 0:
                continue
            assert tile is not None, "long_work: these heads and cache have no long tile"
            assert work_list.dim() == 2 and work_list.shape[1] == 2
            assert work_list.is_contiguous()
            launches.append(((work_list.shape[0] * num_kv_heads,), tile, work_list))
    for grid, tile, work_list in launches:
        _prefill_kernel[grid](
            q, k_cache, v_cache, block_table, slot_mapping, cu_seqlens_q, context_lens, out,
            work_list,
            scale * _LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, tile.rows // group_pad),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=tile.block_n,
            DOT_PRECISION=dot_precision(q.dtype), HAS_WORK=work is not None,
            F16_MATH=f16_math(q, k_cache), NUM_KV_HEADS=num_kv_heads,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
    return out


def prefill_block_q(num_heads: int, num_kv_heads: int, rows: int = 64) -> int:
    """Query tokens per program of rows rows, shared by the query heads of one kv head."""
    return max(1, rows // triton.next_power_of_2(num_heads // num_kv_heads))


def prefill_short_q(num_heads: int, num_kv_heads: int) -> int:
    """The longest chunk that goes on the short list: 16 rows' worth of query tokens."""
    return prefill_block_q(num_heads, num_kv_heads, _SHORT_ROWS)


def prefill_work_capacity(max_tokens: int, max_seqs: int, block_q: int) -> int:
    """Work entries enough for any packing of <= max_tokens tokens in <= max_seqs chunks."""
    return triton.cdiv(max_tokens, block_q) + min(max_seqs, max_tokens)


def prefill_work_list(
    q_lens: np.ndarray,
    block_q: int,
    out: np.ndarray,
    short_out: np.ndarray | None = None,
    short_q: int = 0,
    *,
    context_lens: np.ndarray | None = None,
    long_out: np.ndarray | None = None,
    long_q: int = 0,
    long_context: int | None = None,
) -> int:
    """Fill out [capacity, 2] with (seq, query block) for chunks of q_lens; pad with seq -1.

    With short_out, chunks of 1..short_q tokens (prefill_short_q for the launch's
    heads) go there instead, one entry (seq, 0) each. With long_out, the other
    chunks whose context reaches long_context keys (default LONG_CONTEXT) go there,
    in blocks of long_q tokens. context_lens: each chunk's cached prefix + the
    chunk (default q_lens). Every list is padded and comes longest first, by the
    keys each program reads (ties in sequence order). Host-side numpy, no Python
    loop per block. Returns the number of real entries in all; raises ValueError
    when a capacity is too small.
    """
    assert short_out is not None or short_q == 0, "short_q needs short_out"
    assert long_out is not None or long_q == 0, "long_q needs long_out"
    ctx = q_lens if context_lens is None else context_lens
    short = (q_lens > 0) & (q_lens <= short_q)
    long = long_chunks(q_lens, ctx, short_q, long_context) & (long_q > 0)
    main = (q_lens > 0) & ~short & ~long
    num = _fill_blocks(q_lens, ctx, main, block_q, out, "work")
    if short_out is not None:
        num += _fill_blocks(q_lens, ctx, short, short_q, short_out, "short_work")
    if long_out is not None:
        num += _fill_blocks(q_lens, ctx, long, long_q, long_out, "long_work")
    return num


def long_chunks(
    q_lens: np.ndarray, context_lens: np.ndarray, short_q: int, long_context: int | None = None
) -> np.ndarray:
    """The chunks a long list takes: more than short_q tokens, over a context of
    long_context keys (default LONG_CONTEXT) or more."""
    long_context = LONG_CONTEXT if long_context is None else long_context
    return (q_lens > short_q) & (context_lens >= long_context)


def _fill_blocks(q_lens, ctx, chosen, block_q, out, name) -> int:
    """The chosen chunks' query blocks into out, longest program first, padded with -1."""
    blocks = np.where(chosen, -(-q_lens // max(block_q, 1)), 0)  # [num_seqs]
    num = int(blocks.sum())
    if num > out.shape[0]:
        raise ValueError(f"{name}: {num} entries exceed the capacity {out.shape[0]}")
    seq = np.repeat(np.arange(len(q_lens)), blocks)
    q_block = np.arange(num) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    keys = (ctx - q_lens)[seq] + np.minimum((q_block + 1) * block_q, q_lens[seq])
    order = np.argsort(-keys, kind="stable")
    out[:num, 0] = seq[order]
    out[:num, 1] = q_block[order]
    out[num:] = -1
    return num
