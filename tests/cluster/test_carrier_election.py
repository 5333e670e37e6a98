"""Carrier election races, in one process (tests/cluster/inprocess.py): no Ray, no sleeps
that decide anything; the orderings are forced by holding the engine or the event loop.

Each race once left a caller's requests riding on a carrier that nobody reads: they end
with ReplicaDiedError("no live carrier") although the replica is alive, and every retry
of that caller attached to the same dead carrier again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.errors import ReplicaDiedError, ReplicaError
from cluster.transport import CallerTransport, SubmitAck, SubmitRequest, TokenDelta, decode_message
from tests.cluster.inprocess import (
    GatedEngine,
    InProcessHandle,
    InProcessResponse,
    in_process,
    wait_thread_event,
)

pytestmark = pytest.mark.timeout(120)

CARRIER_TIMEOUT_S = 1.0  # a request whose carrier is never read fails this fast


@pytest.fixture
def engine() -> GatedEngine:
    return GatedEngine("r0")


@pytest.fixture
def handle(engine: GatedEngine) -> Iterator[InProcessHandle]:
    with in_process(engine) as in_process_handle:
        yield in_process_handle


def params(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def tokens_of(queue: asyncio.Queue) -> list[int]:
    """The request's tokens once it finishes; raises the ReplicaError it ends with."""
    token_ids: list[int] = []
    while True:
        item = await asyncio.wait_for(queue.get(), 60)
        if isinstance(item, ReplicaError):
            raise item
        assert isinstance(item, TokenDelta)
        token_ids += item.token_ids
        if item.finished:
            assert item.finish_reason == "length"
            return token_ids


async def generate(transport: CallerTransport, request_id: str, max_tokens: int) -> list[int]:
    _, queue = await transport.submit(request_id, [1, 2, 3], params(max_tokens))
    return await tokens_of(queue)


def test_carrier_whose_request_finished_before_its_ack_still_carries(
    engine: GatedEngine, handle: InProcessHandle
) -> None:
    """The elected stream's own request ends in the step right after its add, and that
    step's delivery reaches the replica's loop before the submit coroutine resumes (a
    one-token request; the engine thread holding the GIL). The stream must still become
    the carrier: the request's last delta is queued on it, and the caller's next
    requests attach to it."""
    transport = CallerTransport(handle, carrier_timeout_s=CARRIER_TIMEOUT_S)

    async def scenario() -> tuple[list[int], list[int]]:
        engine.gate_adds.set()
        submit = asyncio.create_task(transport.submit("a", [1, 2, 3], params(1)))
        await wait_thread_event(engine.add_entered)
        engine.gate_adds.clear()
        # Hold this loop (the replica's and the caller's) while the engine admits the
        # request and finishes it in one step: both hand-overs are then queued on the
        # loop, the add's result first, so the step's delivery runs before the submit
        # coroutine resumes.
        engine.release_add.set()
        assert engine.fanned_out.wait(30)
        _, queue = await submit
        first = await tokens_of(queue)
        return first, await generate(transport, "b", 3)

    try:
        first, second = asyncio.run(scenario())
    except ReplicaDiedError as exc:
        pytest.fail(f"a request rode on a carrier nobody reads: {exc}")
    assert first == [1]
    assert second == [1, 2, 3]


def test_submit_cancelled_after_its_stream_was_elected_leaves_the_carrier_read(
    engine: GatedEngine, handle: InProcessHandle
) -> None:
    """The caller stops waiting for a submit's ack (its task is cancelled: a disconnect,
    a deadline) after the replica elected that submit's stream as the caller's carrier,
    and another request of the caller attaches to that carrier meanwhile. The attached
    request must still get its tokens: someone has to read the elected stream."""
    transport = CallerTransport(handle, carrier_timeout_s=CARRIER_TIMEOUT_S)

    async def scenario() -> list[int]:
        engine.gate_adds.set()
        cancelled = asyncio.create_task(transport.submit("a", [1, 2, 3], params(50)))
        await wait_thread_event(engine.add_entered)  # "a" elected its stream; add held
        engine.gate_adds.clear()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        attached = asyncio.create_task(generate(transport, "b", 4))
        for _ in range(20):  # "b" reaches the replica and attaches to a's carrier
            await asyncio.sleep(0)
        engine.release_add.set()
        await transport.abort("a")  # what Client.stream does for a cancelled request
        return await attached

    try:
        tokens = asyncio.run(scenario())
    except ReplicaDiedError as exc:
        pytest.fail(f"a request rode on a carrier nobody reads: {exc}")
    assert tokens == [1, 2, 3, 4]


