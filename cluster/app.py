"""build_app: a ClusterConfig to a Ray Serve Application; `app_builder` for Serve YAML."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.client import LLM_DEPLOYMENT
from cluster.config import ClusterConfig
from cluster.deployment import LLMServer
from cluster.engine_loop import EngineFactory
from cluster.request_router import request_router_config, serve_request_router_config

# Serve runs an LLMServer replica's methods on the replica's main event loop instead of
# a loop thread of its own: one thread hop less per call and per streamed message, and
# one thread less taking the GIL from the engine thread. LLMServer never blocks its
# loop (the engine has its own thread). One H200, one gpt2 replica, 8 callers: 37.4K
# -> 47.1K tokens/s.
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster; 0 when Ray is not initialized (build-only)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def routing_config(config: ClusterConfig) -> RequestRouterConfig:
    """The Serve RequestRouterConfig for config.router: kvfleet's adapter or Serve's own."""
    if config.is_serve_router:
        return serve_request_router_config(config.router, stats_period_s=config.stats_period_s)
    return request_router_config(config.router_config(), stats_period_s=config.stats_period_s)


def build_app(
    config: ClusterConfig,
    num_gpus_in_cluster: float | None = None,
    engine_factory: EngineFactory | None = None,
) -> Application:
    """The LLMServer deployment (config.router in front), behind the HTTP ingress if http.

    Replicas get `num_gpus` and `num_cpus` Ray resources as ClusterConfig.resolve_num_gpus
    and resolve_num_cpus decide, plus config.replica_resources. engine_factory
    (picklable; default: LLMEngine) builds each replica's engine: benchmarks and tests
    pass fake or paced engines.
    """
    gpus = cluster_gpus() if num_gpus_in_cluster is None else num_gpus_in_cluster
    num_gpus = config.resolve_num_gpus(gpus)
    actor_options: dict[str, Any] = {
        "num_gpus": num_gpus,
        "num_cpus": config.resolve_num_cpus(num_gpus),
        "runtime_env": {"env_vars": dict(REPLICA_ENV_VARS)},
    }
    if config.replica_resources:
        actor_options["resources"] = dict(config.replica_resources)
    logging_config = {"enable_access_log": config.access_log}
    llm = serve.deployment(
        LLMServer,
        name=LLM_DEPLOYMENT,
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options=actor_options,
        request_router_config=routing_config(config),
        logging_config=logging_config,
    ).bind(config, num_gpus, engine_factory)
    if not config.http:
        return llm
    from cluster.ingress import Ingress

    return Ingress.options(logging_config=logging_config).bind(
        llm,
        config.model,
        config.model_name,
        config.num_replicas,
        api_key=config.api_key,
        body_timeout_s=config.http_body_timeout_s,
    )


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config `import_path: cluster.app:app_builder`; args are ClusterConfig's flat
    names or engine: / routing: mappings (ClusterConfig.from_dict)."""
    return build_app(ClusterConfig.from_dict(dict(args)))
