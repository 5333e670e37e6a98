"""DecodeInputs: one packed copy carries the decode inputs and the changed table rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.reference import scatter_table_rows_ref
from replica.runner.decode_inputs import (
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


def test_rows_left_to_the_forward_land_by_the_count_and_a_step_without_resets_it():
    """scatter=False leaves the device table alone; the forward's scatter_table_rows
    reads the copied count and rows. A later step with inputs and no changed row copies
    a count of 0, so that a forward does not apply the older rows again."""
    di = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=3, device=torch.device("cpu"), pin=False)
    host_table = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    table = torch.full((5, 3), -1, dtype=torch.int32)
    di.fill(0, [_seq([1, 2], slot=3)], num_rows=1)
    di.upload(0, True, host_table, [3, 0], table, scatter=False)
    assert (table == -1).all()
    scatter_table_rows_ref(table, di.table_header, di.table_rows)
    assert table[[3, 0]].tolist() == host_table[[3, 0]].tolist()
    assert (table[[1, 2, 4]] == -1).all()
    di.fill(1, [_seq([1, 2, 3], slot=3)], num_rows=1)
    host_table[3] = 99
    di.upload(1, True, host_table, [], table, scatter=False)
    assert di.table_header[0].item() == 0
    scatter_table_rows_ref(table, di.table_header, di.table_rows)
    assert table[3].tolist() == [9, 10, 11]  # not applied again, nor changed


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


def _staged(di: DecodeInputs, parity: int, rows: int) -> list[list[int]]:
    return di._host[parity][0][:, :rows].tolist()


def test_the_same_decode_batch_again_advances_the_other_paritys_rows():
    di = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"), pin=False)
    seqs = [_seq([4, 5, 6], slot=2), _seq([7, 8], slot=0)]
    di.fill(0, seqs, num_rows=4)
    for seq in seqs:  # the launch: each takes the placeholder of the token it samples
        seq.token_ids.append(PLACEHOLDER)
    di.fill(1, list(seqs), num_rows=4)  # an equal list, as the scheduler builds each step
    fresh = DecodeInputs(
        max_num_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"), pin=False
    )
    fresh.fill(1, seqs, num_rows=4)
    assert _staged(di, 1, 4) == _staged(fresh, 1, 4)
    assert _staged(di, 1, 4)[POSITIONS] == [3, 2, 0, 0]
    assert _staged(di, 1, 4)[INPUT_IDS] == [PLACEHOLDER, PLACEHOLDER, 0, 0]


def test_rows_are_read_from_the_sequences_unless_the_launch_before_decoded_them_alone():
    def fresh_rows(parity, seqs, rows, chunks=()):
        fresh = DecodeInputs(
            max_num_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"), pin=False,
            max_rows=8,
        )  # fmt: skip
        fresh.fill(parity, seqs, rows, chunks)
        return _staged(fresh, parity, rows)

    di = DecodeInputs(
        max_num_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"), pin=False, max_rows=8
    )
    a, b = _seq([1, 2], slot=0), _seq([3, 4, 5], slot=1)
    # Other sequences (b left), after a launch that filled nothing (forget), after a step
    # with prompt chunks, and on the same parity: each is read from its sequence, whose
    # tokens here are not the placeholders an advance would assume.
    di.fill(0, [a, b], 4)
    di.fill(1, [a], 4)
    assert _staged(di, 1, 4) == fresh_rows(1, [a], 4)
    di.forget()
    di.fill(0, [a], 4)
    assert _staged(di, 0, 4) == fresh_rows(0, [a], 4)
    prompt = _seq([9, 9, 9], slot=2)
    di.fill(1, [a], 8, chunks=[(prompt, 3)])
    di.fill(0, [a], 4)
    assert _staged(di, 0, 4) == fresh_rows(0, [a], 4)
    di.fill(0, [a], 4)
    assert _staged(di, 0, 4) == fresh_rows(0, [a], 4)


def _small_engine():
    from replica import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", num_blocks=10, block_size=8, max_num_seqs=6,
            max_model_len=128, mixed_prefill_tokens=8, max_num_batched_tokens=32,
        )
    )  # fmt: skip


def _check_every_fill(engine) -> dict[str, int]:
    """Each fill's staged rows are compared with a fresh DecodeInputs' (every row read
    from its sequence); returns the counts of fills, and of advanced ones, as they come."""
    staging = engine.runner.step_inputs
    fill, calls = staging.fill, {"advanced": 0, "all": 0}

    def checked_fill(parity, seqs, num_rows, chunks=()):
        last = staging._last
        advanced = not chunks and last is not None and last[0] != parity and last[1] == seqs
        result = fill(parity, seqs, num_rows, chunks)
        fresh = DecodeInputs(
            engine.runner.max_num_seqs, engine.runner.max_blocks_per_seq, torch.device("cpu"),
            pin=False, max_rows=staging.max_rows,
        )  # fmt: skip
        assert fresh.fill(parity, seqs, num_rows, chunks) == result
        assert _staged(staging, parity, num_rows) == _staged(fresh, parity, num_rows)
        calls["advanced"] += advanced
        calls["all"] += 1
        return result

    staging.fill = checked_fill
    return calls


def test_an_engines_staged_rows_equal_rows_read_from_its_sequences_step_by_step():
    """Arrivals, mixed steps, stops, an abort and preemptions (few blocks): every fill,
    advanced or not, stages what reading each sequence would."""
    import random

    engine = _small_engine()
    calls = _check_every_fill(engine)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(14):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([3, 6, 11, 40]))]
        params = SamplingParams(
            max_tokens=rng.choice([1, 5, 12, 30]), temperature=rng.choice([0.0, 0.8]), seed=i,
            stop_token_ids=[rng.randrange(vocab) for _ in range(20)],
        )  # fmt: skip
        engine.add_request(f"r{i}", prompt, params)
        for _ in range(rng.choice([0, 1, 3])):
            engine.step()
        if i == 6:
            engine.abort("r4")
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert engine.scheduler.num_preempted_total > 0
    assert 0 < calls["advanced"] < calls["all"]


def test_decode_rows_after_launches_that_filled_none_are_read_from_their_sequences():
    """A 40-token prompt that wants one token runs two prefill forwards, the decode rows
    riding in them: the same two sequences decode before and after, three positions on."""
    engine = _small_engine()
    calls = _check_every_fill(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    for _ in range(4):
        engine.step()
    assert calls == {"advanced": 2, "all": 4}  # the prompts' step, a's and b's first decode
    engine.add_request("long", list(range(40)), SamplingParams(max_tokens=1))
    for _ in range(3):
        engine.step()
    assert calls == {"advanced": 2, "all": 5}  # two prefill forwards, then a's and b's rows
    while engine.has_unfinished():
        engine.step()


def test_sampling_region_rides_in_the_same_copy_only_when_asked():
    """A sampled step's staged sampling parameters reach the device in the step's one
    copy (with_sampling); a greedy step's copy starts after them and leaves them alone."""
    di = DecodeInputs(
        max_num_seqs=4, max_blocks_per_seq=3, device=torch.device("cpu"), pin=False,
        sampling_length=64,
    )  # fmt: skip
    assert di.sampling.shape == (64,) and di.inputs.data_ptr() == di.sampling.data_ptr() + 8 * 64
    table = torch.zeros((5, 3), dtype=torch.int32)
    di.sampling_staging[1][:] = torch.arange(64)
    di.fill(1, [_seq([4, 5], slot=2)], num_rows=1)
    di.upload(1, True, np.zeros((5, 3), np.int32), [], table)
    assert (di.sampling == 0).all(), "a greedy step's copy leaves the region alone"
    assert di.inputs[SLOTS, 0].item() == 2
    host_table = np.arange(15, dtype=np.int32).reshape(5, 3)
    di.fill(1, [_seq([4, 5, 6], slot=3)], num_rows=1)
    di.upload(1, True, host_table, [3], table, with_sampling=True)
    assert di.sampling.tolist() == list(range(64))
    assert di.inputs[POSITIONS, 0].item() == 2 and table[3].tolist() == [9, 10, 11]
    with pytest.raises(ValueError, match="sampling_length"):
        DecodeInputs(4, 3, torch.device("cpu"), pin=False, sampling_length=12)
