"""EngineLoop without Ray: a caller that cancels its command's future must not stop the loop."""

from __future__ import annotations

import threading
import time

from cluster.engine_loop import EngineLoop
from cluster.transport import StepBatch
from replica import EngineConfig, LLMEngine, SamplingParams


def test_cancelled_command_future_leaves_the_loop_serving() -> None:
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=64))
    gate = threading.Event()
    original_add = engine.add_request

    def slow_add(*args, **kwargs):  # holds the loop until the caller has cancelled
        gate.wait(5)
        return original_add(*args, **kwargs)

    engine.add_request = slow_add
    delivered: list[StepBatch] = []
    loop = EngineLoop(engine, "r0", 0.05, lambda caller, batch: delivered.append(batch))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        cancelled = loop.add("c0", "a", [1, 2, 3], params)
        assert cancelled.cancel()  # the awaiting coroutine went away
        gate.set()
        assert loop.abort("a").result(timeout=5) is True  # the add ran; the abort frees it
        engine.add_request = original_add
        admitted_s = loop.add("c0", "b", [4, 5, 6], params).result(timeout=5)
        assert time.time() - 5 < admitted_s <= time.time()  # when the engine took it
        deadline_s = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline_s:
            time.sleep(0.02)
        assert loop.is_alive and loop.failure is None
        assert not engine.has_unfinished()
        engine.check_invariants()
    finally:
        loop.shutdown()


def test_load_snapshot_of_a_finishing_step_leaves_the_cohort_retired() -> None:
    """The load snapshot a finishing step's batches carry counts the ended requests'
    blocks as free without releasing them there (the engine gives them back a few a
    step), so serving keeps what deferred release spares that step."""
    from replica.stats import ReplicaStats

    engine = LLMEngine(
        EngineConfig(model="gpt2-tiny", device="cpu", max_num_seqs=32, num_blocks=64)
    )
    seen: list[tuple[int, int, ReplicaStats]] = []  # (retired, held by running, load)

    def deliver(caller: str, batch: StepBatch) -> None:  # on the engine thread
        if batch.finishes and not seen:
            held = sum(len(s.block_ids) for s in engine.scheduler.running)
            load = ReplicaStats.from_msgpack(loop.load_stats)
            seen.append((len(engine.scheduler.retired), held, load))

    loop = EngineLoop(engine, "r0", 1.0, deliver)
    try:
        futures = []
        for i in range(12):  # ten end after 3 tokens, two after 12
            params = SamplingParams(
                max_tokens=3 if i < 10 else 12, temperature=0.0, ignore_eos=True
            )
            futures.append(loop.add("c0", f"r{i}", [3 + i, 5, 7, 9, 11], params))
        for future in futures:
            future.result(timeout=5)
        deadline_s = time.monotonic() + 20
        while engine.has_unfinished() and time.monotonic() < deadline_s:
            time.sleep(0.02)
        assert loop.is_alive and not engine.has_unfinished()
    finally:
        loop.shutdown()
    (retired, held, load) = seen[0]
    assert retired == 10 - 2  # the finishing step's drain released two of ten
    assert load.num_blocks_free + load.num_blocks_cached == 64 - held
    engine.check_invariants()


