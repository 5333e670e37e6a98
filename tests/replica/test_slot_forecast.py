"""The replica's slot forecast and prefill rate (ReplicaStats.slot_free_steps, step_s,
prefill_tokens_per_s): what admission reads to see when a full replica's slots free.

A forecast is published only while the queue fills every free slot and max_tokens ended
most recent outputs; it lists each running sequence's steps to its max_tokens, soonest
first. Outputs that end on stop tokens leave it empty: max_tokens does not tell when
their slots free.
"""

from __future__ import annotations

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.sampling_params import SamplingParams


def _engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", num_blocks=128, max_num_seqs=4,
            max_num_batched_tokens=32,
        )
    )  # fmt: skip


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def _warm(engine: LLMEngine, params: SamplingParams, count: int = 16) -> None:
    for i in range(count):
        engine.add_request(f"warm-{params.max_tokens}-{i}", [1, 2, 3], params)
    _run_to_completion(engine)


def test_a_full_replica_whose_outputs_end_at_max_tokens_forecasts_its_slots() -> None:
    engine = _engine()
    length = SamplingParams(max_tokens=2, ignore_eos=True)
    _warm(engine, length)  # 16 ends, all by max_tokens
    assert engine.stats().slot_free_steps == ()  # idle: every slot is free
    engine.add_request("one", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.stats().slot_free_steps == ()  # three slots free
    engine.abort("one")
    for i, max_tokens in enumerate((9, 5, 7, 12)):  # the four slots
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{i}", [5, 6, 7], params)
    engine.step()
    engine.step()  # the four run; the next request would wait for a slot
    stats = engine.stats()
    remaining = sorted(seq.max_len - len(seq.token_ids) for seq in engine.scheduler.running)
    assert len(remaining) == 4 and remaining[0] < remaining[-1]
    assert stats.slot_free_steps == tuple(remaining) and stats.step_s > 0.0
    engine.add_request("queued", [8, 9], length)
    engine.step()  # one step on: each end one step nearer
    assert engine.stats().slot_free_steps == tuple(r - 1 for r in remaining)
    _run_to_completion(engine)
    assert engine.stats().slot_free_steps == ()


def test_outputs_that_end_on_stop_tokens_give_no_forecast() -> None:
    engine = _engine()
    every_token = list(range(engine.model_config.vocab_size))  # the first token stops
    _warm(engine, SamplingParams(max_tokens=8, stop_token_ids=every_token))
    for i in range(6):  # slots full, two queued
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.stats().slot_free_steps == ()


def test_a_sequence_still_prefilling_counts_its_whole_max_tokens() -> None:
    """The forecast reads the last launch's columns while every running sequence samples
    in it, and the sequences themselves otherwise: both say the same."""
    engine = _engine()
    _warm(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    for i, max_tokens in enumerate((9, 5, 7)):
        engine.add_request(
            f"r{i}", [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
    engine.step()
    engine.step()
    # A 60-token prompt takes the last slot and two or more steps of the 32-token budget.
    engine.add_request("long", list(range(1, 61)), SamplingParams(max_tokens=11, ignore_eos=True))
    engine.step()
    running = engine.scheduler.running
    long_seq = next(seq for seq in running if seq.request_id == "long")
    assert long_seq.num_computed_tokens < 60  # mid-prefill: not among the sampled rows
    assert len(engine._last_launch.seqs) < len(running)
    slot_free_steps = engine.stats().slot_free_steps
    assert 11 in slot_free_steps
    assert slot_free_steps == tuple(sorted(s.max_len - len(s.token_ids) for s in running))
