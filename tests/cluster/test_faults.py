"""Faults on a real local Ray + Serve app: overload, disconnects, a killed replica, a lost node.

Every submitted request must end in a completion or a typed error (ValueError,
OverloadedError, ReplicaError); the tests count both. Greedy outputs are compared with
an offline engine, so a retried request that was generated twice, or whose tokens mixed
two attempts, fails. Runs on 2 shared cores: one small app for the module (the node
test, first in the file, builds its own two-node cluster before the module app starts).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from cluster import Client, ClusterConfig, build_app
from cluster.errors import ReplicaDiedError, ReplicaError
from replica import LLMEngine, SamplingParams
from replica.stats import ReplicaStats
from router.errors import OverloadedError
from tests.cluster.local_ray import free_port, init_local_ray, start_local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP_NAME = "kvfleet-faults"
DEPLOYMENT = "LLMServer"


def fault_config(http: bool) -> ClusterConfig:
    return ClusterConfig(
        model="gpt2-tiny",
        num_replicas=2,
        router="kv",
        num_blocks=48,  # 768 tokens per replica: a handful of long requests exhaust it
        max_num_seqs=8,
        device="cpu",
        http=http,
        app_name=APP_NAME,
        max_hold_s=20.0,
    )


@dataclass(frozen=True)
class FaultApp:
    config: ClusterConfig
    client: Client
    base_url: str


def _serve_app(config: ClusterConfig, port: int | None = None) -> None:
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port or 8000})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/" if config.http else None)


@pytest.fixture(scope="module")
def fault_app() -> Iterator[FaultApp]:
    import ray
    from ray import serve

    init_local_ray(num_cpus=4)
    port = free_port()
    config = fault_config(http=True)
    try:
        _serve_app(config, port)
        client = Client(APP_NAME, max_retries=3, carrier_timeout_s=5.0)
        yield FaultApp(config, client, f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


# --- helpers ---------------------------------------------------------------------------


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(length)] for _ in range(num)]


def offline_greedy(config: ClusterConfig, prompts: list[list[int]], max_tokens: int) -> list:
    engine = LLMEngine(config.engine_config("offline", num_gpus=0))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


@dataclass
class Outcome:
    """How one request ended: tokens received, and the error if it did not complete."""

    token_ids: list[int]
    replica_ids: set[str]
    finish_reason: str | None = None
    error: BaseException | None = None


async def run_request(
    client: Client,
    prompt: list[int],
    params: SamplingParams,
    first_token: asyncio.Event | None = None,
) -> Outcome:
    outcome = Outcome([], set())
    try:
        async for chunk in client.stream(prompt, params):
            outcome.token_ids += chunk.token_ids
            outcome.replica_ids.add(chunk.replica_id)
            outcome.finish_reason = chunk.finish_reason
            if first_token is not None:
                first_token.set()
    except (ValueError, OverloadedError, ReplicaError) as exc:
        outcome.error = exc
    return outcome


def is_idle(stats: ReplicaStats) -> bool:
    return (
        stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks_total
        and stats.num_running == 0
        and stats.num_waiting == 0
    )


async def wait_idle(client: Client, num_replicas: int, timeout_s: float = 15.0) -> list:
    """Stats once every replica is idle with no block held; fails the test otherwise."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        stats = await client.stats_async()
        if len(stats) == num_replicas and all(map(is_idle, stats)):
            return stats
        assert time.monotonic() < deadline_s, f"replicas not idle / blocks leaked: {stats}"
        await asyncio.sleep(0.1)


