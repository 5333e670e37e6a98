"""Triton KV append: write new K/V rows into the paged cache.

Every launch form shares one kernel. A program owns ROWS new tokens and a
HD_BLOCK-wide slice of their flattened [num_kv_heads * head_dim] row, so each
token's head rows are read and written as contiguous runs (16-byte vectors).
The destination of a token is computed in the kernel from the block table, so
the hot path builds no index tensors, reads nothing on the host, and allocates
nothing: every launch is CUDA-graph capturable (the grid depends on shapes and
on host ints given by the caller).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import check_cache_dtype, is_fp8, to_cache
from kernels.pdl import pdl_launch, pdl_prologue

# How the destination of write i is found (constexpr MODE).
_MODE_BLOCKS = 0  # block_ids[i], offsets[i]
_MODE_SLOT_POSITIONS = 1  # block_table[slot_mapping[i], positions[i] // bs], positions[i] % bs
_MODE_SLOT_CONST_POSITION = 2  # as above with one position for every row
_MODE_PREFILL = 3  # packed sequences: program (seq, token block) via cu_seqlens

_MAX_HD_BLOCK = 2048


@triton.jit
def _append_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    idx_a_ptr,  # block_ids (MODE 0) or slot_mapping (MODE 1..3)
    idx_b_ptr,  # offsets (0), positions (1), start_positions (3)
    src_rows_ptr,  # MODE 0 with HAS_SRC_ROWS
    cu_seqlens_ptr,  # MODE 3
    block_table_ptr,
    num_writes, const_position,
    stride_bt,
    stride_src_row, stride_src_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    HEAD_DIM: tl.constexpr, ROW_WIDTH: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr, HD_BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_SRC_ROWS: tl.constexpr,
    KV_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_row = tl.program_id(0)
    pid_hd = tl.program_id(1)
    r = tl.arange(0, ROWS)
    if MODE == 3:
        seq = tl.program_id(2)
        row_start = tl.load(cu_seqlens_ptr + seq)
        seq_len = tl.load(cu_seqlens_ptr + seq + 1) - row_start
        tok = pid_row * ROWS + r  # [ROWS] index inside the sequence
        row_mask = tok < seq_len
        src_row = (row_start + tok).to(tl.int64)
        position = tl.load(idx_b_ptr + seq) + tok
        slot = tl.load(idx_a_ptr + seq).to(tl.int64)
        block = tl.load(block_table_ptr + slot * stride_bt + position // BLOCK_SIZE, mask=row_mask)
        offset = position % BLOCK_SIZE
    else:
        w = pid_row * ROWS + r  # [ROWS] write index
        row_mask = w < num_writes
        src_row = w.to(tl.int64)
        if MODE == 0:
            block = tl.load(idx_a_ptr + w, mask=row_mask)
            offset = tl.load(idx_b_ptr + w, mask=row_mask)
            if HAS_SRC_ROWS:
                src_row = tl.load(src_rows_ptr + w, mask=row_mask).to(tl.int64)
        else:
            slot = tl.load(idx_a_ptr + w, mask=row_mask).to(tl.int64)
            if MODE == 1:
                position = tl.load(idx_b_ptr + w, mask=row_mask)
            else:
                position = tl.zeros([ROWS], dtype=tl.int64) + const_position
            bt_ptrs = block_table_ptr + slot * stride_bt + position // BLOCK_SIZE
            block = tl.load(bt_ptrs, mask=row_mask)
            offset = position % BLOCK_SIZE

    hd = pid_hd * HD_BLOCK + tl.arange(0, HD_BLOCK)  # [HD_BLOCK] flat (head, dim) index
    head = hd // HEAD_DIM
    dim = hd % HEAD_DIM
    mask = row_mask[:, None] & (hd < ROW_WIDTH)[None, :]
    src = src_row[:, None] * stride_src_row + (head * stride_src_head + dim)[None, :]
    dst_row = block.to(tl.int64) * stride_cache_block + offset.to(tl.int64) * stride_cache_slot
    dst = dst_row[:, None] + (head * stride_cache_head + dim)[None, :]
    k = to_cache(tl.load(k_ptr + src, mask=mask), k_cache_ptr, KV_FP8)
    v = to_cache(tl.load(v_ptr + src, mask=mask), v_cache_ptr, KV_FP8)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k.shape == v.shape and k.stride() == v.stride(), "k and v must share shape and strides"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k.shape[1:] == k_cache.shape[2:], (
        "k rows must match the cache's [num_kv_heads, head_dim]"
    )
    assert k.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
    check_cache_dtype(k, k_cache)


def _launch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_row_programs: int,
    num_seq_programs: int,
    rows: int,
    mode: int,
    idx_a: torch.Tensor,
    idx_b: torch.Tensor | None = None,
    src_rows: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_writes: int = 0,
    const_position: int = 0,
    pdl: bool = True,
) -> None:
    _check(k, v, k_cache, v_cache)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    row_width = num_kv_heads * head_dim
    hd_block = min(triton.next_power_of_2(row_width), _MAX_HD_BLOCK)
    if num_row_programs == 0 or num_seq_programs == 0:
        return
    grid = (num_row_programs, triton.cdiv(row_width, hd_block), num_seq_programs)
    vec = 16 // k.element_size()
    num_warps = max(1, min(8, rows * hd_block // (vec * 32)))
    _append_kv_kernel[grid](
        k, v, k_cache, v_cache,
        idx_a, idx_b if idx_b is not None else idx_a,
        src_rows if src_rows is not None else idx_a,
        cu_seqlens if cu_seqlens is not None else idx_a,
        block_table if block_table is not None else idx_a,
        num_writes, const_position,
        block_table.stride(0) if block_table is not None else 0,
        k.stride(0), k.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, ROW_WIDTH=row_width, BLOCK_SIZE=k_cache.shape[1],
        ROWS=rows, HD_BLOCK=hd_block, MODE=mode, HAS_SRC_ROWS=src_rows is not None,
        KV_FP8=is_fp8(k_cache), num_warps=num_warps, **pdl_launch(k.device, pdl),
    )  # fmt: skip


def _rows_per_program(row_width: int) -> int:
    # Small rows (GPT-2: 768 elements) are batched so a program moves >= ~4 KiB per tensor.
    return max(1, min(8, 2048 // triton.next_power_of_2(row_width)))


def append_kv(
    k: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_writes]
    offsets: torch.Tensor,  # [num_writes]
    src_rows: torch.Tensor | None = None,  # [num_writes]; None: row i is write i
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> None:
    """Generic append: write k[src_rows[i]], v[src_rows[i]] at (block_ids[i], offsets[i]).

    One program per group of writes x slice of the [num_kv_heads * head_dim] row.
    Destinations must be distinct (duplicates race). head_dim must be contiguous.
    """
    num_writes = block_ids.shape[0]
    rows = _rows_per_program(k.shape[1] * k.shape[2])
    _launch(
        k, v, k_cache, v_cache, triton.cdiv(num_writes, rows), 1, rows, _MODE_BLOCKS,
        idx_a=block_ids, idx_b=offsets, src_rows=src_rows, num_writes=num_writes, pdl=pdl,
    )  # fmt: skip


def append_kv_slots(
    k: torch.Tensor,  # [B, num_kv_heads, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [B]: the table row of batch row i
    positions: torch.Tensor | int,  # [B], or one position for every row
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> None:
    """Decode append: batch row i writes one token at block_table[slot_mapping[i]] / positions[i].

    The block id is looked up in the kernel, so no index tensor is built per step.
    An int position is a separate launch form (the position is a kernel argument;
    under a CUDA graph it is frozen at capture). Rows must target distinct slots.
    """
    num_rows = k.shape[0]
    rows = _rows_per_program(k.shape[1] * k.shape[2])
    const = isinstance(positions, int)
    _launch(
        k, v, k_cache, v_cache, triton.cdiv(num_rows, rows), 1, rows,
        _MODE_SLOT_CONST_POSITION if const else _MODE_SLOT_POSITIONS,
        idx_a=slot_mapping, idx_b=None if const else positions, block_table=block_table,
        num_writes=num_rows, const_position=positions if const else 0, pdl=pdl,
    )  # fmt: skip


def append_kv_prefill(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], sequences packed
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [num_seqs]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]: sequence i owns rows cu[i]:cu[i+1]
    start_positions: torch.Tensor,  # [num_seqs]: position of each sequence's first row
    max_seqlen: int,  # >= the longest sequence of this call (host int, sizes the grid)
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> None:
    """Packed prefill append: grid (token block, row slice, sequence) sized by max_seqlen.

    Programs past their sequence's length mask out; no host read of cu_seqlens.
    """
    num_seqs = slot_mapping.shape[0]
    rows = _rows_per_program(k.shape[1] * k.shape[2])
    _launch(
        k, v, k_cache, v_cache, triton.cdiv(max_seqlen, rows), num_seqs, rows, _MODE_PREFILL,
        idx_a=slot_mapping, idx_b=start_positions, cu_seqlens=cu_seqlens, block_table=block_table,
        pdl=pdl,
    )  # fmt: skip
