"""Replica snapshots on carrier messages (cluster.live_stats): the wire, the process table,
that a caller's transport fills it, and that its routers take the newer of it and Serve's."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from bench.cluster import FakeEngine
from cluster import live_stats
from cluster.messages import CarrierBatch, StepBatch, decode_message
from cluster.transport import CallerTransport
from router import RouterConfig, RouteRequest
from tests.cluster.inprocess import in_process
from tests.router.router_fakes import NOW_S, make_stats
from tests.router.test_request_router import fake_replica, make_router, pending


def pending_route(request_id: str) -> RouteRequest:
    return RouteRequest(request_id, num_prompt_tokens=16)


pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def empty_table() -> Iterator[None]:
    live_stats.forget_all()
    yield
    live_stats.forget_all()


def test_carrier_batches_carry_a_snapshot_or_none() -> None:
    step = StepBatch()
    step.add("a", [5], None)
    data = make_stats("r0", num_running=3).to_msgpack()
    assert decode_message(CarrierBatch("r0", [step], data).encode()).stats == data
    assert decode_message(CarrierBatch("r0", [step]).encode()).stats is None


def test_the_table_keeps_the_newest_readable_snapshot() -> None:
    live_stats.note("r0", make_stats("r0", num_running=1, timestamp_s=NOW_S).to_msgpack())
    first = live_stats.latest("r0")
    assert first is not None and first.num_running == 1
    live_stats.note("r0", make_stats("r0", num_running=1, timestamp_s=NOW_S).to_msgpack())
    assert live_stats.latest("r0") is first  # the same bytes are not decoded again
    live_stats.note("r0", make_stats("r0", num_running=9, timestamp_s=NOW_S - 1).to_msgpack())
    assert live_stats.latest("r0") is first  # an older message that came late
    live_stats.note("r0", b"\xc1 not msgpack")
    live_stats.note("r0", make_stats("r0", num_running=2, timestamp_s=NOW_S + 1).to_msgpack())
    assert live_stats.latest("r0").num_running == 2
    assert live_stats.latest("r1") is None


def test_a_caller_learns_its_replicas_load_from_their_carriers() -> None:
    seen: set[int] = set()

    async def scenario(handle: object) -> None:
        transport = CallerTransport(handle)
        _, stream = await transport.submit("a", [1, 2, 3], {"max_tokens": 8, "ignore_eos": True})
        while not (await asyncio.wait_for(stream.get(), 60)).finished:
            stats = live_stats.latest("r0")
            seen.add(-1 if stats is None else stats.num_running)

    # Serve's stats period is long: what the caller learns, it learns from the carrier.
    with in_process(FakeEngine("r0", step_s=0.005), stats_period_s=1.0) as handle:
        asyncio.run(scenario(handle))
    assert 1 in seen  # while the request ran
    stats = live_stats.latest("r0")
    assert stats is not None and stats.replica_id == "r0"
    assert stats.num_blocks_total > 0 and stats.cached_prefix_hashes == ()
    assert stats.num_running == 0  # the message that ended the request says it is gone
    # The ack said when the engine took the request, on the replica's clock.
    assert stats.timestamp_s > live_stats.admitted_at("a", "r0") > stats.timestamp_s - 60
    assert live_stats.admitted_at("a", "elsewhere") is None


def test_the_router_releases_a_reservation_at_the_first_snapshot_after_admission() -> None:
    # The request id the router keys reservations by is kvfleet's (the wire dict's), the
    # one the replica's ack names; Serve's internal id is different.
    async def scenario() -> None:
        router = make_router(RouterConfig(policy="kv"))
        replicas = [fake_replica("a", num_blocks_total=1000, timestamp_s=NOW_S - 0.01)]
        request = pending("serve-internal-id", {"request_id": "q", "prompt_token_ids": [1] * 64})
        await router.choose_replicas(replicas, request)
        book = router.admission.reservations
        assert book.num_reserved_blocks("a") == 4 and "q" in book.by_request
        counted = make_stats("a", num_blocks_total=1000, num_blocks_used=4, num_running=1,
                             timestamp_s=NOW_S + 0.003)  # fmt: skip
        live_stats.note("a", counted.to_msgpack())
        # stamped after the engine took q, well within reservation_arrival_s (0.05 s)
        router.admission.admit(router.collect_stats(replicas)[0], pending_route("x"), NOW_S)
        assert book.num_reserved_blocks("a") == 4  # no ack yet: the margin holds it
        live_stats.note_admitted("q", "a", NOW_S + 0.002)  # its ack; then the next message:
        live_stats.note("a", dataclasses.replace(counted, timestamp_s=NOW_S + 0.004).to_msgpack())
        router.admission.admit(router.collect_stats(replicas)[0], pending_route("y"), NOW_S)
        assert book.num_reserved_blocks("a") == 0

    asyncio.run(scenario())


def test_the_router_takes_the_newer_snapshot_with_serves_prefix_hashes() -> None:
    # Serve's snapshots (0.3 s old) show a idle and b busy; the carriers' newer ones show
    # a full of requests that arrived since: the request goes to b.
    async def scenario() -> None:
        router = make_router(RouterConfig(policy="kv"))
        old = {"num_blocks_total": 1000, "timestamp_s": NOW_S - 0.3}
        replicas = [
            fake_replica("a", cached_prefix_hashes=(7, 8), **old),
            fake_replica("b", num_running=32, **old),
        ]
        request = pending("q", {"prompt_token_ids": list(range(32))})
        tiers = await router.choose_replicas(replicas, request)
        assert [t[0].replica_id.unique_id for t in tiers] == ["a", "b"]
        busy = make_stats("a", num_blocks_total=1000, num_running=64, timestamp_s=NOW_S - 0.01)
        live_stats.note("a", busy.to_msgpack())
        request = pending("q2", {"prompt_token_ids": list(range(32))})
        tiers = await router.choose_replicas(replicas, request)
        assert [t[0].replica_id.unique_id for t in tiers] == ["b", "a"]
        known, _ = router.collect_stats(replicas)
        assert known[0] == dataclasses.replace(busy, cached_prefix_hashes=(7, 8))
        assert router.collect_stats(replicas)[0][0] is known[0]  # unchanged: the same object

    asyncio.run(scenario())


def test_a_stale_carrier_snapshot_does_not_hide_a_newer_serve_one() -> None:
    async def scenario() -> None:
        router = make_router(RouterConfig(policy="kv"))
        live_stats.note("a", make_stats("a", num_running=64, timestamp_s=NOW_S - 1).to_msgpack())
        replicas = [fake_replica("a", num_running=1, timestamp_s=NOW_S - 0.1)]
        (stats,), _ = router.collect_stats(replicas)
        assert stats.num_running == 1

    asyncio.run(scenario())


def test_the_routers_caches_forget_replicas_that_left() -> None:
    router = make_router(RouterConfig(policy="kv"))
    for i in range(100):  # replicas replaced one after another
        live_stats.note(f"r{i}", make_stats(f"r{i}", timestamp_s=NOW_S + 1).to_msgpack())
        router.collect_stats([fake_replica(f"r{i}"), fake_replica("kept")])
    assert len(router.decoded) + len(router.merged) <= 4 * 2 + 16
    assert "kept" in router.decoded and "r99" in router.merged
