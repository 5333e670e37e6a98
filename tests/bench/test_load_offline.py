"""bench.load_offline: the offline peer replays bench.load's trace through a bare engine."""

from __future__ import annotations

import math

import pytest

from bench.load_metrics import compute_metrics
from bench.load_offline import replay, run_offline_peer
from bench.load_workload import RequestSpec, WorkloadConfig, build_trace
from replica import EngineConfig, LLMEngine

CONFIG = EngineConfig(
    model="gpt2-tiny", device="cpu", num_blocks=64, block_size=16, max_num_seqs=4,
    max_model_len=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(CONFIG)


def _trace(num_requests: int, rate: float = math.inf) -> list[RequestSpec]:
    return build_trace(
        WorkloadConfig(
            num_requests=num_requests,
            rate=rate,
            input_len=12,
            output_len=6,
            range_ratio=0.5,
            vocab_size=512,
            seed=3,
        )  # fmt: skip
    )


def _max_in_flight(records) -> int:
    """The most requests in the engine at once (at each request's send time)."""
    return max(sum(1 for r in records if r.sent_s <= s.sent_s < r.end_s) for s in records)


def test_closed_loop_gives_every_token_with_n_requests_in_flight(engine: LLMEngine) -> None:
    trace = _trace(9)
    records = replay(engine, trace, concurrency=3)
    assert [r.index for r in records] == list(range(9))
    assert all(r.outcome == "ok" and r.finish_reason == "length" for r in records)
    assert [r.num_output_tokens for r in records] == [s.max_tokens for s in trace]
    # Each finishing request is replaced at once: three in flight, never four.
    sent = sorted(r.sent_s for r in records)
    assert sent[2] < min(r.end_s for r in records) <= sent[3]
    assert _max_in_flight(records) == 3
    m = compute_metrics(records, list(range(9)))
    assert (m["completed"], m["lost"], m["errors"]) == (9, 0, 0)
    assert m["total_output_tokens"] == sum(s.max_tokens for s in trace)
    assert m["output_token_throughput"] > 0
    for r in records:
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.chunk_times_s == sorted(r.chunk_times_s)
        assert r.sent_s + r.e2e_s == pytest.approx(r.end_s, abs=1e-6)
    assert engine.stats().num_running == 0 and not engine.has_unfinished()


def test_open_loop_adds_each_request_at_its_arrival(engine: LLMEngine) -> None:
    trace = _trace(5, rate=40.0)  # ~25 ms apart: the engine idles (sleeps) between some
    assert trace[-1].arrival_s > 0.05
    records = replay(engine, trace, concurrency=None)
    assert all(r.outcome == "ok" for r in records)
    assert all(r.sent_s >= s.arrival_s for r, s in zip(records, trace, strict=True))
    assert [r.num_output_tokens for r in records] == [s.max_tokens for s in trace]


def test_a_request_the_engine_refuses_is_a_typed_error_not_lost(engine: LLMEngine) -> None:
    too_long = RequestSpec(1, [5] * 120, 20, 0.0)  # 140 tokens > max_model_len 128
    records = replay(engine, [RequestSpec(0, [1, 2, 3], 4, 0.0), too_long], concurrency=1)
    assert [r.outcome for r in records] == ["ok", "error"]
    assert records[1].error_type == "ValueError" and "max_model_len" in records[1].error_message
    m = compute_metrics(records, [0, 1])
    assert (m["completed"], m["errors"], m["lost"]) == (1, 1, 0)


def test_the_peer_runs_in_a_process_of_its_own_with_the_same_engine_config() -> None:
    trace = _trace(4)
    run = run_offline_peer(CONFIG, trace, concurrency=2, num_threads=1)
    assert run["num_blocks"] == 64 and run["device"] == "cpu"
    assert run["metrics"]["completed"] == 4
    assert run["metrics"]["total_output_tokens"] == sum(s.max_tokens for s in trace)
    assert len(run["records"]) == 4
