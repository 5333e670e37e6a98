"""Triton row argmax over logits: greedy sampling inside the decode CUDA graph.

torch's argmax over GPT-2's [256, 50257] half logits (a strided view of the
LM head's padded output) takes ~19 us on an H200, 1.4 TB/s. This is two
launches: `_partial_kernel`, one program per (row, CHUNK columns), reduces its
chunk to (max, first index of the max); `_merge_kernel`, one program per row,
takes the largest partial, the lowest chunk on ties. So the result is exactly
torch.argmax's for finite inputs: the first index of the row's maximum.

The grid depends on shapes only and nothing is read on the host, so both
launches are CUDA-graph capturable; on Hopper they join the step's launch
overlap (kernels.pdl). A NaN is skipped here (tl.max ignores it) where
torch.argmax would return its index; logits of a healthy model hold none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.reference import argmax_rows_ref  # noqa: F401  (the torch reference, re-exported)

CHUNK = 4096  # columns per partial program: 8 KiB of half logits in one load
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
    part_val_ptr, part_idx_ptr, out_ptr, num_chunks,
    CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    mask = c < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    best, chunk = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(part_idx_ptr + row * num_chunks + chunk)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(
    x: torch.Tensor,  # [num_rows, num_cols], fp32 / fp16 / bf16; last dim contiguous
    out: torch.Tensor | None = None,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64
    """The first index of each row's maximum, as torch.argmax(x, dim=-1) for finite x."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [rows, cols], last dim contiguous"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), "float logits only"
    num_rows, num_cols = x.shape
    assert num_cols >= 1, "x must have at least one column"
    num_chunks = triton.cdiv(num_cols, CHUNK)
    assert num_chunks <= MAX_CHUNKS, f"at most {MAX_CHUNKS * CHUNK} columns"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64, "out must be [rows] int64"
    if num_rows == 0:
        return out
    part_val = torch.empty(num_rows * num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(num_rows * num_chunks, dtype=torch.int32, device=x.device)
    _partial_kernel[(num_rows, num_chunks)](
        x, part_val, part_idx, num_cols, x.stride(0), num_chunks,
        CHUNK=CHUNK, num_warps=8, **pdl_launch(x.device),
    )  # fmt: skip
    _merge_kernel[(num_rows,)](
        part_val, part_idx, out, num_chunks,
        CHUNKS_PAD=max(16, triton.next_power_of_2(num_chunks)), num_warps=1,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out
