"""EngineLoop.add_many and EngineProcess.add_many: a group of one caller's adds posted as
one command batch with one future (LLMServer admits a submit or a submit group through
it), each request admitted or refused on its own, as a lone add would be."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from bench.cluster import FakeEngine, fake_engine
from cluster import engine_loop
from cluster.config import ClusterConfig
from cluster.engine_loop import AbortedBeforeAdmissionError, EngineLoop, EngineUnavailableError
from cluster.engine_process import EngineProcess
from cluster.messages import ABORTED, ERROR_FINISH, INVALID, GroupAck, SubmitRequest, decode_message
from cluster.transport import StepBatch
from replica import SamplingParams
from replica.outputs import StepOutputs
from tests.cluster.inprocess import local_server

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(max_tokens=10**6, ignore_eos=True)


class Finishes:
    """A deliver callback: each request's finish reason, and an event per request id."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}
        self.first_token = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, caller_id: str, batch: StepBatch) -> None:
        self.first_token.set()
        with self._lock:
            for i, reason in batch.finishes:
                self.reasons[batch.request_ids[i]] = reason

    def wait_for(self, request_ids: set[str], timeout_s: float = 10.0) -> dict[str, str]:
        deadline_s = time.monotonic() + timeout_s
        while not request_ids <= self.reasons.keys() and time.monotonic() < deadline_s:
            time.sleep(0.005)
        return self.reasons


def test_each_request_of_a_group_is_admitted_or_refused_on_its_own() -> None:
    finishes = Finishes()
    loop = EngineLoop(lambda: FakeEngine("r0", 0.001), "r0", 0.05, finishes)
    try:
        assert loop.abort("t").result(timeout=5) is False  # aborted before its add came
        short = SamplingParams(max_tokens=3, ignore_eos=True)
        group = [("a", [1, 2], short), ("bad", [], short), ("t", [3], short), ("b", [4], short)]
        admitted_a, bad, aborted, admitted_b = loop.add_many("c0", group).result(timeout=5)
        assert time.time() - 5 < admitted_a <= admitted_b <= time.time()
        assert isinstance(bad, ValueError) and "prompt_token_ids" in str(bad)
        assert isinstance(aborted, AbortedBeforeAdmissionError)
        assert finishes.wait_for({"a", "b"}) == {"a": "length", "b": "length"}
        assert loop.add_many("c0", []).result(timeout=5) == []
    finally:
        loop.shutdown()


def test_a_group_posted_to_a_stopped_loop_is_refused_request_by_request() -> None:
    loop = EngineLoop(lambda: FakeEngine("r0"), "r0", 0.05, Finishes())
    loop.shutdown()
    group = [(f"q{i}", [1], LONG) for i in range(3)]
    outcomes = loop.add_many("c0", group).result(timeout=5)
    assert [type(o) for o in outcomes] == [EngineUnavailableError] * 3


class FailingEngine(FakeEngine):
    """A FakeEngine whose adds outlast a command slice and whose first step with "q0"
    raises."""

    def add_request(self, *args, **kwargs) -> None:
        time.sleep(2 * engine_loop.COMMAND_SLICE_S)
        super().add_request(*args, **kwargs)

    def step(self) -> StepOutputs:
        if "q0" in self.requests:
            raise RuntimeError("kernel exploded")
        return super().step()


def test_a_group_is_cut_by_the_command_slice_and_keeps_what_was_admitted() -> None:
    """While requests decode, a step comes between the adds of a group as between lone
    adds; when that step fails the engine, the adds that ran keep their admission (their
    requests end with "error", not retried elsewhere) and the rest are refused."""
    engine = FailingEngine("r0", 0.001)
    finishes = Finishes()
    loop = EngineLoop(lambda: engine, "r0", 0.05, finishes)
    try:
        loop.add("c0", "d", [1], LONG).result(timeout=5)
        assert finishes.first_token.wait(5)  # "d" decodes: passes are sliced
        outcomes = loop.add_many("c0", [(f"q{i}", [1], LONG) for i in range(4)]).result(5)
    finally:
        loop.shutdown()
    assert isinstance(outcomes[0], float)  # one add per slice, then the failing step
    assert [type(o) for o in outcomes[1:]] == [EngineUnavailableError] * 3
    assert finishes.wait_for({"d", "q0"}) == {"d": ERROR_FINISH, "q0": ERROR_FINISH}


