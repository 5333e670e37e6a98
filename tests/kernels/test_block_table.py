"""Block-table row scatter vs its torch reference: counts, widths across the tile, rows
left alone."""

from __future__ import annotations

import pytest
import torch

from kernels.block_table import (
    MAX_BLOCK,
    NUM_PROGRAMS,
    ROWS,
    scatter_table_rows,
    scatter_table_rows_ref,
)


@pytest.mark.parametrize("width", [1, 7, 16, MAX_BLOCK + 9])
@pytest.mark.parametrize("count", [0, 1, ROWS + 3, NUM_PROGRAMS * ROWS + 5])
def test_scatter_matches_the_reference(width, count, device):
    gen = torch.Generator().manual_seed(width * 31 + count)
    max_rows = NUM_PROGRAMS * ROWS + 9
    num_table_rows = max_rows + 7
    table = torch.randint(0, 1000, (num_table_rows, width), generator=gen, dtype=torch.int32)
    rows = torch.randint(0, 1000, (max_rows, width), generator=gen, dtype=torch.int32)
    header = torch.full((1 + max_rows,), -1, dtype=torch.int64)
    header[0] = count
    header[1 : 1 + count] = torch.randperm(num_table_rows, generator=gen)[:count]
    want = table.clone()
    scatter_table_rows_ref(want, header, rows)
    got = table.to(device)
    scatter_table_rows(got, header.to(device), rows.to(device))
    assert torch.equal(got.cpu(), want)
    changed = (want != table).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(header[1 : 1 + count].tolist())  # no other row touched
