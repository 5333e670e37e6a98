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
ones' registers and shared memory, so as few of them per SM.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.kv_quant import check_cache_dtype, f16_math

_LOG2E = 1.4426950408889634
_BLOCK_M = 64
_SHORT_BLOCK_M = 16
# The short launch's tile (BENCHMARKS.md: the best all-round in a sweep over decode rows
# at contexts 130-2048; 32 keys or 1 warp win only at the shortest contexts).
SHORT_TILE = {"block_n": 64, "num_warps": 2, "num_stages": 2}


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
):  # fmt: skip
    kv_head = tl.program_id(2)
    if HAS_WORK:
        seq = tl.load(work_ptr + 2 * tl.program_id(0))
        q_block = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
        if seq < 0:
            return
    else:
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
    if F16_MATH:  # kernels.kv_quant.f16_math: the scale goes into q before its rounding
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0

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
    block_n: int | None = None,  # launch overrides (benchmarks' sweeps); None: the defaults
    block_q: int | None = None,  # with work: the block_q the work list was built with
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged prefill attention (flash-attention tiling, online softmax in fp32).

    Without work: grid (query blocks of max_q_len, sequences, kv heads); query
    blocks past a chunk's length exit at once, so an overestimated max_q_len
    only costs empty programs. With work (from prefill_work_list): one program
    per entry and kv head, max_q_len unused; rows of q no entry covers (token
    padding) are left unwritten. short_work (with work): a second launch over the
    short chunks, prefill_short_q tokens and SHORT_TILE. Constraints as
    paged_decode_attention: GQA with num_heads a multiple of num_kv_heads, head_dim
    a power of 2 >= 16, fp16/bf16/fp32, the caches in q's dtype or float8_e4m3fn.
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
    block_q = block_q or prefill_block_q(num_heads, num_kv_heads)
    tile = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    # (grid, query tokens per program, tile, work list); the grid form reads no list.
    if work is None:
        grid = (triton.cdiv(max_q_len, block_q), num_seqs, num_kv_heads)
        launches = [(grid, block_q, tile, cu_seqlens_q)]
    else:
        assert work.dim() == 2 and work.shape[1] == 2 and work.is_contiguous()
        launches = [((work.shape[0], 1, num_kv_heads), block_q, tile, work)]
        if short_work is not None and short_work.shape[0]:
            assert short_work.dim() == 2 and short_work.shape[1] == 2
            assert short_work.is_contiguous()
            short_q = prefill_short_q(num_heads, num_kv_heads)
            grid = (short_work.shape[0], 1, num_kv_heads)
            launches.append((grid, short_q, SHORT_TILE, short_work))
    for grid, rows, tile, work_list in launches:
        _prefill_kernel[grid](
            q, k_cache, v_cache, block_table, slot_mapping, cu_seqlens_q, context_lens, out,
            work_list,
            scale * _LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=rows,
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_N=tile["block_n"] or (64 if head_dim <= 128 else 32),
            DOT_PRECISION=dot_precision(q.dtype), HAS_WORK=work is not None,
            F16_MATH=f16_math(q, k_cache),
            num_warps=tile["num_warps"] or 4, num_stages=tile["num_stages"] or 2,
        )  # fmt: skip
    return out


def prefill_block_q(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program: BLOCK_M rows shared by the query heads of one kv head."""
    return max(1, _BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads))


def prefill_short_q(num_heads: int, num_kv_heads: int) -> int:
    """The longest chunk that goes on the short list: 16 rows' worth of query tokens."""
    return max(1, _SHORT_BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads))


def prefill_work_capacity(max_tokens: int, max_seqs: int, block_q: int) -> int:
    """Work entries enough for any packing of <= max_tokens tokens in <= max_seqs chunks."""
    return triton.cdiv(max_tokens, block_q) + min(max_seqs, max_tokens)


def prefill_work_list(
    q_lens: np.ndarray,
    block_q: int,
    out: np.ndarray,
    short_out: np.ndarray | None = None,
    short_q: int = 0,
) -> int:
    """Fill out [capacity, 2] with (seq, query block) for chunks of q_lens; pad with seq -1.

    With short_out, chunks of 1..short_q tokens (prefill_short_q for the launch's
    heads) go there instead, one entry (seq, 0) each, also padded. Host-side numpy,
    no Python loop per block. Returns the number of real entries in both; raises
    ValueError when a capacity is too small.
    """
    assert short_out is not None or short_q == 0, "short_q needs short_out"
    short = (q_lens > 0) & (q_lens <= short_q)
    blocks = np.where(short, 0, -(-q_lens // block_q))  # [num_seqs]
    num_work = int(blocks.sum())
    num_short = int(short.sum())
    if num_work > out.shape[0]:
        raise ValueError(f"work: {num_work} entries exceed the capacity {out.shape[0]}")
    seq = np.repeat(np.arange(len(q_lens)), blocks)
    out[:num_work, 0] = seq
    out[:num_work, 1] = np.arange(num_work) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    out[num_work:] = -1
    if short_out is not None:
        if num_short > short_out.shape[0]:
            raise ValueError(
                f"short_work: {num_short} entries exceed the capacity {short_out.shape[0]}"
            )
        short_out[:num_short, 0] = np.flatnonzero(short)
        short_out[:num_short, 1] = 0
        short_out[num_short:] = -1
    return num_work + num_short