def test_a_group_through_the_engine_process_ends_with_error_when_the_child_dies() -> None:
    finishes = Finishes()
    config = ClusterConfig(model="fake", device="cpu", engine_process=True)
    engine = EngineProcess(config, "r0", 0.0, functools.partial(fake_engine, step_s=0.01), finishes)
    try:
        group = [("q0", [1, 2], LONG), ("bad", [], LONG), ("q1", [3], LONG)]
        admitted_0, bad, admitted_1 = engine.add_many("c0", group).result(timeout=30)
        assert isinstance(admitted_0, float) and isinstance(admitted_1, float)
        assert isinstance(bad, ValueError)
        assert finishes.first_token.wait(10)
        engine._proc.kill()
        reasons = finishes.wait_for({"q0", "q1"})
        assert reasons == {"q0": ERROR_FINISH, "q1": ERROR_FINISH}  # not "bad": never ran
    finally:
        engine.shutdown()


def slow_add_engine(config: ClusterConfig, replica_id: str, num_gpus: float) -> FakeEngine:
    return SlowAddEngine(replica_id, 0.001)


class SlowAddEngine(FakeEngine):
    """A FakeEngine whose adds outlast a command slice."""

    def add_request(self, *args, **kwargs) -> None:
        time.sleep(2 * engine_loop.COMMAND_SLICE_S)
        super().add_request(*args, **kwargs)


def test_requests_that_end_before_their_groups_answer_are_not_ended_again() -> None:
    """In the child, a group's adds span passes while a request decodes, so a request of
    one token ends before the group's "done" reaches the parent: when the child dies
    later, only the request still running there ends with "error"."""
    ends: list[tuple[str, str]] = []

    def deliver(caller_id: str, batch: StepBatch) -> None:
        ends.extend((batch.request_ids[i], reason) for i, reason in batch.finishes)

    config = ClusterConfig(model="fake", device="cpu", engine_process=True)
    engine = EngineProcess(config, "r0", 0.0, slow_add_engine, deliver)
    try:
        engine.add("c0", "d", [1], LONG).result(timeout=30)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        group = [(f"q{i}", [1], one) for i in range(4)]
        assert all(isinstance(o, float) for o in engine.add_many("c0", group).result(30))
        deadline_s = time.monotonic() + 10
        while len(ends) < 4 and time.monotonic() < deadline_s:
            time.sleep(0.005)
        engine._proc.kill()
        deadline_s = time.monotonic() + 10
        while len(ends) < 5 and time.monotonic() < deadline_s:
            time.sleep(0.005)
        time.sleep(0.1)  # any second end would be delivered with the first "error"
    finally:
        engine.shutdown()
    assert sorted(ends) == [("d", ERROR_FINISH)] + [(f"q{i}", "length") for i in range(4)]


def test_a_submit_group_is_one_add_many_with_each_outcome_in_its_ack() -> None:
    server = local_server(FakeEngine("r0", 0.002))
    posted: list[list[str]] = []
    add_many = server._engine_loop.add_many

    def spy(caller_id: str, requests: list) -> object:
        posted.append([request_id for request_id, _, _ in requests])
        return add_many(caller_id, requests)

    server._engine_loop.add_many = spy

    async def scenario() -> GroupAck:
        assert await server.abort("t") is False  # "t" is aborted before its add
        wires = [SubmitRequest(r, "c0", [1, 2], {"max_tokens": 2}).to_wire() for r in "abt"]
        wires.insert(1, SubmitRequest("bad", "c0", [1], {"max_tokens": 0}).to_wire())
        stream = server.submit_group(wires)
        ack = decode_message(await stream.__anext__())
        async for _ in stream:  # the carrier, until a and b have finished
            pass
        return ack

    try:
        ack = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert posted == [["a", "b", "t"]]  # the invalid one never reaches the engine
    assert ack.error_kinds == [None, INVALID, None, ABORTED]
    assert ack.admitted_s[0] is not None and ack.admitted_s[2] is not None
