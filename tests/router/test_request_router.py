"""cluster.request_router with fake replicas: no Ray cluster, injected clock, no real sleeping."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

import cluster.request_router as adapter
from router import OverloadedError, RouterConfig
from tests.router.router_fakes import NOW_S, make_stats

DEPLOYMENT = DeploymentID(name="llm", app_name="kvfleet")


def fake_replica(unique_id: str, **stats_fields: object) -> SimpleNamespace:
    routing_stats = adapter.encode_routing_stats(make_stats("ignored", **stats_fields))
    return SimpleNamespace(replica_id=ReplicaID(unique_id, DEPLOYMENT), routing_stats=routing_stats)


def make_router(config: RouterConfig) -> adapter.KVFleetRequestRouter:
    router = adapter.KVFleetRequestRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN
    )
    kwargs = adapter.request_router_config(config).request_router_kwargs
    router.initialize_state(**kwargs)
    router.clock = lambda: NOW_S
    return router


def pending(request_id: str, *args: object, **kwargs: object) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    return PendingRequest(args=list(args), kwargs=kwargs, metadata=metadata)


def test_config_round_trips_through_request_router_kwargs() -> None:
    config = RouterConfig(policy="prefix", on_overload="reject", seed=3)
    serve_config = adapter.request_router_config(config, stats_period_s=0.2)
    assert serve_config.request_router_kwargs == dataclasses.asdict(config)
    assert serve_config.request_routing_stats_period_s == 0.2
    assert serve_config.get_request_router_class() is adapter.KVFleetRequestRouter
    with pytest.raises(ValueError, match="stats_period_s"):
        adapter.request_router_config(RouterConfig(stats_max_age_s=0.3), stats_period_s=0.2)


def test_extraction_is_tolerant() -> None:
    by_dict = adapter.route_request_from_call(
        "a", [{"prompt_token_ids": [1, 2], "max_tokens": 4}], {}
    )
    assert (by_dict.prompt_token_ids, by_dict.max_tokens) == ((1, 2), 4)
    by_kwargs = adapter.route_request_from_call("b", [], {"num_prompt_tokens": 40})
    assert by_kwargs.num_prompt_tokens == 40
    nested = SimpleNamespace(prompt_token_ids=[5], sampling_params=SimpleNamespace(max_tokens=9))
    assert adapter.route_request_from_call("c", [nested], {}).max_tokens == 9
    for junk in (["a text prompt"], [{"prompt_token_ids": "abc"}], [42], []):
        assert adapter.route_request_from_call("d", junk, {}).num_prompt_tokens == 0


def test_choose_replicas_ranks_running_replicas_and_reserves() -> None:
    async def scenario() -> None:
        router = make_router(RouterConfig(policy="kv"))
        replicas = [
            fake_replica("busy", num_blocks_used=70),
            fake_replica("idle", num_blocks_used=5),
            SimpleNamespace(replica_id=ReplicaID("new", DEPLOYMENT), routing_stats={}),
        ]
        request = pending("q1", {"prompt_token_ids": list(range(40)), "max_tokens": 8})
        tiers = await router.choose_replicas(replicas, request)
        assert [[r.replica_id.unique_id for r in tier] for tier in tiers] == [
            ["idle"],
            ["busy"],
            ["new"],
        ]
        assert request.routing_context.should_backoff
        assert router.admission.reservations.num_reserved_blocks("idle") == 3

    asyncio.run(scenario())


def test_reject_resolves_the_request_with_overloaded_error() -> None:
    async def scenario() -> None:
        router = make_router(RouterConfig(on_overload="reject", backoff_max_s=0.5))
        replicas = [fake_replica("full", num_blocks_used=100)]
        request = pending("q2", {"prompt_token_ids": [1, 2, 3]})
        tiers = await router.choose_replicas(replicas, request)
        assert tiers and tiers[0]  # non-empty, so Serve's loop sees the done future
        with pytest.raises(OverloadedError) as info:
            await request.future
        assert info.value.retry_after_s == 0.5

    asyncio.run(scenario())


def test_hold_sleeps_the_backoff_then_gives_up() -> None:
    slept: list[float] = []

    async def fake_sleep(delay_s: float) -> None:
        slept.append(delay_s)
        now[0] += delay_s

    now = [NOW_S]

    async def scenario() -> None:
        router = make_router(
            RouterConfig(
                backoff_initial_s=0.1, backoff_max_s=0.2, max_hold_s=0.5, stats_max_age_s=100.0
            )
        )
        router.clock = lambda: now[0]
        router.sleep = fake_sleep
        replicas = [fake_replica("full", num_blocks_used=100)]
        request = pending("q3", {"prompt_token_ids": [1, 2, 3]})
        while not request.future.done():
            tiers = await router.choose_replicas(replicas, request)
            if not request.future.done():
                assert tiers == []
                assert not request.routing_context.should_backoff
        assert isinstance(request.future.exception(), OverloadedError)
        assert router.holds == {}

    asyncio.run(scenario())
    assert slept == pytest.approx([0.1, 0.2, 0.2])


def test_hold_admits_once_the_replica_frees() -> None:
    replicas = [fake_replica("a", num_blocks_used=100)]

    async def fake_sleep(delay_s: float) -> None:
        replicas[0] = fake_replica("a", num_blocks_used=10)

    async def scenario() -> None:
        router = make_router(RouterConfig())
        router.sleep = fake_sleep
        request = pending("q4", {"prompt_token_ids": [1, 2, 3]})
        assert await router.choose_replicas(replicas, request) == []
        assert "q4" in router.holds
        tiers = await router.choose_replicas(replicas, request)
        assert [[r.replica_id.unique_id for r in t] for t in tiers] == [["a"]]
        assert router.holds == {}

    asyncio.run(scenario())


def test_confirmed_route_keeps_the_reservation_time() -> None:
    # Serve confirms a route (on_request_routed) after the replica accepted the call, by
    # which time the replica may already have published a snapshot counting the request.
    # That snapshot must still release the reservation, or the request is charged twice.
    async def scenario() -> None:
        now = [NOW_S]
        router = make_router(RouterConfig(on_overload="reject", high_watermark=1.0))
        router.clock = lambda: now[0]
        request = pending("q5", {"prompt_token_ids": list(range(200)), "max_tokens": 8})
        tiers = await router.choose_replicas([fake_replica("a", num_blocks_total=32)], request)
        assert [[r.replica_id.unique_id for r in t] for t in tiers] == [["a"]]
        counted = [fake_replica("a", num_blocks_total=32, num_blocks_used=13,
                                timestamp_s=NOW_S + 0.06)]  # fmt: skip
        now[0] = NOW_S + 0.07
        router.on_request_routed(request, counted[0].replica_id, None)
        now[0] = NOW_S + 0.08
        second = pending("q6", {"prompt_token_ids": list(range(1000, 1200))})
        tiers = await router.choose_replicas(counted, second)
        assert not second.future.done()
        assert [[r.replica_id.unique_id for r in t] for t in tiers] == [["a"]]

    asyncio.run(scenario())


def test_route_confirmed_on_a_lower_tier_moves_the_reservation() -> None:
    async def scenario() -> None:
        router = make_router(RouterConfig())
        replicas = [fake_replica("a", num_blocks_used=10), fake_replica("b", num_blocks_used=20)]
        request = pending("q7", {"prompt_token_ids": list(range(64))})
        await router.choose_replicas(replicas, request)
        book = router.admission.reservations
        assert (book.num_reserved_blocks("a"), book.num_reserved_blocks("b")) == (4, 0)
        router.on_request_routed(request, replicas[1].replica_id, None)
        assert (book.num_reserved_blocks("a"), book.num_reserved_blocks("b")) == (0, 4)
        assert book.by_request["q7"].reserved_at_s == NOW_S

    asyncio.run(scenario())