def test_each_request_gets_its_tokens_and_finish_reason_from_the_step_columns() -> None:
    """The fan-out reads the engine's StepOutputs columns: every token, in order, and the
    finish reason on the last, for requests that stop on a token and on their length."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=64))
    prompts = {"a": [3, 5, 7], "b": [11, 13], "c": [17, 19, 23, 29]}
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = dict(
        zip(
            prompts,
            (o.token_ids for o in engine.generate(list(prompts.values()), free)),
            strict=True,
        )
    )
    stop = reference["b"][2]
    params = {
        "a": free,
        "b": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
        "c": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    }
    b_end = reference["b"].index(stop) + 1
    expected = {
        "a": (reference["a"], "length"),
        "b": (reference["b"][:b_end], "stop"),
        "c": (reference["c"][:3], "length"),
    }
    delivered: list[StepBatch] = []
    done = threading.Event()

    def deliver(caller: str, batch: StepBatch) -> None:  # on the engine thread
        delivered.append(batch)
        if sum(len(b.finishes) for b in delivered) == len(prompts):
            done.set()

    loop = EngineLoop(engine, "r0", 0.05, deliver)
    try:
        for request_id, prompt in prompts.items():
            loop.add("c0", request_id, prompt, params[request_id]).result(timeout=5)
        assert done.wait(20)
    finally:
        loop.shutdown()
    got: dict[str, tuple[list[int], str | None]] = {r: ([], None) for r in prompts}
    for batch in delivered:
        for delta in batch.deltas():
            tokens, reason = got[delta.request_id]
            assert reason is None, f"{delta.request_id} got tokens after its end"
            got[delta.request_id] = (tokens + delta.token_ids, delta.finish_reason)
    assert got == expected


class _IdleEngine:
    """Takes requests and never steps: the test drives EngineLoop._fan_out itself."""

    def __init__(self) -> None:
        from bench.cluster import FakeEngine

        self._stats = FakeEngine("r0")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        pass

    def abort(self, request_id: str) -> bool:
        return True

    def has_unfinished(self) -> bool:
        return False

    def stats(self, with_hashes: bool = True):
        return self._stats.stats(with_hashes)


class _Metrics:
    """ReplicaMetrics' observers, counted."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.tpot_s = self
        self.tpots: list[float] = []

    def observe_ttft(self, value_s: float) -> None:
        self.ttfts.append(value_s)

    def observe(self, value_s: float) -> None:  # tpot_s.observe
        self.tpots.append(value_s)


def test_column_fan_out_matches_the_row_by_row_fan_out() -> None:
    """A StepOutputs' batches sliced by caller from its columns equal those made row by
    row from its RequestOutputs: rows, tokens, finishes' indices per caller, urgency (a
    first token or an end), TTFT and TPOT observations, and what stays tracked. Steps
    mix callers, first tokens, ends, and a row whose request was aborted since."""
    import random

    from replica.outputs import StepOutputs

    rng = random.Random(7)
    loops, sent, metrics = [], [], []
    for _ in range(2):
        got: list[tuple[str, StepBatch]] = []
        m = _Metrics()
        loop = EngineLoop(_IdleEngine(), "r0", 60.0, lambda c, b, got=got: got.append((c, b)), m)
        loops.append(loop)
        sent.append(got)
        metrics.append(m)
    try:
        params = SamplingParams(max_tokens=4)
        live: list[str] = []
        for step in range(40):
            for i in range(rng.randrange(3)):  # arrivals from three callers
                request_id = f"s{step}-{i}"
                caller = f"c{rng.randrange(3)}"
                for loop in loops:
                    loop.add(caller, request_id, [1], params).result(timeout=5)
                live.append(request_id)
            rows = rng.sample(live, k=rng.randrange(len(live) + 1))
            ends = {i: ("stop" if i % 2 else "length", 1, 0) for i in range(len(rows))
                    if rng.random() < 0.2}  # fmt: skip
            if rows and step % 9 == 8:  # aborted after its step launched: skipped
                for loop in loops:
                    assert loop.abort(rows[0]).result(timeout=5)
                live.remove(rows[0])
            outputs = StepOutputs(tuple(rows), [rng.randrange(100) for _ in rows], ends)
            for got in sent:
                got.clear()
            loops[0]._fan_out(outputs)  # the columns
            loops[1]._fan_out(list(outputs))  # RequestOutputs, row by row
            assert [(c, b.to_row(), b.urgent) for c, b in sent[0]] == [
                (c, b.to_row(), b.urgent) for c, b in sent[1]
            ]
            for i in ends:
                if rows[i] in live:
                    live.remove(rows[i])
            columns, by_row = loops
            assert columns._tracked.keys() == by_row._tracked.keys() == set(live)
            assert columns._awaiting_first == by_row._awaiting_first
            assert columns._num_tokens == by_row._num_tokens
            assert len(metrics[0].ttfts) == len(metrics[1].ttfts)
            assert len(metrics[0].tpots) == len(metrics[1].tpots)
        assert metrics[0].ttfts and metrics[0].tpots  # both were exercised
    finally:
        for loop in loops:
            loop.shutdown()
