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
