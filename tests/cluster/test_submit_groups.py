"""Submit groups, in one process (tests/cluster/inprocess.py): the submits one caller makes
in one pass of its event loop go out as one LLMServer.submit_group call, each request
keeps its own outcome, and the router places and admits the group as one request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cluster import FakeEngine
from cluster.messages import GroupAck, GroupRefusedError, decode_message
from cluster.request_router import prompt_hash_key, route_group_from_call
from cluster.transport import CallerTransport
from router import OverloadedError, RouterConfig
from tests.cluster.inprocess import GatedEngine, InProcessHandle, in_process, wait_thread_event
from tests.cluster.test_transport_batches import deltas_of, params
from tests.router.test_request_router import fake_replica, make_router, pending

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def handle() -> Iterator[InProcessHandle]:
    with in_process(FakeEngine("r0")) as handle:
        yield handle


def calls(handle: InProcessHandle, method_name: str) -> list[Any]:
    method = handle.streams.get(method_name)
    return [] if method is None else method.responses


def group_acks(handle: InProcessHandle) -> list[GroupAck]:
    return [decode_message(r.items[0]) for r in calls(handle, "submit_group")]


async def tokens_of(transport: CallerTransport, rid: str, max_tokens: int) -> list[int]:
    _, stream = await transport.submit(rid, [1, 2, 3], params(max_tokens))
    deltas = await deltas_of(stream)
    assert deltas[-1].finish_reason == "length"
    return [t for d in deltas for t in d.token_ids]


def test_a_burst_from_one_loop_pass_is_one_call(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle)
        outs = await asyncio.gather(*(tokens_of(transport, f"q{i}", 5 + i) for i in range(8)))
        assert [len(tokens) for tokens in outs] == [5 + i for i in range(8)]
        assert calls(handle, "submit") == []
        (ack,) = group_acks(handle)
        assert len(ack) == 8 and ack.carrier and ack.errors == [None] * 8
        assert all(s is not None for s in ack.admitted_s)
        counters = await handle.server.serving_counters()
        assert (counters["submits"], counters["submit_calls"]) == (8, 1)
        assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_a_lone_submit_goes_alone(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle)
        assert len(await tokens_of(transport, "solo", 4)) == 4
        assert len(calls(handle, "submit")) == 1
        assert calls(handle, "submit_group") == []

    asyncio.run(scenario())


def test_a_burst_beyond_the_cap_makes_several_groups(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle, max_group_size=4)
        outs = await asyncio.gather(*(tokens_of(transport, f"q{i}", 3) for i in range(10)))
        assert all(len(tokens) == 3 for tokens in outs)
        assert [len(ack) for ack in group_acks(handle)] == [4, 4, 2]
        # One carrier for the caller: the first group elected it, the others attached.
        assert [ack.carrier for ack in group_acks(handle)] == [True, False, False]
        assert len({ack.carrier_id for ack in group_acks(handle)}) == 1

    asyncio.run(scenario())


def test_max_group_size_one_sends_each_alone(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle, max_group_size=1)
        await asyncio.gather(*(tokens_of(transport, f"q{i}", 2) for i in range(3)))
        assert len(calls(handle, "submit")) == 3 and calls(handle, "submit_group") == []

    asyncio.run(scenario())
    for bad in (0, 257, -1):
        with pytest.raises(ValueError, match="max_group_size"):
            CallerTransport(handle, max_group_size=bad)


def test_an_invalid_request_fails_alone_while_the_others_run(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle)
        bad = {**params(4), "temperature": -1.0}
        results = await asyncio.gather(
            tokens_of(transport, "good0", 4),
            transport.submit("bad", [1, 2], bad),
            transport.submit("empty", [], params(4)),  # the engine refuses it
            tokens_of(transport, "good1", 6),
            return_exceptions=True,
        )
        assert len(results[0]) == 4
        assert isinstance(results[1], ValueError) and "temperature" in str(results[1])
        assert isinstance(results[2], ValueError) and "prompt_token_ids" in str(results[2])
        assert len(results[3]) == 6
        (ack,) = group_acks(handle)
        assert [e is None for e in ack.errors] == [True, False, False, True]
        assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_a_group_of_invalid_requests_only_carries_nothing(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        transport = CallerTransport(handle)
        bad = {**params(4), "top_p": 2.0}
        results = await asyncio.gather(
            transport.submit("b0", [1], bad),
            transport.submit("b1", [2], bad),
            return_exceptions=True,
        )
        assert all(isinstance(r, ValueError) and "top_p" in str(r) for r in results)
        (call,) = calls(handle, "submit_group")
        for _ in range(100):  # its elected stream ends at once: nothing rides on it
            if transport.num_carriers == 0:
                break
            await asyncio.sleep(0.01)
        assert call.num_items == 1 and transport.num_carriers == 0
        assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_a_malformed_group_fails_every_request() -> None:
    async def scenario() -> None:
        with in_process(FakeEngine("r0")) as handle:
            for payload, field in (("junk", "requests"), ([{"request_id": 1}], "request_id")):
                stream = handle.server.submit_group(payload)
                ack = decode_message(await stream.__anext__())
                assert isinstance(ack, GroupAck) and not ack.carrier
                assert field in ack.errors[0]
                with pytest.raises(StopAsyncIteration):
                    await stream.__anext__()

    asyncio.run(scenario())


class _RefusingHandle(InProcessHandle):
    """A replica behind a router that refuses every group call with `error`."""

    def __init__(self, handle: InProcessHandle, error: Exception) -> None:
        super().__init__(handle.server)
        self.refusing = _RefusingCall(error)

    def options(self, method_name: str, stream: bool, _by_reference: bool = True) -> Any:
        if method_name == "submit_group":
            return self.refusing
        return super().options(method_name, stream, _by_reference)


class _RefusingCall:
    """A group call the router refused: its first item raises the router's error."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.num_calls = 0

    def remote(self, _wires: Any) -> Any:
        self.num_calls += 1

        async def refused() -> Any:
            raise self.error
            yield  # an async generator, as a streaming response is

        return refused()


