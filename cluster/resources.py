"""Whether an app's replicas fit the Ray cluster, checked before it is deployed.

Serve never fails a deployment whose replicas cannot be placed: it waits for resources
that may never come, and /health and every request hang (8 replicas asking 1 GPU each on
a Ray without GPUs; two 1-CPU replicas beside an ingress that needed a CPU on a 2-CPU
host). `python -m cluster serve` calls check_fits first, so such a command fails at once
with a ValueError naming the resource and the flag that asks for it.

Algorithm: every LLM replica asks for the same bundle (CPU, GPU and replica_resources,
as build_app sets them); a node holds floor(its amount / the bundle's) of them for each
resource the bundle needs, the least of those; the replicas fit when the nodes hold
num_replicas in all. The ingress replicas ask for nothing (cluster.app.INGRESS_NUM_CPUS),
nor do Serve's controller and proxies. The check reads the cluster's total resources,
not what is free now, so a redeploy beside the app's older replicas passes; a cluster
that an autoscaler grows (KubeRay) is deployed from a Serve config, which is not checked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from cluster.config import ClusterConfig

# The flag that sets each resource a replica asks for (any other is a replica_resources key).
RESOURCE_FLAGS = {"CPU": "--num-cpus-per-replica", "GPU": "--num-gpus-per-replica"}
# Ray keeps fractional resources in units of 1e-4: a bundle of 0.1 GPU fits ten to a GPU.
_EPS = 1e-6


def replica_bundle(config: ClusterConfig, num_gpus: float) -> dict[str, float]:
    """The resources one LLM replica actor asks Ray for (as cluster.app.build_app sets
    them), zeros left out."""
    bundle = {"CPU": config.resolve_num_cpus(num_gpus), "GPU": num_gpus}
    bundle.update(config.replica_resources)
    return {name: amount for name, amount in bundle.items() if amount > 0}


def replicas_on(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many replicas asking for bundle one node holds (bundle non-empty)."""
    return min(math.floor(node.get(name, 0.0) / amount + _EPS) for name, amount in bundle.items())


def check_fits(config: ClusterConfig, nodes: Sequence[Mapping[str, float]]) -> None:
    """ValueError naming the resource and its flag when config's num_replicas LLM replicas
    cannot all be placed on nodes (each node's total resources, as ray.nodes() gives them)."""
    num_gpus = config.resolve_num_gpus(sum(node.get("GPU", 0.0) for node in nodes))
    bundle = replica_bundle(config, num_gpus)
    if not bundle:
        return
    num_fit = sum(replicas_on(node, bundle) for node in nodes)
    if num_fit >= config.num_replicas:
        return
    # The resource that holds the fewest replicas on its own is the one to name.
    short = min(bundle, key=lambda name: sum(replicas_on(n, {name: bundle[name]}) for n in nodes))
    total = sum(node.get(short, 0.0) for node in nodes)
    flag = RESOURCE_FLAGS.get(short, "--replica-resources")
    if short in RESOURCE_FLAGS:
        asked = f"{bundle[short]:g}"
    else:
        asked = f"'{json.dumps(config.replica_resources)}'"
    raise ValueError(
        f"{short}: --replicas {config.num_replicas} with {flag} {asked} needs "
        f"{config.num_replicas * bundle[short]:g} {short}, and the Ray cluster has {total:g} "
        f"over {len(nodes)} node(s): {num_fit} replica(s) fit. Lower --replicas or {flag}"
        + (", or add nodes" if total else f", or start Ray with {short} resources")
    )


def ray_node_resources() -> list[dict[str, float]]:
    """The total resources of each live node of the connected Ray cluster."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
