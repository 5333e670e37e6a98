"""A decode step's inputs and changed block-table rows: one host-to-device copy per step.

A decode step runs one query row per token: one per decode sequence, and, in a
mixed step, one per token of the short prompt chunks that ride along (the model
runner's mixed_prefill_tokens). Row order: the chunks' tokens that sample
nothing, then the last token of each chunk that completes its prompt, then the
decode sequences, then padding; the rows that sample are one contiguous range.

One pinned staging buffer per parity (the model runner alternates two, so a step's
copy may still be pending while the next step is filled) and one persistent device
buffer share a byte layout:

    sampling [sampling_length] int64   a sampled step's sampling parameters (the model
                                       runner's replica.runner.graph_sampling)
    inputs   [5, max_rows] int64       input ids (PLACEHOLDER: read token_buf),
                                       positions, table rows (slots), context lens,
                                       token_buf rows for the sampled token (OUT_SLOTS;
                                       the null row where a row samples nothing)
    header   [1 + max_num_seqs + 1] int64   how many block-table rows changed this
                                       step, then the table row each one replaces
    rows     [max_num_seqs + 1, max_blocks_per_seq] int32   their new contents

upload() copies the bytes in use (the sampling parameters on a sampled step, the
inputs with the header's count, and the changed rows when there are any) in one
copy. The rows land in the device block table by scatter_table_rows (kernels.
block_table), which a decode forward runs first, in its graph, reading the count on
the device; upload scatters them itself (scatter=True) for a step whose first forward
is a prefill forward. The decode and sampling graphs read their regions by address,
so the device buffer never moves.

Most decode steps run the sequences of the step before, in the same order: each has
moved one position on, and its newest token is the PLACEHOLDER of the token that step
sampled. fill() then stages them from the other parity's rows in a few numpy passes
instead of reading every sequence: 11-28 us against 47-78 at 256 rows on an H200's
host. The runner calls forget() after a launch that filled no
decode rows, so "the step before" is always the launch just before this one.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from replica.sequence import PLACEHOLDER, Sequence

INPUT_IDS, POSITIONS, SLOTS, CONTEXT_LENS, OUT_SLOTS = range(5)
_NUM_INPUTS = 5


class DecodeInputs:
    def __init__(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        pin: bool,
        max_rows: int | None = None,  # query rows of the largest step; max_num_seqs if None
        sampling_length: int = 0,  # int64s of the sampling region (a multiple of 8)
    ) -> None:
        if sampling_length % 8:
            raise ValueError(f"sampling_length: {sampling_length} is not a multiple of 8")
        self.max_rows = max_rows or max_num_seqs
        self.null_row = max_num_seqs
        num_rows = max_num_seqs + 1
        self._shapes = (self.max_rows, num_rows, max_blocks_per_seq)
        self._inputs_at = 8 * sampling_length  # 64-byte aligned, as every region after it
        self._header_at = self._inputs_at + _NUM_INPUTS * 8 * self.max_rows
        self._rows_at = self._header_at + 8 * (1 + num_rows)
        self._row_bytes = 4 * max_blocks_per_seq
        self._end = self._rows_at + num_rows * self._row_bytes
        num_bytes = -(-self._end // 64) * 64  # each parity's staging starts 64-byte aligned
        self.staging = torch.zeros((2, num_bytes), dtype=torch.uint8, pin_memory=pin)
        self.device_bytes = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        # On the device, what scatter_table_rows reads (the header's count first).
        self.inputs, self.table_header, self.table_rows = self._views(self.device_bytes)
        self._host = [
            tuple(t.numpy() for t in self._views(self.staging[parity])) for parity in (0, 1)
        ]
        # The sampling region (int64), on the device and its staging per parity.
        self.sampling = self.device_bytes[: self._inputs_at].view(torch.int64)
        self.sampling_staging = [
            self.staging[parity, : self._inputs_at].view(torch.int64) for parity in (0, 1)
        ]
        self._views_by_copy: dict[tuple[int, int, int, int], tuple] = {}  # _upload_views
        # The last fill's parity and decode sequences, when it staged no prompt chunks.
        self._last: tuple[int, list[Sequence]] | None = None

    def forget(self) -> None:
        """The launch after this one stages every row from its sequences."""
        self._last = None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        max_rows, num_rows, max_blocks = self._shapes
        inputs = buf[self._inputs_at : self._header_at].view(torch.int64)
        inputs = inputs.view(_NUM_INPUTS, max_rows)
        header = buf[self._header_at : self._rows_at].view(torch.int64)
        rows = buf[self._rows_at : self._end].view(torch.int32).view(num_rows, max_blocks)
        return inputs, header, rows

    def fill(
        self,
        parity: int,
        seqs: list[Sequence],
        num_rows: int,
        chunks: Seq[tuple[Sequence, int]] = (),
    ) -> tuple[int, list[Sequence]]:
        """Stage the rows of prompt chunks (seq, num_tokens from its num_computed_tokens),
        then of decode seqs, then padding up to num_rows.

        Returns the first row that samples and the sequences whose chunk completes
        their prompt: rows from the first sampling one on sample, in the order of
        those sequences, then seqs.
        """
        last, self._last = self._last, (None if chunks else (parity, seqs))
        if not chunks and last is not None and last[0] != parity and last[1] == seqs:
            self._advance(parity, len(seqs), num_rows)
            return 0, []
        ids, positions, slots = [], [], []
        done, last_rows = [], []
        for seq, n in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if end == len(seq.token_ids):  # its last token samples: it goes after the others
                done.append(seq)
                last_rows.append((seq.token_ids[end - 1], end - 1, seq.slot))
                end -= 1
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.slot] * (end - start)
        first = len(ids)
        for token, position, slot in last_rows:
            ids.append(token)
            positions.append(position)
            slots.append(slot)
        ids += [seq.token_ids[-1] for seq in seqs]  # or PLACEHOLDER
        positions += [len(seq.token_ids) - 1 for seq in seqs]
        slots += [seq.slot for seq in seqs]
        n = len(ids)
        host = self._host[parity][0]
        host[INPUT_IDS : SLOTS + 1, :n] = (ids, positions, slots)  # one conversion
        np.add(host[POSITIONS, :n], 1, out=host[CONTEXT_LENS, :n])
        if first:
            host[OUT_SLOTS, :first] = self.null_row
        host[OUT_SLOTS, first:n] = host[SLOTS, first:n]
        if n < num_rows:
            self.fill_padding(parity, n, num_rows)
        return first, done

    def _advance(self, parity: int, n: int, num_rows: int) -> None:
        """Stage the other parity's n decode rows, each one position on, with its token
        the PLACEHOLDER of the one that step samples."""
        host, before = self._host[parity][0], self._host[parity ^ 1][0]
        host[INPUT_IDS, :n] = PLACEHOLDER
        np.add(before[POSITIONS, :n], 1, out=host[POSITIONS, :n])
        np.add(host[POSITIONS, :n], 1, out=host[CONTEXT_LENS, :n])
        host[SLOTS, :n] = before[SLOTS, :n]
        host[OUT_SLOTS, :n] = before[SLOTS, :n]
        if n < num_rows:
            self.fill_padding(parity, n, num_rows)

    def fill_padding(self, parity: int, start: int = 0, end: int | None = None) -> None:
        """Padding rows read and write only the null row's null block."""
        if start == 0:
            self._last = None  # the rows a fill would advance from may be gone
        host = self._host[parity][0]
        end = self.max_rows if end is None else end
        host[INPUT_IDS, start:end] = 0
        host[POSITIONS, start:end] = 0
        host[SLOTS, start:end] = self.null_row
        host[CONTEXT_LENS, start:end] = 1
        host[OUT_SLOTS, start:end] = self.null_row

    def upload(
        self,
        parity: int,
        with_inputs: bool,
        block_table: np.ndarray | None = None,  # host [max_num_seqs + 1, max_blocks_per_seq]
        dirty_slots: Seq[int] = (),
        device_block_table: torch.Tensor | None = None,  # the same shape, on the device
        with_sampling: bool = False,
        scatter: bool = True,
    ) -> None:
        """One copy of what this step needs: the staged sampling parameters
        (with_sampling, which implies with_inputs), the staged inputs (with_inputs) with
        the count of dirty_slots, and the rows of dirty_slots. No copy if none. scatter:
        the rows land in device_block_table now, else the step's decode forward puts
        them there (scatter_table_rows, its count read on the device). Without
        dirty_slots the tables are not read."""
        n = len(dirty_slots)
        _, header, rows = self._host[parity]
        header[0] = n
        if n:
            header[1 : 1 + n] = dirty_slots
            rows[:n] = block_table[dirty_slots]
            end = self._rows_at + n * self._row_bytes
        elif with_inputs or with_sampling:
            end = self._header_at + 8  # the count: no row changed
        else:
            return
        start = 0 if with_sampling else self._inputs_at
        dst, src, row_ids, rows = self._upload_views(parity, start, end, n)
        dst.copy_(src, non_blocking=True)
        if n and scatter:
            device_block_table.index_copy_(0, row_ids, rows)

    def _upload_views(self, parity: int, start: int, end: int, n: int) -> tuple:
        """upload's tensors: made once per shape of copy (a view is a few us of the host's
        time, and the buffers never move)."""
        key = (parity, start, end, n)
        views = self._views_by_copy.get(key)
        if views is None:
            views = self.device_bytes[start:end], self.staging[parity, start:end]
            views += (self.table_header[1 : 1 + n], self.table_rows[:n])
            self._views_by_copy[key] = views
        return views