def test_a_refused_group_goes_again_one_by_one(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        refusing = _RefusingHandle(handle, GroupRefusedError())
        transport = CallerTransport(refusing)
        outs = await asyncio.gather(*(tokens_of(transport, f"q{i}", 3) for i in range(5)))
        assert [len(tokens) for tokens in outs] == [3] * 5
        assert refusing.refusing.num_calls == 1
        assert len(calls(refusing, "submit")) == 5  # each admitted on its own
        assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_overload_of_the_group_call_rejects_every_request(handle: InProcessHandle) -> None:
    async def scenario() -> None:
        refusing = _RefusingHandle(handle, OverloadedError(0.5, "every replica is full"))
        transport = CallerTransport(refusing)
        results = await asyncio.gather(
            *(transport.submit(f"q{i}", [1, 2], params(4)) for i in range(5)),
            return_exceptions=True,
        )
        assert refusing.refusing.num_calls == 1 and calls(refusing, "submit") == []
        assert all(isinstance(r, OverloadedError) for r in results), results
        assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_a_cancelled_group_call_aborts_every_admitted_request() -> None:
    gated = GatedEngine("r0", step_s=0.01)  # a request of 10**6 tokens never ends by itself

    async def scenario() -> None:
        with in_process(gated) as handle:
            transport = CallerTransport(handle)
            gated.gate_adds.set()
            submits = [
                asyncio.ensure_future(transport.submit(f"q{i}", [1, 2], params(10**6)))
                for i in range(4)
            ]
            await wait_thread_event(gated.add_entered)  # the first add is in the engine
            (call,) = calls(handle, "submit_group")
            call.cancel()
            await asyncio.sleep(0.01)
            gated.gate_adds.clear()
            gated.release_add.set()
            results = await asyncio.gather(*submits, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results
            for _ in range(500):  # the aborts follow the adds through the engine thread
                if not gated.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert gated.engine.requests == {}  # every admitted request was aborted
            assert transport.num_in_flight == 0

    asyncio.run(scenario())


def test_a_lone_submit_rides_on_a_group_carrier() -> None:
    async def scenario() -> None:
        with in_process(FakeEngine("r0", step_s=0.005)) as handle:
            await ride(handle)

    async def ride(handle: InProcessHandle) -> None:
        transport = CallerTransport(handle)
        burst = asyncio.gather(*(tokens_of(transport, f"long{i}", 200) for i in range(3)))
        await asyncio.sleep(0)  # the group goes out
        while not calls(handle, "submit_group") or not calls(handle, "submit_group")[0].items:
            await asyncio.sleep(0.001)
        late = await tokens_of(transport, "late", 3)
        assert len(late) == 3
        assert [len(tokens) for tokens in await burst] == [200, 200, 200]
        (group,) = group_acks(handle)
        (alone,) = [decode_message(r.items[0]) for r in calls(handle, "submit")]
        assert group.carrier and not alone.carrier
        assert alone.carrier_id == group.carrier_id

    asyncio.run(scenario())


# --- routing a group ------------------------------------------------------------------


def _wire(rid: str, num_tokens: int, max_tokens: int, start: int = 0) -> dict[str, Any]:
    ids = list(range(start, start + num_tokens))
    return {"request_id": rid, "prompt_token_ids": ids, "max_tokens": max_tokens}


def test_a_group_routes_as_its_first_prompt_with_the_summed_need() -> None:
    group = [_wire("a", 40, 8), _wire("b", 17, 4, start=100), _wire("c", 1, 2, start=200)]
    request = route_group_from_call("a", group)
    assert request.prompt_token_ids == tuple(range(40))
    assert request.max_tokens == 14
    assert request.num_prompt_blocks(16) == 3 + 2 + 1  # each prompt's blocks, summed
    assert prompt_hash_key([group], {}, 4) == "prompt:0,1,2,3"


@pytest.mark.parametrize("on_overload", ["reject", "hold"])
def test_the_router_reserves_a_groups_blocks_and_refuses_one_that_cannot_fit(
    on_overload: str,
) -> None:
    async def scenario() -> None:
        config = RouterConfig(policy="kv", on_overload=on_overload)
        replicas = [fake_replica("r", num_blocks_used=60)]  # 40 of 100 blocks free
        router = make_router(config)
        fits = pending("g1", [_wire("a", 160, 8), _wire("b", 160, 8, start=500)])
        tiers = await router.choose_replicas(replicas, fits)
        assert [[r.replica_id.unique_id for r in tier] for tier in tiers] == [["r"]]
        assert router.admission.reservations.num_reserved_blocks("r") == 20  # 10 each
        # Five of 10 blocks each: one alone fits, the group of them does not, and is
        # refused at once (not held) so that its requests go again one by one.
        wires = [_wire(f"b{i}", 160, 8, start=1000 * i) for i in range(5)]
        assert await make_router(config).choose_replicas(replicas, pending("b0", wires[0]))
        router = make_router(config)
        too_big = pending("g2", wires)
        assert await router.choose_replicas(replicas, too_big)
        with pytest.raises(GroupRefusedError):
            await too_big.future
        assert router.admission.reservations.num_reserved_blocks("r") == 0
        assert router.holds == {}

    asyncio.run(scenario())


def test_callers_place_each_request_alone_unless_asked_to_group() -> None:
    from cluster import Client, ClusterConfig

    assert Client("app").max_group_size == 1 and ClusterConfig().submit_group_size == 1
    assert Client("app", max_group_size=64).max_group_size == 64
    for bad in (0, 257, "8"):
        with pytest.raises(ValueError, match="max_group_size"):
            Client("app", max_group_size=bad)
        with pytest.raises(ValueError, match="submit_group_size"):
            ClusterConfig(submit_group_size=bad)
