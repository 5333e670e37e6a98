"""A step's changed block-table rows into the device table, from inside its CUDA graph.

The rows ride in the step's one host-to-device copy (replica.runner.decode_inputs) behind
a header: their count, then the table row each one replaces. Scattered by a torch
index_copy_ between that copy and the graph's replay, they cost a launch from the host
that the device waited for: on an emulated slow host (0.6 ms of extra host work a step)
the in-graph scatter made steps 12-15% shorter (docs/design.md, "Slot mapping and step
inputs"). This kernel runs first in a decode graph and reads the count on the device, so a
step that changes no row pays a few programs that return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.reference import scatter_table_rows_ref  # noqa: F401  (re-exported)

NUM_PROGRAMS = 16  # along the rows: each takes tiles of ROWS rows, NUM_PROGRAMS tiles apart
ROWS = 16  # rows of a tile: a batch in lockstep changes all its rows on one step
MAX_BLOCK = 256  # table entries of a tile's row; a wider table gets more programs


@triton.jit
def _scatter_rows_kernel(
    table_ptr, header_ptr, rows_ptr, width, table_stride,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    count = tl.load(header_ptr)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < width
    for first in range(tl.program_id(0) * ROWS, count, NUM_PROGRAMS * ROWS):
        i = first + tl.arange(0, ROWS)
        row_mask = i < count
        row = tl.load(header_ptr + 1 + i, mask=row_mask, other=0)
        mask = row_mask[:, None] & col_mask[None, :]
        values = tl.load(rows_ptr + i[:, None] * width + cols[None, :], mask=mask)
        tl.store(table_ptr + row[:, None] * table_stride + cols[None, :], values, mask=mask)


def scatter_table_rows(
    table: torch.Tensor,  # [num_table_rows, width] int32
    header: torch.Tensor,  # [1 + max_rows] int64: count, then the table row of each row
    rows: torch.Tensor,  # [max_rows, width] int32
    *,
    pdl: bool = True,  # kernels.pdl: PDL where the device has it
) -> None:
    """table[header[1 + i]] = rows[i] for i < header[0], the count read on the device."""
    width = table.shape[1]
    assert rows.shape[1] == width and rows.is_contiguous() and table.stride(1) == 1
    assert header.dtype == torch.int64 and header.shape[0] == rows.shape[0] + 1
    block = min(triton.next_power_of_2(width), MAX_BLOCK)
    _scatter_rows_kernel[(NUM_PROGRAMS, triton.cdiv(width, block))](
        table, header, rows, width, table.stride(0),
        ROWS=ROWS, BLOCK=block, NUM_PROGRAMS=NUM_PROGRAMS, num_warps=4,
        **pdl_launch(table.device, pdl),
    )  # fmt: skip
