"""The step-batched output path, in one process (tests/cluster/inprocess.py): the column
format, DeltaStream's merging, and that ordering and completeness hold when a carrier
message carries several steps and requests get 0, 1 or several tokens per step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import FakeEngine
from cluster.errors import ReplicaDiedError, ReplicaError
from cluster.transport import (
    CallerTransport,
    CarrierBatch,
    DeltaStream,
    StepBatch,
    TokenDelta,
    decode_message,
)
from replica.outputs import RequestOutput
from tests.cluster.inprocess import GatedEngine, InProcessHandle, in_process, wait_thread_event

pytestmark = pytest.mark.timeout(120)


def params(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def deltas_of(stream: DeltaStream) -> list[TokenDelta]:
    """Every item the stream gives until its last; raises the ReplicaError it ends with."""
    items = []
    while True:
        item = await asyncio.wait_for(stream.get(), 60)
        if isinstance(item, ReplicaError):
            raise item
        items.append(item)
        if item.finished:
            return items


# --- the wire format ----------------------------------------------------------------------


def test_first_tokens_and_ends_make_a_batch_urgent() -> None:
    batch = StepBatch()
    batch.add("a", [5], None)
    assert not batch.urgent  # a later token of a running request can wait its turn
    batch.add("b", [6], None, first=True)
    assert batch.urgent
    ended = StepBatch()
    ended.add("a", [], "abort")
    assert ended.urgent


def test_step_batches_round_trip_as_columns() -> None:
    first = StepBatch()
    first.add("a", [5], None)
    first.add("b", [6, 7, 8], None)  # several tokens in one step (e.g. speculative)
    first.add("c", [], "abort")  # no token, but an end
    second = StepBatch()
    second.add("b", [9], "length")
    second.add("d", [], "error")

    message = decode_message(CarrierBatch("r0", [first, second]).encode())

    assert isinstance(message, CarrierBatch) and message.replica_id == "r0"
    assert [s.deltas() for s in message.steps] == [
        [TokenDelta("a", [5]), TokenDelta("b", [6, 7, 8]), TokenDelta("c", [], "abort")],
        [TokenDelta("b", [9], "length"), TokenDelta("d", [], "error")],
    ]


# --- DeltaStream ------------------------------------------------------------------------


def test_delta_stream_merges_what_arrived_and_keeps_order() -> None:
    stream = DeltaStream("a")
    assert stream.take() is None
    stream.push_one(1)
    stream.push([2, 3])
    stream.push_one(4)
    assert stream.take() == TokenDelta("a", [1, 2, 3, 4])
    assert stream.take() is None
    stream.push([5])
    stream.finish("stop")
    assert stream.take() == TokenDelta("a", [5], "stop")


def test_delta_stream_gives_tokens_before_the_error_they_preceded() -> None:
    stream = DeltaStream("a")
    stream.push([1, 2])
    error = ReplicaDiedError("carrier failed", "a")
    stream.fail(error)
    assert stream.take() == TokenDelta("a", [1, 2])
    assert stream.take() is error


def test_delta_stream_wakes_a_waiting_reader_once_with_everything() -> None:
    stream = DeltaStream("a")

    async def scenario() -> TokenDelta | ReplicaError:
        reader = asyncio.create_task(stream.get())
        await asyncio.sleep(0)  # the reader waits
        assert not reader.done()
        stream.push_one(1)
        stream.push_one(2)  # before the reader runs: one wake-up, both tokens
        return await reader

    assert asyncio.run(scenario()) == TokenDelta("a", [1, 2])


# --- through a replica: uneven steps, merged messages -------------------------------------


class UnevenEngine(FakeEngine):
    """Request i gets (step + i) % 4 new tokens per step: rows of 0, 1, 2 and 3 tokens,
    so the caller's demux cannot take the one-token-per-request shortcut. A request's
    tokens are 0, 1, 2, ... so the caller can check order and completeness."""

    def __init__(self) -> None:
        super().__init__("r0")
        self.num_steps = 0

    def step(self) -> list[RequestOutput]:
        outputs = []
        for i, (request_id, r) in enumerate(list(self.requests.items())):
            n = min((self.num_steps + i) % 4, r.max_tokens - r.num_generated)
            token_ids = list(range(r.num_generated, r.num_generated + n))
            r.num_generated += n
            finished = r.num_generated >= r.max_tokens
            reason = "length" if finished else None
            outputs.append(RequestOutput(request_id, token_ids, finished, reason))
            if finished:
                del self.requests[request_id]
        self.num_steps += 1
        return outputs


@pytest.fixture
def uneven_handle() -> Iterator[InProcessHandle]:
    with in_process(UnevenEngine()) as handle:
        yield handle


def test_uneven_steps_reach_every_request_in_order(uneven_handle: InProcessHandle) -> None:
    transport = CallerTransport(uneven_handle)
    lengths = [1, 2, 7, 30, 64, 5]

    async def one(i: int, max_tokens: int) -> list[int]:
        _, stream = await transport.submit(f"req-{i}", [1, 2, 3], params(max_tokens))
        deltas = await deltas_of(stream)
        assert [d.finish_reason for d in deltas][-1] == "length"
        return [t for d in deltas for t in d.token_ids]

    async def scenario() -> list[list[int]]:
        return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    assert asyncio.run(scenario()) == [list(range(n)) for n in lengths]


@pytest.fixture
def gated() -> GatedEngine:
    return GatedEngine("r0")


@pytest.fixture
def gated_handle(gated: GatedEngine) -> Iterator[InProcessHandle]:
    with in_process(gated) as handle:
        yield handle


def test_steps_made_while_the_carrier_could_not_run_share_one_message(
    gated: GatedEngine, gated_handle: InProcessHandle
) -> None:
    """The replica's loop is held while the engine runs a request's 20 steps: the carrier
    then sends them as one message, and the caller still gets all 20 tokens in order."""
    transport = CallerTransport(gated_handle)

    async def scenario() -> list[TokenDelta]:
        gated.gate_adds.set()
        submit = asyncio.create_task(transport.submit("a", [1, 2, 3], params(20)))
        await wait_thread_event(gated.add_entered)
        gated.gate_adds.clear()
        gated.release_add.set()
        assert gated.idle.wait(30)  # this loop is held: every step lands in the outbox
        _, stream = await submit
        return await deltas_of(stream)

    deltas = asyncio.run(scenario())
    assert [t for d in deltas for t in d.token_ids] == list(range(1, 21))
    assert deltas[-1].finish_reason == "length"
    (response,) = gated_handle.streams["submit"].responses
    assert response.num_items == 2  # the ack, then one message with the 20 steps


# --- the replica's message budget: many callers, few messages per step ---------------------


def carrier_steps(handle: InProcessHandle, carrier_id: str) -> list[list[StepBatch]]:
    """The steps of each message a carrier sent, in order (the ack left out)."""
    for response in handle.streams["submit"].responses:
        messages = [decode_message(item) for item in response.items]
        if messages and messages[0].carrier_id == carrier_id:
            return [m.steps for m in messages[1:] if isinstance(m, CarrierBatch)]
    raise AssertionError(f"no stream carried {carrier_id}")


def run_callers(
    step_s: float, messages_per_step: int, num_callers: int, max_tokens: int
) -> list[list[list[StepBatch]]]:
    """One request per caller (a transport each) on a FakeEngine replica; checks that
    each gets all its tokens in order; returns each carrier's messages."""

    async def one(transport: CallerTransport, i: int) -> str:
        _, stream = await transport.submit(f"req-{i}", [1, 2, 3], params(max_tokens))
        deltas = await deltas_of(stream)
        assert deltas[-1].finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == list(range(1, max_tokens + 1))
        return stream.carrier_id

    async def scenario(handle: InProcessHandle) -> list[str]:
        transports = [CallerTransport(handle) for _ in range(num_callers)]
        return await asyncio.gather(*(one(t, i) for i, t in enumerate(transports)))

    engine = FakeEngine("r0", step_s=step_s)
    with in_process(engine, carrier_messages_per_step=messages_per_step) as handle:
        return [carrier_steps(handle, carrier_id) for carrier_id in asyncio.run(scenario(handle))]


