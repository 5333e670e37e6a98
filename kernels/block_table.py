"""A step's changed block-table rows into the device table, from inside its CUDA graph.

The rows ride in the step's one host-to-device copy (replica.decode_inputs) behind a
header: their count, then the table row each one replaces. Scattered by a torch
index_copy_ between that copy and the graph's replay, they cost a launch from the host
that the device waited for (bench.step_timeline). This kernel runs first in a decode
graph and reads the count on the device, so a step that changes no row pays a few
programs that return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_prologue
from kernels.reference import scatter_table_rows_ref  # noqa: F401  (re-exported)

NUM_PROGRAMS = 8  # each takes every NUM_PROGRAMS-th row: a handful change per step


@triton.jit
def _scatter_rows_kernel(
    table_ptr, header_ptr, rows_ptr, width, table_stride,
    BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    count = tl.load(header_ptr)
    cols = tl.arange(0, BLOCK)
    for i in range(tl.program_id(0), count, NUM_PROGRAMS):
        row = tl.load(header_ptr + 1 + i)
        for start in range(0, width, BLOCK):
            mask = start + cols < width
            values = tl.load(rows_ptr + i * width + start + cols, mask=mask)
            tl.store(table_ptr + row * table_stride + start + cols, values, mask=mask)


def scatter_table_rows(
    table: torch.Tensor,  # [num_table_rows, width] int32
    header: torch.Tensor,  # [1 + max_rows] int64: count, then the table row of each row
    rows: torch.Tensor,  # [max_rows, width] int32
) -> None:
    """table[header[1 + i]] = rows[i] for i < header[0], the count read on the device."""
    width = table.shape[1]
    assert rows.shape[1] == width and rows.is_contiguous() and table.stride(1) == 1
    assert header.dtype == torch.int64 and header.shape[0] == rows.shape[0] + 1
    block = min(triton.next_power_of_2(width), 1024)
    _scatter_rows_kernel[(NUM_PROGRAMS,)](
        table, header, rows, width, table.stride(0),
        BLOCK=block, NUM_PROGRAMS=NUM_PROGRAMS, num_warps=1, **pdl_launch(table.device),
    )  # fmt: skip