def test_elected_submit_cancelled_on_the_replica_unregisters_its_carrier(
    engine: GatedEngine, handle: InProcessHandle
) -> None:
    """Serve cancels the elected submit on the replica before it acked (its caller went
    away) while another request of the caller has attached. Nothing can carry that
    carrier any more: the caller's next submit must elect a fresh one, and the attached
    request must be aborted rather than generate into a queue nobody reads."""
    submit = handle.options(method_name="submit", stream=True)

    def wire(request_id: str, max_tokens: int) -> dict[str, Any]:
        return SubmitRequest(request_id, "caller", [1, 2, 3], params(max_tokens)).to_wire()

    async def ack_of(response: InProcessResponse) -> SubmitAck:
        ack = decode_message(await asyncio.wait_for(response.__anext__(), 60))
        assert isinstance(ack, SubmitAck)
        return ack

    async def scenario() -> tuple[SubmitAck, SubmitAck, bool]:
        engine.gate_adds.set()
        elected = submit.remote(wire("a", 50))
        await wait_thread_event(engine.add_entered)
        engine.gate_adds.clear()
        attached = submit.remote(wire("b", 10**6))  # would run for ever if not aborted
        for _ in range(20):
            await asyncio.sleep(0)
        elected.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        engine.release_add.set()
        attached_ack = await ack_of(attached)
        fresh = submit.remote(wire("c", 2))
        fresh_ack = await ack_of(fresh)
        async for _ in fresh:  # the fresh carrier ends once "c" has finished
            pass
        # Commands run in order on the engine thread: this abort follows any abort the
        # replica posted for "b" when it dropped the dead carrier.
        still_running = await handle.server.abort("b")
        return attached_ack, fresh_ack, still_running

    attached_ack, fresh_ack, still_running = asyncio.run(scenario())
    assert not attached_ack.carrier and attached_ack.error is None
    assert fresh_ack.carrier, "the next submit attached to a carrier nobody carries"
    assert fresh_ack.carrier_id != attached_ack.carrier_id
    assert not still_running, "a request of a dead carrier kept generating"


class _GhostCarrierHandle:
    """A replica that attaches every request to a carrier this caller never sees."""

    def __init__(self) -> None:
        self.caller_ids: list[str] = []

    def options(self, method_name: str, stream: bool, _by_reference: bool) -> _GhostCarrierHandle:
        return self

    def remote(self, wire: dict[str, Any]) -> Any:
        self.caller_ids.append(wire["caller_id"])
        return _one_item(SubmitAck("r0", False, f"ghost-of-{wire['caller_id']}").encode())

    def broadcast(self, method_name: str, *args: Any) -> _Answered:
        return _Answered()


class _Answered:
    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        return [False]


async def _one_item(item: bytes) -> Any:
    yield item


def test_no_live_carrier_gives_the_caller_a_fresh_id() -> None:
    """However a carrier came to be unread, the retry must not attach to it again: after
    "no live carrier" the caller's next submit goes out under a new caller id."""
    handle = _GhostCarrierHandle()
    transport = CallerTransport(handle, carrier_timeout_s=CARRIER_TIMEOUT_S)

    async def scenario() -> None:
        _, queue = await transport.submit("a", [1, 2], params(2))
        with pytest.raises(ReplicaDiedError, match="no live carrier"):
            await tokens_of(queue)
        await transport.submit("b", [1, 2], params(2))

    asyncio.run(scenario())
    first, second = handle.caller_ids
    assert second != first