async def wait_busy(client: Client, timeout_s: float = 5.0) -> float:
    """The highest KV usage once some replica reports blocks in use (stats lag a period)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        usage = max(s.kv_usage for s in await client.stats_async())
        if usage > 0 or time.monotonic() > deadline_s:
            return usage
        await asyncio.sleep(0.02)


def kill_replica(replica_id: str) -> None:
    import ray

    name = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{replica_id}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def live_replica_ids() -> set[str]:
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
    if status.replica_states.get("RUNNING", 0) != 2:
        return set()
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#"
    return {
        a["name"].removeprefix(prefix)
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


def check_greedy(outcomes: list[Outcome], expected: list[list[int]]) -> dict[str, int]:
    """Completions equal the offline tokens; errors carry a prefix of them. Counts by kind."""
    counts = {"completed": 0, "died": 0, "overloaded": 0, "retried_ok": 0}
    for outcome, tokens in zip(outcomes, expected, strict=True):
        if outcome.error is None:
            assert outcome.finish_reason == "length"
            assert outcome.token_ids == tokens  # once, from one attempt
            counts["completed"] += 1
        elif isinstance(outcome.error, ReplicaDiedError):
            assert outcome.error.token_ids == outcome.token_ids == tokens[: len(outcome.token_ids)]
            assert outcome.token_ids, "a request that streamed nothing must be retried"
            counts["died"] += 1
        else:
            assert isinstance(outcome.error, OverloadedError), repr(outcome.error)
            counts["overloaded"] += 1
    return counts


# --- a node removed from a two-node cluster (first: it owns the Ray of its own) -------


@pytest.mark.slow
def test_node_removed_requests_end_typed_and_serving_resumes() -> None:
    import ray
    from ray import serve

    assert not ray.is_initialized(), "this test builds its own cluster; run it first"
    # Each replica takes 1 CPU: one fits on the head, the other on the worker node.
    head = {"num_cpus": 1, "include_dashboard": False}
    cluster, (_, worker) = start_local_cluster([head, {"num_cpus": 1}])
    try:
        config = fault_config(http=False)
        _serve_app(config)
        client = Client(APP_NAME, max_retries=3, carrier_timeout_s=4.0)
        prompts = random_prompts(12, 24, seed=7)
        expected = offline_greedy(config, prompts, max_tokens=120)
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

        async def scenario() -> list[Outcome]:
            started = asyncio.Event()
            jobs = [asyncio.create_task(run_request(client, p, params, started)) for p in prompts]
            await started.wait()
            await asyncio.sleep(0.5)
            cluster.remove_node(worker, allow_graceful=False)
            done, pending = await asyncio.wait(jobs, timeout=120)
            assert not pending, f"{len(pending)} requests hung after the node was removed"
            return [job.result() for job in jobs]

        outcomes = asyncio.run(scenario())
        counts = check_greedy(outcomes, expected)
        assert sum(counts.values()) == len(prompts)
        assert counts["completed"] >= 1

        # A fresh node: Serve replaces the lost replica there and routing uses it again.
        cluster.add_node(num_cpus=1)
        deadline_s = time.monotonic() + 120
        while len(asyncio.run(client.stats_async())) != 2:
            assert time.monotonic() < deadline_s, serve.status()
            time.sleep(1.0)
        done = client.generate(prompts[0], params)
        assert done.token_ids == expected[0]
        asyncio.run(wait_idle(client, 2))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


# --- overload and leaks ----------------------------------------------------------------


def test_kv_exhaustion_preempts_or_queues_and_frees_everything(fault_app: FaultApp) -> None:
    client = fault_app.client
    prompts = random_prompts(20, 64, seed=1)
    expected = offline_greedy(fault_app.config, prompts, max_tokens=128)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)

    async def burst() -> tuple[list[Outcome], list]:
        before = await client.stats_async()
        outcomes = await asyncio.gather(*(run_request(client, p, params) for p in prompts))
        return list(outcomes), before

    outcomes, before = asyncio.run(burst())
    counts = check_greedy(outcomes, expected)
    assert counts["died"] == 0
    assert counts["completed"] + counts["overloaded"] == len(prompts)
    assert counts["completed"] >= len(prompts) // 2
    after = asyncio.run(wait_idle(client, 2))
    preempted = sum(s.num_preempted_total for s in after) - sum(
        s.num_preempted_total for s in before
    )
    # 20 x 12 blocks of demand against 2 x 48: the scheduler must have preempted.
    assert preempted > 0


def test_python_consumer_leaving_frees_blocks_at_once(fault_app: FaultApp) -> None:
    client = fault_app.client
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, 32, seed=2)[0]

    async def break_out() -> float:
        async for _ in client.stream(prompt, long):
            busy = await wait_busy(client)
            break  # no aclose(): the generator is finalized by the loop's hooks
        return busy

    async def cancel_task() -> float:
        started = asyncio.Event()
        task = asyncio.create_task(run_request(client, prompt, long, started))
        await started.wait()
        busy = await wait_busy(client)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return busy

    async def scenario() -> None:
        for leave in (break_out, cancel_task):
            assert await leave() > 0
            start_s = time.monotonic()
            await wait_idle(client, 2, timeout_s=5.0)
            # 400 tokens take far longer than this: the abort freed them.
            assert time.monotonic() - start_s < 5.0

    asyncio.run(scenario())


def test_http_sse_disconnect_frees_blocks_while_others_stream(fault_app: FaultApp) -> None:
    client = fault_app.client
    body = {
        "prompt": random_prompts(1, 32, seed=3)[0],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=fault_app.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert asyncio.run(wait_busy(client)) > 0
        # Leaving the block closed the connection mid-stream.
    asyncio.run(wait_idle(client, 2, timeout_s=5.0))


# --- a replica killed mid-run (last: the module's app loses a replica) -----------------


def test_replica_killed_mid_run_retries_or_types_every_request(fault_app: FaultApp) -> None:
    client = fault_app.client
    prompts = random_prompts(20, 32, seed=4)
    expected = offline_greedy(fault_app.config, prompts, max_tokens=160)
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    retries_before = client.num_retries

    async def scenario() -> tuple[list[Outcome], str]:
        started = asyncio.Event()
        # The first 8 are streaming when the replica dies; the rest wait in its queue
        # or are still being routed: they have streamed nothing and must be retried.
        first = [asyncio.create_task(run_request(client, p, params, started)) for p in prompts[:8]]
        await started.wait()
        rest = [asyncio.create_task(run_request(client, p, params)) for p in prompts[8:]]
        # The victim: a replica with requests mid-stream and others in its queue (the
        # router may hold the rest instead while KV is short: wait for a queue to form).
        deadline_s = time.monotonic() + 10.0
        while True:
            stats = await client.stats_async()
            busiest = max(stats, key=lambda s: (s.num_waiting > 0, s.num_running))
            if busiest.num_waiting and busiest.num_running or time.monotonic() > deadline_s:
                break
            await asyncio.sleep(0.02)
        victim = busiest.replica_id
        kill_replica(victim)
        jobs = first + rest
        done, pending = await asyncio.wait(jobs, timeout=120)
        assert not pending, f"{len(pending)} requests hung after the kill"
        return [job.result() for job in jobs], victim

    old_ids = live_replica_ids()
    outcomes, victim = asyncio.run(scenario())
    counts = check_greedy(outcomes, expected)
    assert counts["overloaded"] == 0
    assert counts["completed"] + counts["died"] == len(prompts)
    assert counts["died"] >= 1  # the victim had requests mid-stream
    assert all(victim in o.replica_ids for o in outcomes if o.error is not None)
    assert client.num_retries > retries_before  # the victim's queued requests moved

    # Serve replaces the replica; once its stats arrive the router sends it requests.
    deadline_s = time.monotonic() + 90
    while not (live_replica_ids() - old_ids) or len(client.stats()) != 2:
        assert time.monotonic() < deadline_s, "the killed replica was not replaced"
        time.sleep(0.5)
    (new_id,) = live_replica_ids() - old_ids
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def until_new_replica_serves() -> int:
        for n in range(1, 41):
            outs = await asyncio.gather(*(run_request(client, p, short) for p in prompts[:4]))
            assert all(o.error is None for o in outs)
            if any(new_id in o.replica_ids for o in outs):
                return n
        raise AssertionError(f"router never used the new replica {new_id}")

    asyncio.run(until_new_replica_serves())
    asyncio.run(wait_idle(client, 2))