def test_more_callers_than_the_budget_send_every_few_steps() -> None:
    """Budget 1 message per step, 4 callers: each carrier sends every 4 steps (its
    request's first token at once)."""
    for messages in run_callers(0.002, messages_per_step=1, num_callers=4, max_tokens=41):
        # 1 + 40 / 4 when every caller is there from the first step; a few more while
        # the carriers of the other callers are still being elected. (Fewer when the
        # loop falls behind the steps: then a message carries whatever is pending.)
        assert len(messages) <= 16, [len(steps) for steps in messages]


def test_within_the_budget_every_step_is_sent() -> None:
    for messages in run_callers(0.002, messages_per_step=4, num_callers=4, max_tokens=41):
        assert len(messages) >= 20  # one per step, bar those the loop fell behind on


def test_a_held_step_goes_out_after_the_hold_limit() -> None:
    """Steps slower than CARRIER_MAX_HOLD_S: a carrier over its budget still sends each
    step, the hold limit bounds how late a token is."""
    for messages in run_callers(0.05, messages_per_step=1, num_callers=2, max_tokens=8):
        assert [len(steps) for steps in messages] == [1] * 8


def test_serving_counters_count_submits_and_messages() -> None:
    engine = FakeEngine("r0", step_s=0.002)
    with in_process(engine) as handle:

        async def scenario() -> None:
            transport = CallerTransport(handle)
            for i in range(3):
                _, stream = await transport.submit(f"req-{i}", [1, 2, 3], params(5))
                await deltas_of(stream)

        asyncio.run(scenario())
        counters = asyncio.run(handle.server.serving_counters())
        sent = [i for r in handle.streams["submit"].responses for i in r.items]
    assert counters["submits"] == 3 and counters["engine_cpu_s"] is None  # engine thread
    # every item but the acks is a carrier message (no heartbeat: 1 s apart)
    assert counters["messages"] == len(sent) - 3 and counters["heartbeats"] == 0


def test_given_up_carriers_are_remembered_up_to_a_bound() -> None:
    class NoCalls:
        def options(self, **_: Any) -> None:
            return None

    transport = CallerTransport(NoCalls())
    first_caller_id = transport.caller_id
    for i in range(CallerTransport.MAX_GIVEN_UP + 10):
        transport._lose_carrier(f"carrier-{i}", transport.caller_id)
    assert transport.caller_id != first_caller_id  # later submits elect a fresh carrier
    assert len(transport._given_up) == CallerTransport.MAX_GIVEN_UP
    assert "carrier-9" not in transport._given_up  # the oldest went first
    assert f"carrier-{CallerTransport.MAX_GIVEN_UP + 9}" in transport._given_up


def test_submits_take_serves_grpc_path_unless_told_otherwise() -> None:
    class Recorder:
        def options(self, **options: Any) -> dict[str, Any]:
            return options

    assert CallerTransport(Recorder())._submit["_by_reference"] is False
    assert CallerTransport(Recorder(), serve_grpc=False)._submit["_by_reference"] is True
