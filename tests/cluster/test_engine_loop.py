"""EngineLoop without Ray: a caller that cancels its command's future must not stop the loop."""

from __future__ import annotations

import threading
import time

import pytest
import torch

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
    loop = EngineLoop(lambda: engine, "r0", 0.05, lambda caller, batch: delivered.append(batch))
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

    loop = EngineLoop(lambda: engine, "r0", 1.0, deliver)
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

    loop = EngineLoop(lambda: engine, "r0", 0.05, deliver)
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


def _burst_through_a_loop(decoding: bool, device_busy=None) -> list[str]:
    """Post twelve adds to an EngineLoop at once (each add taking a third of a slice),
    with a request decoding or the engine idle, and run them all to the end: the engine
    thread's adds of the burst and steps from the burst's first add on, in order."""
    from cluster import engine_loop

    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=256))
    events: list[str] = []
    gate = threading.Event()
    original_add, original_step = engine.add_request, engine.step

    def slow_add(request_id, *args, **kwargs):
        if request_id == "r0":
            gate.wait(5)  # holds the loop until the whole burst is posted
            events.clear()
        time.sleep(engine_loop.COMMAND_SLICE_S / 3)
        events.append(request_id)
        return original_add(request_id, *args, **kwargs)

    def step():
        events.append("step")
        return original_step()

    engine.add_request, engine.step = slow_add, step
    if device_busy is not None:
        engine.device_busy = lambda: device_busy(events)
    ended, first_token = threading.Event(), threading.Event()
    finishes: list[str] = []

    def deliver(caller: str, batch: StepBatch) -> None:  # on the engine thread
        first_token.set()
        finishes.extend(batch.request_ids[i] for i, _ in batch.finishes)
        if len(finishes) == 12 + decoding_request:
            ended.set()

    decoding_request = int(decoding)
    loop = EngineLoop(lambda: engine, "r0", 1.0, deliver)
    try:
        if decoding:  # a request with tokens to go: the burst arrives while it decodes
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            loop.add("c0", "d", [1, 2, 3], long).result(timeout=5)
            assert first_token.wait(5)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        futures = [loop.add("c0", f"r{i}", [3 + i, 5, 7], params) for i in range(12)]
        gate.set()
        for future in futures:
            future.result(timeout=5)
        assert ended.wait(20)
    finally:
        loop.shutdown()
    adds = [e for e in events if e != "step"]
    assert adds == [f"r{i}" for i in range(12)]  # in the order posted
    assert sorted(finishes) == sorted(adds + ["d"] * decoding_request)  # every request ended
    engine.check_invariants()
    return events


def test_a_burst_while_requests_decode_is_taken_in_slices_between_steps() -> None:
    """While requests decode, a pass runs commands for COMMAND_SLICE_S: their next step
    comes before the whole burst is added."""
    events = _burst_through_a_loop(decoding=True)
    assert 1 <= events.index("step") <= 3  # after one slice: at most three adds


def test_a_pass_runs_commands_on_while_the_device_is_busy() -> None:
    """Past its slice, a pass goes on while the device runs the step in flight: adds are
    taken in the device's shadow, the next step once the device is done."""
    events = _burst_through_a_loop(decoding=True, device_busy=lambda events: len(events) < 7)
    assert events.index("step") == 7  # the device reported busy until seven adds ran


def test_a_burst_into_an_idle_engine_is_added_whole() -> None:
    """With nothing decoding, a pass runs every command: the burst is prefilled in full
    steps."""
    events = _burst_through_a_loop(decoding=False)
    assert events.index("step") == 12


def test_commands_after_an_abort_that_ends_the_last_request_run_in_the_same_pass() -> None:
    """A slice cut short with nothing left to step would leave the rest of the commands
    until the loop's next wake-up (stats_period_s): once the engine has no work, a pass
    runs every command."""
    from cluster import engine_loop

    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=64))
    gate, first_token = threading.Event(), threading.Event()
    original_abort = engine.abort

    def slow_abort(request_id):  # outlasts the slice, and ends the only request
        gate.wait(5)
        time.sleep(2 * engine_loop.COMMAND_SLICE_S)
        return original_abort(request_id)

    engine.abort = slow_abort
    loop = EngineLoop(lambda: engine, "r0", 30.0, lambda caller, batch: first_token.set())
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        loop.add("c0", "d", [1, 2, 3], params).result(timeout=5)
        assert first_token.wait(5)  # "d" decodes
        aborted = loop.abort("d")
        unknown = [loop.abort(f"x{i}") for i in range(5)]  # tombstones: no engine work
        gate.set()
        assert aborted.result(timeout=5) is True
        start_s = time.monotonic()
        assert [f.result(timeout=10) for f in unknown] == [False] * 5
        assert time.monotonic() - start_s < 5.0  # not at the next wake-up, 30 s on
    finally:
        loop.shutdown()


def test_the_engine_is_built_and_stepped_on_the_engine_thread() -> None:
    """One thread runs all of the engine's torch work: built on the caller's thread, a
    CPU engine's parallel ops run on two OpenMP pools (cluster.engine_loop's docstring)."""
    threads: dict[str, set[threading.Thread]] = {"build": set(), "step": set()}
    done = threading.Event()

    def build() -> LLMEngine:
        threads["build"].add(threading.current_thread())
        engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=64))
        original_step = engine.step

        def step():
            threads["step"].add(threading.current_thread())
            return original_step()

        engine.step = step
        return engine

    def deliver(caller: str, batch: StepBatch) -> None:
        if batch.finishes:
            done.set()

    loop = EngineLoop(build, "r0", 1.0, deliver)
    try:
        assert loop.engine.model_config.vocab_size > 0
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        loop.add("c0", "a", [1, 2, 3], params).result(timeout=5)
        assert done.wait(10)
        (built_on,) = threads["build"]
        assert built_on is not threading.current_thread()
        assert built_on.name == "kvfleet-engine"
        assert threads["step"] == {built_on}
    finally:
        loop.shutdown()


def test_a_build_that_raises_is_raised_by_the_constructor() -> None:
    def build() -> LLMEngine:
        return LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", max_num_seqs=0))

    before = {t for t in threading.enumerate() if t.name == "kvfleet-engine"}
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineLoop(build, "r0", 1.0, lambda caller, batch: None)
    after = {t for t in threading.enumerate() if t.name == "kvfleet-engine"}
    assert after <= before  # its thread has ended


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_engine_built_on_the_engine_thread_gives_the_main_threads_tokens() -> None:
    """The loop's thread captures the engine's CUDA graphs and replays them; its greedy
    tokens are those of the same engine config run by generate() on this thread."""
    config = EngineConfig(
        model="gpt2-tiny", device="cuda", dtype="float16", num_blocks=256, max_num_seqs=16
    )
    prompts = [[(7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLMEngine(config).generate(prompts, params)]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    done = threading.Event()
    num_ended = [0]

    def deliver(caller: str, batch: StepBatch) -> None:
        for delta in batch.deltas():
            tokens[delta.request_id].extend(delta.token_ids)
        num_ended[0] += len(batch.finishes)
        if num_ended[0] == len(prompts):
            done.set()

    loop = EngineLoop(lambda: LLMEngine(config), "r0", 1.0, deliver)
    try:
        assert loop.engine.runner.use_cuda_graphs
        for i, prompt in enumerate(prompts):
            loop.add("c0", str(i), prompt, params).result(timeout=30)
        assert done.wait(60)
    finally:
        loop.shutdown()
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
