"""DecodeInputs: one packed copy carries the decode inputs and the changed table rows."""

from __future__ import annotations

import numpy as np
import torch

from replica.decode_inputs import (
    CONTEXT_LENS,
    INPUT_IDS,
    OUT_SLOTS,
    POSITIONS,
    SLOTS,
    DecodeInputs,
)
from replica.sampling_params import SamplingParams
from replica.sequence import PLACEHOLDER, Sequence


def _seq(tokens: list[int], slot: int) -> Sequence:
    seq = Sequence(f"s{slot}", tokens, SamplingParams(max_tokens=4))
    seq.slot = slot
    return seq


def test_inputs_and_padding():
    di = DecodeInputs(max_num_seqs=6, max_blocks_per_seq=3, device=torch.device("cpu"), pin=False)
    table = torch.full((7, 3), -5, dtype=torch.int32)
    seqs = [_seq([4, 5, 6], slot=2), _seq([7, PLACEHOLDER], slot=0)]
    di.fill(1, seqs, num_rows=4)
    di.upload(1, True, np.zeros((7, 3), np.int32), [], table)
    inputs = di.inputs
    assert inputs[INPUT_IDS, :4].tolist() == [6, PLACEHOLDER, 0, 0]
    assert inputs[POSITIONS, :4].tolist() == [2, 1, 0, 0]
    assert inputs[SLOTS, :4].tolist() == [2, 0, 6, 6]  # padding: the null row
    assert inputs[CONTEXT_LENS, :4].tolist() == [3, 2, 1, 1]
    assert inputs[OUT_SLOTS, :4].tolist() == [2, 0, 6, 6]
    assert (table == -5).all(), "no dirty rows: the device table is not touched"


def test_dirty_rows_land_in_the_table_and_parities_do_not_mix():
    di = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=5, device=torch.device("cpu"), pin=False)
    host_table = np.arange(5 * 5, dtype=np.int32).reshape(5, 5)
    table = torch.full((5, 5), -1, dtype=torch.int32)
    di.fill(0, [_seq([1, 2], slot=3)], num_rows=1)
    di.upload(0, True, host_table, [3, 1], table)
    assert table[3].tolist() == host_table[3].tolist()
    assert table[1].tolist() == host_table[1].tolist()
    assert (table[[0, 2, 4]] == -1).all()
    assert di.inputs[SLOTS, 0].item() == 3
    # The other parity's staging is separate: filling it leaves parity 0's inputs staged.
    di.fill(1, [_seq([9], slot=2)], num_rows=1)
    di.upload(0, True, host_table, [], table)
    assert di.inputs[SLOTS, 0].item() == 3


def test_upload_without_inputs_or_rows_copies_nothing():
    di = DecodeInputs(max_num_seqs=2, max_blocks_per_seq=2, device=torch.device("cpu"), pin=False)
    di.device_bytes.fill_(0xAB)
    di.fill(0, [_seq([3], slot=1)], num_rows=2)
    di.upload(0, False)
    assert (di.device_bytes == 0xAB).all()


def test_prompt_chunks_take_a_row_per_token_and_only_last_tokens_sample():
    di = DecodeInputs(
        max_num_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"), pin=False, max_rows=12
    )
    finishing = _seq([10, 11, 12, 13, 14], slot=1)
    finishing.num_computed_tokens = 2  # cached: the chunk is 12, 13, 14 and completes it
    partial = _seq([20, 21, 22, 23], slot=3)  # the chunk 20, 21 leaves 22, 23 for later
    decoding = _seq([30, 31, PLACEHOLDER], slot=0)
    first, done = di.fill(0, [decoding], 8, chunks=[(finishing, 3), (partial, 2)])
    di.upload(0, True, np.zeros((5, 4), np.int32), [], torch.zeros(5, 4, dtype=torch.int32))
    inputs = di.inputs[:, :8]
    # context rows (finishing's first two, partial's two), finishing's last, the decode, padding
    assert (first, done) == (4, [finishing])
    assert inputs[INPUT_IDS].tolist() == [12, 13, 20, 21, 14, PLACEHOLDER, 0, 0]
    assert inputs[POSITIONS].tolist() == [2, 3, 0, 1, 4, 2, 0, 0]
    assert inputs[SLOTS].tolist() == [1, 1, 3, 3, 1, 0, 4, 4]
    assert inputs[CONTEXT_LENS].tolist() == [3, 4, 1, 2, 5, 3, 1, 1]
    assert inputs[OUT_SLOTS].tolist() == [4, 4, 4, 4, 1, 0, 4, 4]  # 4: the null row
