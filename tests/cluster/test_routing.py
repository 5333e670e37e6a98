"""Routing on a real local Ray + Serve (gpt2-tiny on CPU): load-aware choice, overload, stats.

Replicas run PacedEngine (bench.cluster): the real engine, each step padded to a
fixed time, so a request stays in flight for seconds and KV occupancy is something
the test controls (num_blocks=32 of 16 tokens: a 300-token prompt takes 19 blocks).
The config tests at the top start no Ray.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.cluster import paced_engine
from cluster import Client, ClusterConfig, build_app
from cluster.app import routing_config
from cluster.config import ROUTERS, SERVE_ROUTERS
from cluster.request_router import prompt_hash_key
from replica.sampling_params import SamplingParams
from router import OverloadedError

# ---- config (no Ray) ----------------------------------------------------------------


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_builds_its_serve_config(router: str) -> None:
    config = ClusterConfig(router=router, stats_period_s=0.1)
    serve_config = routing_config(config)
    assert serve_config.request_routing_stats_period_s == 0.1
    name = serve_config.get_request_router_class().__name__
    expected = {
        "serve-pow2": "PowerOfTwoChoicesRequestRouter",
        "serve-round-robin": "RoundRobinRouter",
        "serve-consistent-hash": "PromptHashRouter",
    }.get(router, "KVFleetRequestRouter")
    assert name == expected
    assert config.is_serve_router == (router in SERVE_ROUTERS)


@pytest.mark.parametrize("router", SERVE_ROUTERS)
@pytest.mark.parametrize(
    ("field", "value"), [("high_watermark", 0.8), ("on_overload", "reject"), ("max_hold_s", 5.0)]
)
def test_serve_routers_refuse_admission_settings(router: str, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ClusterConfig(router=router, **{field: value})
    with pytest.raises(ValueError, match="RouterConfig"):
        ClusterConfig(router=router).router_config()


@pytest.mark.parametrize(
    "value", [{"GPU": 1}, {"CPU": 1}, {"slot": -1}, {"slot": True}, {"": 1}, ["slot"]]
)
def test_replica_resources_validated(value: object) -> None:
    with pytest.raises(ValueError, match="replica_resources"):
        ClusterConfig(replica_resources=value)


def test_prompt_hash_key_is_the_prompt_prefix() -> None:
    def key(prompt: list[int], n: int = 4) -> str | None:
        return prompt_hash_key([{"prompt_token_ids": prompt, "max_tokens": 8}], {}, n)

    assert key([1, 2, 3, 4, 5]) == key([1, 2, 3, 4, 9]) != key([1, 2, 3, 5, 5])
    assert key([1, 2]) != key([1, 2, 3])
    assert prompt_hash_key([], {}, 4) is None
    assert prompt_hash_key(["text"], {}, 4) is None


# ---- a real local Ray + Serve ---------------------------------------------------------

REJECT_APP, HOLD_APP, HASH_APP = "route-reject", "route-hold", "route-hash"
STEP_S = 0.02  # paced engine step: 50 steps/s
HOLD_STEP_S = 0.03
MAX_HOLD_S = 3.0
NUM_BLOCKS = 32  # x 16 tokens: 512 tokens per replica, the model's whole context


def _prompt(num_tokens: int, start: int = 1) -> list[int]:
    return [(start + i) % 500 + 1 for i in range(num_tokens)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _paced(name: str, **fields: object) -> ClusterConfig:
    base = dict(
        model="gpt2-tiny", num_blocks=NUM_BLOCKS, max_num_seqs=16, device="cpu", app_name=name
    )
    return ClusterConfig(**(base | fields))


@dataclass(frozen=True)
class Apps:
    base_url: str
    reject_config: ClusterConfig
    reject: Client  # kv router, on_overload="reject", 2 replicas, HTTP at /reject
    hold: Client  # kv router, on_overload="hold" (max_hold_s=MAX_HOLD_S), 1 replica
    hashed: Client  # Serve's consistent-hash router on the prompt prefix, 2 replicas


@pytest.fixture(scope="module")
def apps(serve_base_url: str) -> Iterator[Apps]:
    from ray import serve

    reject = _paced(REJECT_APP, num_replicas=2, on_overload="reject", http=True)
    hold = _paced(HOLD_APP, num_replicas=1, max_hold_s=MAX_HOLD_S)
    hashed = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=2,
        router="serve-consistent-hash",
        num_blocks=64,
        max_num_seqs=16,
        device="cpu",
        app_name=HASH_APP,
    )
    for config, step_s, route_prefix in (
        (reject, STEP_S, "/reject"),
        (hold, HOLD_STEP_S, None),
        (hashed, None, None),
    ):
        factory = functools.partial(paced_engine, min_step_s=step_s) if step_s else None
        app = build_app(config, engine_factory=factory)
        serve.run(app, name=config.app_name, route_prefix=route_prefix)
    yield Apps(serve_base_url, reject, Client(REJECT_APP), Client(HOLD_APP), Client(HASH_APP))


async def _collect(client: Client, prompt: list[int], params: SamplingParams) -> list:
    return [chunk async for chunk in client.stream(prompt, params)]


async def _collect_timed(
    client: Client, prompt: list[int], params: SamplingParams
) -> tuple[float, list]:
    """(monotonic time of the first chunk, all chunks)."""
    chunks = client.stream(prompt, params)
    first = await chunks.__anext__()
    first_s = time.monotonic()
    return first_s, [first] + [chunk async for chunk in chunks]


async def _wait_until(client: Client, done, timeout_s: float = 10.0) -> dict:
    deadline_s = time.monotonic() + timeout_s
    while True:
        stats = {s.replica_id: s for s in await client.stats_async()}
        if done(stats):
            return stats
        assert time.monotonic() < deadline_s, stats
        await asyncio.sleep(0.05)


def _idle(stats: dict) -> bool:
    return all(s.num_running == 0 and s.num_waiting == 0 for s in stats.values())


@pytest.mark.ray
@pytest.mark.slow
def test_new_requests_avoid_the_loaded_replica(apps: Apps) -> None:
    client = apps.reject

    async def scenario() -> tuple[str, Counter, dict]:
        await _wait_until(client, _idle)
        # 300 + 150 tokens: 19..29 of 32 blocks, for 3 s at 50 steps/s. The shorts start
        # once it holds over 24 blocks (after ~1.7 s): the other replica, with all 8 shorts
        # on it, fills 8 of its 16 slots (load 0.5), still more than balance_band (0.1)
        # below the busy one's 0.78, so they are not ranked as equals.
        long = client.stream(_prompt(300), _params(150))
        busy = (await long.__anext__()).replica_id
        await _wait_until(client, lambda s: s[busy].num_running == 1 and s[busy].kv_usage > 0.75)
        shorts = await asyncio.gather(
            *(_collect(client, _prompt(5, start=7 * i), _params(4)) for i in range(8))
        )
        stats = await client.stats_async()
        await long.aclose()
        return busy, Counter(chunks[-1].replica_id for chunks in shorts), stats

    busy, placed, stats = asyncio.run(scenario())
    by_id = {s.replica_id: s for s in stats}
    (other,) = set(by_id) - {busy}
    assert placed == {other: 8}, (busy, placed)
    assert by_id[busy].num_running == 1  # the long request was still there throughout


@pytest.mark.ray
@pytest.mark.slow
def test_reject_flood_raises_overloaded_and_http_503(apps: Apps) -> None:
    client = apps.reject
    num_requests = 12  # 200-token prompts take 13 of 32 blocks: 2 fit per replica

    async def flood() -> list:
        await _wait_until(client, _idle)
        jobs = [_collect(client, _prompt(200, start=i), _params(20)) for i in range(num_requests)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(flood())
    rejected = [r for r in results if isinstance(r, OverloadedError)]
    completed = [r for r in results if isinstance(r, list)]
    assert len(rejected) + len(completed) == num_requests, results
    # Room for 4 (2 per replica); how many a burst gets depends on which snapshots the
    # router holds when it arrives (reservations charge a snapshot until a newer one
    # covers them), so only "some admitted, some refused" is certain. CI once saw 1.
    assert rejected and completed, (len(rejected), len(completed))
    assert all(r.retry_after_s > 0 for r in rejected)
    for chunks in completed:
        assert sum(len(c.token_ids) for c in chunks) == 20
        assert chunks[-1].finish_reason == "length"

    async def http_flood() -> list[httpx.Response]:
        await _wait_until(client, _idle)
        body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=apps.base_url, timeout=60) as http:
            posts = [
                http.post("/reject/v1/completions", json=body | {"prompt": _prompt(200, start=i)})
                for i in range(num_requests)
            ]
            return await asyncio.gather(*posts)

    responses = asyncio.run(http_flood())
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, [r.text for r in responses]
    assert statuses[503] and statuses[200], statuses
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["type"] == "overloaded"


@pytest.mark.ray
@pytest.mark.slow
def test_hold_waits_for_capacity_then_completes_or_gives_up(apps: Apps) -> None:
    client = apps.hold
    # One replica of 32 blocks: a 300-token request takes 19, a 250-token one needs 16.

    async def held_until_free() -> tuple[float, float, list]:
        await _wait_until(client, _idle)
        long = client.stream(_prompt(300), _params(20))
        await long.__anext__()
        held = asyncio.create_task(_collect_timed(client, _prompt(250, start=3), _params(4)))
        async for _ in long:
            pass
        long_done_s = time.monotonic()
        first_s, chunks = await held
        return long_done_s, first_s, chunks

    long_done_s, held_first_s, chunks = asyncio.run(held_until_free())
    assert held_first_s > long_done_s  # admitted only once the long request freed its blocks
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert chunks[-1].finish_reason == "length"

    async def held_past_max_hold() -> float:
        await _wait_until(client, _idle)
        long = client.stream(_prompt(300), _params(200))  # ~6 s at 30 ms per step
        await long.__anext__()
        start_s = time.monotonic()
        try:
            with pytest.raises(OverloadedError, match="held"):
                await _collect(client, _prompt(250, start=3), _params(4))
            return time.monotonic() - start_s
        finally:
            await long.aclose()

    waited_s = asyncio.run(held_past_max_hold())
    assert MAX_HOLD_S - 0.5 <= waited_s <= MAX_HOLD_S + 2.0


@pytest.mark.ray
@pytest.mark.slow
def test_stats_are_fresh_busy_and_idle(apps: Apps) -> None:
    client = apps.reject
    period_s = apps.reject_config.stats_period_s
    slack_s = 0.5  # a loaded 2-core machine

    def assert_fresh(stats: list) -> None:
        now_s = time.time()
        assert len(stats) == 2
        for s in stats:
            assert now_s - s.timestamp_s < period_s + slack_s, (now_s - s.timestamp_s, s)
            assert s.num_blocks_total == NUM_BLOCKS

    async def scenario() -> None:
        await _wait_until(client, _idle)
        assert_fresh(await client.stats_async())
        first = {s.replica_id: s.timestamp_s for s in await client.stats_async()}
        await asyncio.sleep(4 * period_s)
        later = {s.replica_id: s.timestamp_s for s in await client.stats_async()}
        assert all(later[r] > first[r] for r in first), (first, later)
        long = client.stream(_prompt(300), _params(100))
        busy = (await long.__anext__()).replica_id
        stats = await _wait_until(client, lambda s: s[busy].num_running == 1)
        assert_fresh(list(stats.values()))
        assert stats[busy].kv_usage > 0.5
        await long.aclose()

    asyncio.run(scenario())


@pytest.mark.ray
@pytest.mark.slow
def test_serve_consistent_hash_router_serves_with_prefix_affinity(apps: Apps) -> None:
    client = apps.hashed
    prompts = [_prompt(40, start=s) for s in (0, 100, 200, 300)]

    async def rounds() -> list[list]:
        jobs = [_collect(client, p, _params(6)) for p in prompts * 3]
        return await asyncio.gather(*jobs)

    results = asyncio.run(rounds())
    by_prompt: dict[int, set] = {}
    tokens: dict[int, set] = {}
    for i, chunks in enumerate(results):
        by_prompt.setdefault(i % len(prompts), set()).add(chunks[-1].replica_id)
        generated = tuple(t for c in chunks for t in c.token_ids)
        tokens.setdefault(i % len(prompts), set()).add(generated)
        assert chunks[-1].finish_reason == "length"
    assert all(len(replicas) == 1 for replicas in by_prompt.values()), by_prompt
    assert all(len(t) == 1 and len(next(iter(t))) == 6 for t in tokens.values())
