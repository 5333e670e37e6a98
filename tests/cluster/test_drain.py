"""Graceful drain on a real local Ray: a replica removed while it streams (a scale-down by
the KV policy, a redeploy) takes no new requests, finishes every stream it carries, and
only then exits. The Client has no retries, so a cut or lost stream fails the test.

Why it holds: Serve stops routing to a replica it removes and waits for the replica's
calls to end (up to graceful_shutdown_timeout_s); a kvfleet carrier stream is such a
call and ends by itself once its caller's last request there has finished, so the wait
ends with the replica's own requests (cluster.transport).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import time
from collections.abc import Iterator

import pytest

from bench.cluster import paced_engine
from cluster import Client, ClusterConfig, build_app
from tests.cluster.local_ray import local_serve
from tests.cluster.test_autoscale import (
    Tally,
    one_request,
    replica_states,
    wait_for_replicas,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

APP_NAME = "kvfleet-drain"
STEP_S = 0.03  # 300 tokens: 9 s and more, past the 6-s downscale delay
MAX_TOKENS = 300
REDEPLOY_MAX_TOKENS = 100  # 3 s a request: waves of them while the new replica starts


def drain_config(**fields) -> ClusterConfig:
    base = dict(
        model="gpt2-tiny",
        device="cpu",
        num_blocks=256,  # 4 streams of 316 tokens hold 0.31 of a replica: under 0.5
        # Occupancy is blocks or slots, whichever is fuller: all eight streams on one replica
        # (0.62 of its blocks, 0.5 of its slots) stay under the band's middle (0.7), so the
        # policy removes one replica while they run.
        max_num_seqs=16,
        num_cpus_per_replica=0.5,
        # Serve's round robin spreads the eight streams over both replicas whatever their
        # first stats: the KV router puts a replica it has no snapshot of last, and on a
        # loaded 2-core host one replica's first snapshot came after all eight were placed.
        # The scale-down is the KV policy's either way (autoscale).
        router="serve-round-robin",
        app_name=APP_NAME,
        autoscale=True,
        num_replicas=2,
        min_replicas=1,
        max_replicas=2,
        upscale_delay_s=1.0,
        # The idle fleet's scale-down is pending from the deploy on: 6 s leaves the eight
        # streams time to reach both replicas on a loaded 2-core host (with 3 s, CI once
        # saw the removal decided before they were routed, all eight on one replica).
        downscale_delay_s=6.0,
        upscale_kv_usage=0.9,
        downscale_kv_usage=0.5,
        autoscale_look_back_s=1.0,
        # A gpt2-tiny replica on CPU starts in seconds, not a GPU's 30: with the default the
        # eight streams' arrival (0 -> 0.62 of a replica in a second) reads as a rise that
        # 31 s would carry past the watermark, and the fleet rightly keeps both replicas.
        replica_start_s=2.0,
        graceful_shutdown_timeout_s=60.0,
    )
    return ClusterConfig(**{**base, **fields})


def deploy(config: ClusterConfig) -> None:
    from ray import serve

    factory = functools.partial(paced_engine, min_step_s=STEP_S)
    serve.run(build_app(config, engine_factory=factory), name=APP_NAME, route_prefix=None)


def running_replica_ids(client: Client) -> set[str]:
    return {s.replica_id for s in client.stats()}


@pytest.fixture(scope="module")
def drain_client() -> Iterator[Client]:
    with local_serve(num_cpus=4):
        yield Client(APP_NAME, max_retries=0)


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(16)] for _ in range(num)]


def test_scale_down_drains_the_removed_replica(drain_client: Client) -> None:
    """Two replicas start idle, so the KV policy scales to one after 6 s: by then eight
    9-s streams run on both. The removed replica finishes its streams before it exits."""
    client = drain_client
    deploy(drain_config())
    tally = Tally()

    async def scenario() -> tuple[float, float]:
        streams = asyncio.gather(
            *(one_request(client, p, MAX_TOKENS, tally) for p in prompts(8, seed=1))
        )
        start_s = time.monotonic()
        while replica_states(APP_NAME).get("RUNNING", 0) != 1:  # one is chosen for removal
            assert time.monotonic() - start_s < 60.0, replica_states(APP_NAME)
            await asyncio.sleep(0.1)
        decided_s = time.monotonic() - start_s
        assert not streams.done()  # the removal was decided with the streams in flight
        gone_s = await wait_for_replicas(APP_NAME, 1, timeout_s=60.0)
        await streams
        return decided_s, decided_s + gone_s

    decided_s, gone_s = asyncio.run(scenario())
    print(
        f"\n2 -> 1 decided {decided_s:.1f} s into 8 streams, the removed replica gone at "
        f"{gone_s:.1f} s; {tally}"
    )
    assert tally.failures == [] and tally.completed == 8
    # Both replicas carried streams, and the one now gone was one of them.
    assert len(tally.replica_ids) == 2
    assert tally.replica_ids - running_replica_ids(client)


def test_redeploy_drains_the_old_replicas(drain_client: Client) -> None:
    """A new version replaces the replica while four users stream back to back: the
    streams under way on the old replica when Serve stops it finish there, and it exits
    after them; later requests go to the new one."""
    client = drain_client
    config = drain_config(num_replicas=1, min_replicas=1, max_replicas=1)
    deploy(config)
    (old_id,) = running_replica_ids(client)
    tally = Tally()

    async def scenario() -> int:
        stop = asyncio.Event()

        async def user(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = [rng.randrange(1, 500) for _ in range(16)]
                await one_request(client, prompt, REDEPLOY_MAX_TOKENS, tally)

        load = asyncio.gather(*(user(seed) for seed in range(4)))
        # Another seed is another version: Serve starts a new replica, then stops the old.
        redeploy = asyncio.create_task(
            asyncio.to_thread(deploy, dataclasses.replace(config, seed=1))
        )
        start_s = time.monotonic()
        while "STOPPING" not in replica_states(APP_NAME):
            assert time.monotonic() - start_s < 90.0, replica_states(APP_NAME)
            await asyncio.sleep(0.1)
        in_flight = tally.in_flight  # the old replica is draining these
        stop.set()
        await asyncio.gather(load, redeploy)
        await wait_for_replicas(APP_NAME, 1, timeout_s=60.0)
        return in_flight

    in_flight = asyncio.run(scenario())
    print(f"\nredeployed with {in_flight} streams in flight on the old replica; {tally}")
    assert in_flight > 0
    assert tally.failures == [] and tally.completed > 0
    new_ids = running_replica_ids(client)
    assert old_id in tally.replica_ids and old_id not in new_ids
    after = Tally()
    asyncio.run(one_request(client, prompts(1, seed=3)[0], 8, after))
    assert after.completed == 1 and after.replica_ids == new_ids
