"""build_app: a ClusterConfig to a Ray Serve Application; `app_builder` for Serve YAML."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.client import LLM_DEPLOYMENT
from cluster.config import ClusterConfig
from cluster.deployment import LLMServer
from cluster.request_router import request_router_config


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster; 0 when Ray is not initialized (build-only)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def build_app(config: ClusterConfig, num_gpus_in_cluster: float | None = None) -> Application:
    """The LLMServer deployment (KV request router in front), behind the HTTP ingress if http.

    Replicas get `num_gpus` Ray resources as ClusterConfig.resolve_num_gpus decides.
    """
    gpus = cluster_gpus() if num_gpus_in_cluster is None else num_gpus_in_cluster
    num_gpus = config.resolve_num_gpus(gpus)
    llm = serve.deployment(
        LLMServer,
        name=LLM_DEPLOYMENT,
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": 0 if num_gpus else 1},
        request_router_config=request_router_config(
            config.router_config(), stats_period_s=config.stats_period_s
        ),
    ).bind(config, num_gpus)
    if not config.http:
        return llm
    from cluster.ingress import Ingress

    return Ingress.bind(llm, config.model)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config `import_path: cluster.app:app_builder`; args are ClusterConfig fields."""
    return build_app(ClusterConfig.from_dict(dict(args)))
