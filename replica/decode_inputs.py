"""A decode step's inputs and changed block-table rows: one host-to-device copy per step.

One pinned staging buffer per parity (the model runner alternates two, so a step's
copy may still be pending while the next step is filled) and one persistent device
buffer share a byte layout:

    inputs   [4, max_num_seqs] int64   input ids (PLACEHOLDER: read token_buf),
                                       positions, table rows (slots), context lens
    row_ids  [max_num_seqs + 1] int64  block-table rows that changed this step
    rows     [max_num_seqs + 1, max_blocks_per_seq] int32   their new contents

upload() copies the bytes in use (the inputs, and the changed rows when there are
any) in one copy, then scatters the rows into the device block table. The decode
graphs read `inputs` by address, so the device buffer never moves.
"""

from __future__ import annotations

import numpy as np
import torch

from replica.sequence import Sequence

INPUT_IDS, POSITIONS, SLOTS, CONTEXT_LENS = range(4)


class DecodeInputs:
    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device, pin: bool
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.null_row = max_num_seqs
        num_rows = max_num_seqs + 1
        self._shapes = (max_num_seqs, num_rows, max_blocks_per_seq)
        self._row_ids_at = 4 * 8 * max_num_seqs
        self._rows_at = self._row_ids_at + 8 * num_rows
        self._row_bytes = 4 * max_blocks_per_seq
        self._end = self._rows_at + num_rows * self._row_bytes
        num_bytes = -(-self._end // 64) * 64  # each parity's staging starts 64-byte aligned
        self.staging = torch.zeros((2, num_bytes), dtype=torch.uint8, pin_memory=pin)
        self.device_bytes = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.inputs, self._row_ids, self._rows = self._views(self.device_bytes)
        self._host = [
            tuple(t.numpy() for t in self._views(self.staging[parity])) for parity in (0, 1)
        ]

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        max_num_seqs, num_rows, max_blocks = self._shapes
        inputs = buf[: self._row_ids_at].view(torch.int64).view(4, max_num_seqs)
        row_ids = buf[self._row_ids_at : self._rows_at].view(torch.int64)
        rows = buf[self._rows_at : self._end].view(torch.int32).view(num_rows, max_blocks)
        return inputs, row_ids, rows

    def fill(self, parity: int, seqs: list[Sequence], num_rows: int) -> None:
        """Stage the inputs of seqs, then padding rows up to num_rows."""
        host = self._host[parity][0]
        n = len(seqs)
        host[INPUT_IDS, :n] = [s.token_ids[-1] for s in seqs]  # or PLACEHOLDER
        host[POSITIONS, :n] = [len(s) - 1 for s in seqs]
        host[SLOTS, :n] = [s.slot for s in seqs]
        host[CONTEXT_LENS, :n] = host[POSITIONS, :n] + 1
        self.fill_padding(parity, n, num_rows)

    def fill_padding(self, parity: int, start: int = 0, end: int | None = None) -> None:
        """Padding rows read and write only the null row's null block."""
        host = self._host[parity][0]
        end = self.max_num_seqs if end is None else end
        host[INPUT_IDS, start:end] = 0
        host[POSITIONS, start:end] = 0
        host[SLOTS, start:end] = self.null_row
        host[CONTEXT_LENS, start:end] = 1

    def upload(
        self,
        parity: int,
        with_inputs: bool,
        block_table: np.ndarray,  # host [max_num_seqs + 1, max_blocks_per_seq]
        dirty_slots: list[int],
        device_block_table: torch.Tensor,  # the same shape, on the device
    ) -> None:
        """One copy of what this step needs: the staged inputs (with_inputs) and the rows
        of dirty_slots, which then land in device_block_table. No copy if neither."""
        n = len(dirty_slots)
        if n:
            _, row_ids, rows = self._host[parity]
            row_ids[:n] = dirty_slots
            rows[:n] = block_table[dirty_slots]
            end = self._rows_at + n * self._row_bytes
        elif with_inputs:
            end = self._row_ids_at
        else:
            return
        self.device_bytes[:end].copy_(self.staging[parity, :end], non_blocking=True)
        if n:
            device_block_table.index_copy_(0, self._row_ids[:n], self._rows[:n])
