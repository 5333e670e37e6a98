"""FanOut: a step's outputs cut into one StepBatch per caller."""

from __future__ import annotations

import random

import pytest

from cluster.fan_out import FanOut
from cluster.messages import ERROR_FINISH
from replica.outputs import RequestOutput, StepOutputs


class _Metrics:
    """ReplicaMetrics' observers, recorded."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.steps: list[tuple[float, int, int]] = []
        self.ended: list[tuple[str, int]] = []

    def observe_step(self, now_s: float, num_tokens: int, num_continuing: int) -> None:
        self.steps.append((now_s, num_tokens, num_continuing))

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttfts.append(ttft_s)

    def observe_finish(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        self.ended.append((reason, 1))
        if tpot_s is not None:
            self.tpots.append(tpot_s)

    def count_ended(self, reason: str, n: int = 1) -> None:
        self.ended.append((reason, n))


@pytest.mark.parametrize("num_callers", [1, 3])
def test_columns_give_the_batches_rows_give(num_callers: int) -> None:
    """A StepOutputs' batches sliced by caller from its columns equal those made row by
    row from its RequestOutputs: rows, tokens, finishes' indices per caller, urgency (a
    first token or an end), TTFT and TPOT (in any order), and what stays tracked. Steps
    mix first tokens, ends, and a row whose request was aborted since."""
    rng = random.Random(7)
    metrics = [_Metrics(), _Metrics()]
    columns, by_row = FanOut(metrics[0]), FanOut(metrics[1])
    live: list[str] = []
    for step in range(60):
        now_s = float(step)
        for i in range(rng.randrange(3)):
            request_id, caller = f"s{step}-{i}", f"c{rng.randrange(num_callers)}"
            for fan_out in (columns, by_row):
                fan_out.track(request_id, caller, now_s - 0.5)
            live.append(request_id)
        rows = rng.sample(live, k=rng.randrange(len(live) + 1))
        ends = {i: ("stop" if i % 2 else "length", 1, 0) for i in range(len(rows))
                if rng.random() < 0.2}  # fmt: skip
        if rows and step % 9 == 8:  # aborted after its step launched: skipped
            for fan_out in (columns, by_row):
                assert fan_out.abort(rows[0]) is not None
            live.remove(rows[0])
        outputs = StepOutputs(tuple(rows), [rng.randrange(100) for _ in rows], ends)
        got = columns.step(outputs, now_s)
        want = by_row.step(list(outputs), now_s)  # RequestOutputs, row by row
        assert {c: (b.to_row(), b.urgent) for c, b in got.items()} == {
            c: (b.to_row(), b.urgent) for c, b in want.items()
        }
        for i in ends:
            if rows[i] in live:
                live.remove(rows[i])
        assert set(columns.tracked_ids) == set(by_row.tracked_ids) == set(live)
        assert columns.awaiting_first == by_row.awaiting_first
        assert all(columns.num_tokens(r) == by_row.num_tokens(r) for r in live)
    assert sorted(metrics[0].ttfts) == sorted(metrics[1].ttfts) and metrics[0].ttfts
    assert sorted(metrics[0].tpots) == sorted(metrics[1].tpots) and metrics[0].tpots
    assert metrics[0].steps == metrics[1].steps and metrics[0].steps
    assert sorted(metrics[0].ended) == sorted(metrics[1].ended) and metrics[0].ended


def test_a_request_is_urgent_at_its_first_token_and_end_and_measured() -> None:
    """TTFT from admission to the first token; TPOT over the tokens after it; a batch is
    urgent only when it holds a first token or an end; an ended request is untracked."""
    metrics = _Metrics()
    fan_out = FanOut(metrics)
    fan_out.track("a", "c0", 10.0)
    fan_out.track("b", "c1", 10.0)
    first = fan_out.step(StepOutputs(("a",), [5]), 10.25)
    assert first["c0"].urgent and first["c0"].deltas()[0].token_ids == [5]
    assert metrics.ttfts == [0.25]
    middle = fan_out.step(StepOutputs(("a", "b"), [6, 7]), 10.5)
    assert not middle["c0"].urgent and middle["c1"].urgent  # b's first token
    last = fan_out.step(StepOutputs(("a",), [8], {0: ("length", 3, 0)}), 11.25)
    assert last["c0"].urgent and last["c0"].finishes == [(0, "length")]
    assert metrics.tpots == [(11.25 - 10.25) / 2]  # 3 tokens: 2 after the first
    assert set(fan_out.tracked_ids) == {"b"}
    assert fan_out.fail_all()["c1"].finishes == [(0, ERROR_FINISH)]
    assert not fan_out.tracked_ids and not fan_out.awaiting_first


def test_rows_without_tokens_and_untracked_rows_are_skipped() -> None:
    """A prefill chunk's row (no token, no end) gives its caller nothing; a row of a
    request no longer tracked is dropped; without metrics nothing is counted."""
    fan_out = FanOut()
    fan_out.track("a", "c0", 0.0)
    rows = [RequestOutput("a", []), RequestOutput("gone", [1])]
    assert fan_out.step(rows, 1.0) == {}
    assert fan_out.untrack("gone") is None
    batches = fan_out.step(StepOutputs(("a", "gone"), [3, 4]), 2.0)  # by rows: "gone" out
    assert batches["c0"].deltas()[0].token_ids == [3] and len(batches["c0"].request_ids) == 1
    assert fan_out.num_tokens("a") == 0 and fan_out.awaiting_first == frozenset()
