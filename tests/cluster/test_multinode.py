"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), one replica on each, serving.

Each node offers one "kvfleet_slot" custom resource and every replica needs one
(ClusterConfig.replica_resources), so the two replicas can only be placed one per node.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from cluster import Client, ClusterConfig, build_app
from replica import LLMEngine
from replica.sampling_params import SamplingParams
from tests.cluster.local_ray import start_local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

SLOT = "kvfleet_slot"
APP_NAME = "kvfleet-multinode"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_node_app() -> Iterator[tuple[ClusterConfig, Client]]:
    import ray
    from ray import serve

    head = {"num_cpus": 1, "resources": {SLOT: 1}, "include_dashboard": False}
    cluster, _ = start_local_cluster([head, {"num_cpus": 1, "resources": {SLOT: 1}}])
    try:
        config = ClusterConfig(
            model="gpt2-tiny",
            num_replicas=2,
            num_blocks=64,
            max_num_seqs=16,
            device="cpu",
            replica_resources={SLOT: 1},
            app_name=APP_NAME,
        )
        serve.start(proxy_location="Disabled")  # Client only: no HTTP port to collide on
        serve.run(build_app(config), name=APP_NAME, route_prefix=None)
        yield config, Client(APP_NAME)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()


def test_one_replica_per_node_both_serve(two_node_app: tuple[ClusterConfig, Client]) -> None:
    import ray

    config, client = two_node_app
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    assert all(n["Resources"].get(SLOT) == 1 for n in nodes)
    # Both slots are held, each by one replica: one replica on each node.
    assert ray.available_resources().get(SLOT, 0) == 0
    assert len(client.stats()) == 2

    # The client's Serve router starts with its first request and gets replica stats
    # from the controller some 0.2-0.3 s later; until then a replica without stats is
    # only a last resort (KVFleetRequestRouter), so the burst waits for them.
    client.generate([1, 2, 3], GREEDY)
    time.sleep(1.0)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(8 + i)] for i in range(12)]

    async def burst() -> list[list]:
        async def one(prompt: list[int]) -> list:
            return [chunk async for chunk in client.stream(prompt, GREEDY)]

        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(burst())
    served_by = Counter(chunks[-1].replica_id for chunks in results)
    assert len(served_by) == 2, served_by  # the KV router spreads the burst over both nodes

    engine = LLMEngine(config.engine_config("offline", num_gpus=0))
    expected = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert [[t for c in chunks for t in c.token_ids] for chunks in results] == expected
