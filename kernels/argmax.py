"""Triton row argmax over logits: greedy sampling inside the decode CUDA graph.

torch's argmax over GPT-2's [256, 50257] half logits (a strided view of the
LM head's padded output) takes ~19 us on an H200, 1.4 TB/s. This is two
launches: `_partial_kernel`, one program per (row, CHUNK columns), reduces its
chunk to (max, first index of the max); `_merge_kernel`, one program per row,
takes the largest partial, the lowest chunk on ties. So the result is exactly
torch.argmax's for finite inputs: the first index of the row's maximum.

Given token_buf and token_rows, the merge also writes each row's token to
token_buf[token_rows[row]]: the decode step's feedback of its tokens to the next
step, whose inputs name a token the host has not seen yet with a negative id
that resolve_placeholders replaces from token_buf (one launch each way, where
torch took an index_copy_, and a compare, a gather and a where).

The grid depends on shapes only and nothing is read on the host, so all
launches are CUDA-graph capturable; on Hopper they join the step's launch
overlap (kernels.pdl). A NaN is skipped here (tl.max ignores it) where
torch.argmax would return its index; logits of a healthy model hold none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.reference import (  # noqa: F401  (the torch references, re-exported)
    argmax_rows_ref,
    resolve_placeholders_ref,
)

# Columns and warps per partial program. H200, [256, 50257] half logits, graph-timed
# from HBM: 4096 / 4 warps 11.6 us (with the merge), 4096 / 8 13.3,
# 2048 / 4 12.7, 8192 / 8 12.3; torch.argmax 20.0.
CHUNK = 4096
PARTIAL_WARPS = 4
MAX_CHUNKS = 1024


@triton.jit
def _partial_kernel(
    x_ptr, part_val_ptr, part_idx_ptr, num_cols, stride_row, num_chunks,
    CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < num_cols, other=float("-inf")
    ).to(tl.float32)
    best, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_val_ptr + row * num_chunks + chunk, best)
    tl.store(part_idx_ptr + row * num_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def _merge_kernel(
    part_val_ptr, part_idx_ptr, out_ptr, token_buf_ptr, token_rows_ptr, num_chunks,
    CHUNKS_PAD: tl.constexpr, SCATTER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    mask = c < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    best, chunk = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(part_idx_ptr + row * num_chunks + chunk).to(tl.int64)
    tl.store(out_ptr + row, index)
    if SCATTER:
        tl.store(token_buf_ptr + tl.load(token_rows_ptr + row), index)


@triton.jit
def _resolve_kernel(
    ids_ptr, token_buf_ptr, token_rows_ptr, out_ptr, num_rows,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = row < num_rows
    ids = tl.load(ids_ptr + row, mask=mask, other=0)
    placeholder = mask & (ids < 0)
    token_row = tl.load(token_rows_ptr + row, mask=placeholder, other=0)
    token = tl.load(token_buf_ptr + token_row, mask=placeholder, other=0)
    tl.store(out_ptr + row, tl.where(placeholder, token, ids), mask=mask)


def argmax_rows(
    x: torch.Tensor,  # [num_rows, num_cols], fp32 / fp16 / bf16; last dim contiguous
    out: torch.Tensor | None = None,  # [num_rows] int64
    *,
    token_buf: torch.Tensor | None = None,  # [buf_rows] int64
    token_rows: torch.Tensor | None = None,  # [num_rows] int: where each row's token goes
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:  # [num_rows] int64
    """The first index of each row's maximum, as torch.argmax(x, dim=-1) for finite x;
    also written to token_buf[token_rows] when given (rows sharing a target: any one)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [rows, cols], last dim contiguous"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), "float logits only"
    num_rows, num_cols = x.shape
    assert num_cols >= 1, "x must have at least one column"
    num_chunks = triton.cdiv(num_cols, CHUNK)
    assert num_chunks <= MAX_CHUNKS, f"at most {MAX_CHUNKS * CHUNK} columns"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64, "out must be [rows] int64"
    scatter = token_buf is not None
    if scatter:
        assert token_rows is not None and token_rows.shape == (num_rows,), "token_rows: [rows]"
        assert token_buf.dtype == torch.int64 and token_buf.dim() == 1, "token_buf: int64 [n]"
    if num_rows == 0:
        return out
    part_val = torch.empty(num_rows * num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(num_rows * num_chunks, dtype=torch.int32, device=x.device)
    _partial_kernel[(num_rows, num_chunks)](
        x, part_val, part_idx, num_cols, x.stride(0), num_chunks,
        CHUNK=CHUNK, num_warps=PARTIAL_WARPS, **pdl_launch(x.device, pdl),
    )  # fmt: skip
    _merge_kernel[(num_rows,)](
        part_val, part_idx, out, token_buf if scatter else out,
        token_rows if scatter else out, num_chunks,
        CHUNKS_PAD=max(16, triton.next_power_of_2(num_chunks)), SCATTER=scatter, num_warps=1,
        **pdl_launch(x.device, pdl),
    )  # fmt: skip
    return out


RESOLVE_BLOCK = 128


def resolve_placeholders(
    ids: torch.Tensor,  # [num_rows] int64; negative: a placeholder
    token_buf: torch.Tensor,  # [buf_rows] int64
    token_rows: torch.Tensor,  # [num_rows] int: the token_buf row of each placeholder
    out: torch.Tensor | None = None,  # [num_rows] int64; may be ids
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> torch.Tensor:
    """ids with every negative entry replaced by token_buf[token_rows[row]]."""
    assert ids.dim() == 1 and ids.dtype == torch.int64, "ids must be [rows] int64"
    assert token_rows.shape == ids.shape and token_buf.dtype == torch.int64
    out = torch.empty_like(ids) if out is None else out
    num_rows = ids.shape[0]
    if num_rows:
        _resolve_kernel[(triton.cdiv(num_rows, RESOLVE_BLOCK),)](
            ids, token_buf, token_rows, out, num_rows,
            BLOCK=RESOLVE_BLOCK, num_warps=4, **pdl_launch(ids.device, pdl),
        )  # fmt: skip
    return out
