"""build_app: a ClusterConfig to a Ray Serve Application; `app_builder` for Serve YAML."""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from cluster.autoscale import autoscaling_config
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
# An ingress replica waits on sockets and on the LLM replicas: it asks Ray for no CPU, so
# that it never keeps an app from starting beside replicas that take every CPU of a small
# host (the default 2 CPU replicas on 2 CPUs).
INGRESS_NUM_CPUS = 0.0
# Ray Serve reads these once, when each of its processes starts (ray.serve._private.
# constants), so they must be in the environment of the process that starts Ray, before
# it starts. THROUGHPUT_OPTIMIZED also takes Serve's per-request logging and routing off
# threads of their own; over HTTP on one H200 (256 SSE users, one gpt2 replica) HAProxy
# with it served 16,000 tokens/s against 12,600 through Serve's Python proxy.
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# HAProxy's `timeout client` (whole seconds; Serve's default 3600): how long a client may
# stay silent while it owes bytes of its request (or acks of a response). Behind HAProxy
# the ingress's 408 for a slow body reaches the client, but HAProxy keeps the client's
# connection open while the declared body is still due, so without this a client that
# declared 1,000 bytes and sent 10 held its connection for an hour. It does not run while
# a client waits for a response: under a 2 s client timeout a 9 s non-streamed completion
# and SSE events 3 s apart went through (CPU box, Ray 2.60).
HAPROXY_CLIENT_TIMEOUT_ENV = "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"
# When HAProxy retries a request on another ingress replica: Serve's default retries only
# a connection that failed (conn-failure); empty-response also retries one whose ingress
# replica died before it answered a byte (a non-streamed completion, a stream whose
# response had not begun), which otherwise reached its client as a 500 (tests/cluster/
# test_ingress_failover; with conn-failure alone, 2 of 4 such completions were 500s). Not
# every such request: HAProxy 2.8 keeps a request for a replay only under conditions of
# its own, and about half the test's runs had one answered with a 500 at once, which an
# openai client (max_retries 2) retries.
# HAProxy can replay only a request that fits its buffer (tune.bufsize, 16 KB); and the
# dead replica's copy may still run on the LLM replica, so a retried request can cost
# the engine twice.
HAPROXY_RETRY_ON_ENV = "RAY_SERVE_HAPROXY_RETRY_ON"
HAPROXY_RETRY_ON = "conn-failure empty-response"
# How often a replica being removed checks whether its calls (submits, and the carrier
# streams, which end once their caller's requests there have finished) are done; Serve's
# default of 2 s would hold every drained replica up to 2 s past its last token.
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.25


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster; 0 when Ray is not initialized (build-only)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def backpressure_config(config: ClusterConfig) -> BackpressureConfig:
    """Serve's answer to a request past a full queue: 503 with config's Retry-After (over
    HTTP; a handle raises BackPressureError carrying it, which the Client turns into
    OverloadedError)."""
    return BackpressureConfig(status_code=503, retry_after_s=config.backpressure_retry_after_s)


def routing_config(config: ClusterConfig) -> RequestRouterConfig:
    """The Serve RequestRouterConfig for config.router: kvfleet's adapter or Serve's own."""
    if config.is_serve_router:
        return serve_request_router_config(config.router, stats_period_s=config.stats_period_s)
    return request_router_config(config.router_config(), stats_period_s=config.stats_period_s)


def with_prefix_salt(config: ClusterConfig) -> ClusterConfig:
    """config with a random prefix_salt (128 bits) where it has none: drawn per app, so no
    one outside it can compute its block hashes from a guessed prompt. Its replicas and
    request routers get it in their configs, so they hash alike (replica.hashing)."""
    if config.prefix_salt:
        return config
    return dataclasses.replace(config, prefix_salt=secrets.token_hex(16))


def build_app(
    config: ClusterConfig,
    num_gpus_in_cluster: float | None = None,
    engine_factory: EngineFactory | None = None,
) -> Application:
    """The LLMServer deployment (config.router in front), behind the HTTP ingress if http.

    An empty prefix_salt (the default) becomes a random one for this app.

    Replicas get `num_gpus` and `num_cpus` Ray resources as ClusterConfig.resolve_num_gpus
    and resolve_num_cpus decide, plus config.replica_resources. engine_factory
    (picklable; default: LLMEngine) builds each replica's engine: benchmarks and tests
    pass fake or paced engines.
    """
    config = with_prefix_salt(config)
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
    replicas: dict[str, Any] = {"num_replicas": config.num_replicas}
    if config.autoscale:
        replicas = {
            "autoscaling_config": autoscaling_config(
                config.autoscale_config(), config.num_replicas, config.autoscale_look_back_s
            )
        }
    llm = serve.deployment(
        LLMServer,
        name=LLM_DEPLOYMENT,
        **replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        backpressure_config=backpressure_config(config),
        ray_actor_options=actor_options,
        request_router_config=routing_config(config),
        logging_config=logging_config,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    ).bind(config, num_gpus, engine_factory)
    if not config.http:
        return llm
    from cluster.ingress import Ingress

    return Ingress.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        max_queued_requests=config.ingress_max_queued_requests,
        backpressure_config=backpressure_config(config),
        ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
        logging_config=logging_config,
    ).bind(
        llm,
        config.model,
        config.model_name,
        # /health waits for this many: with autoscale, the fewest the app may scale to.
        config.min_replicas if config.autoscale else config.num_replicas,
        api_key=config.api_key,
        body_timeout_s=config.http_body_timeout_s,
        submit_group_size=config.submit_group_size,
        max_loop_lag_s=config.ingress_max_loop_lag_s,
    )


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config `import_path: cluster.app:app_builder`; args are ClusterConfig's flat
    names or engine: / routing: mappings (ClusterConfig.from_dict). Serve builds the app
    in a task on the Ray cluster, so Serve's constants here are the cluster's:
    check_http_proxy holds http_proxy against them."""
    from ray.serve._private import constants

    config = ClusterConfig.from_dict(dict(args))
    check_http_proxy(config, constants.RAY_SERVE_ENABLE_HA_PROXY)
    return build_app(config)


def use_haproxy(config: ClusterConfig) -> bool:
    """True when config's HTTP port is to be served by Serve's HAProxy."""
    return config.http and config.http_proxy == "haproxy"


def set_ray_env(config: ClusterConfig) -> None:
    """Before this process starts a local Ray for config: Serve's HAProxy ingress (and
    its throughput-optimized settings, unless the environment already sets them) when
    use_haproxy(config), HAProxy's client timeout from http_body_timeout_s
    (haproxy_client_timeout_s) and its retries on another ingress replica
    (HAPROXY_RETRY_ON), unless the environment sets them already. The processes Ray
    starts inherit this environment."""
    if use_haproxy(config):
        os.environ[HAPROXY_ENV] = "1"
        os.environ.setdefault(THROUGHPUT_ENV, "1")
        os.environ.setdefault(HAPROXY_CLIENT_TIMEOUT_ENV, str(haproxy_client_timeout_s(config)))
        os.environ.setdefault(HAPROXY_RETRY_ON_ENV, HAPROXY_RETRY_ON)


def haproxy_client_timeout_s(config: ClusterConfig) -> int:
    """HAProxy's client timeout for config: a second past http_body_timeout_s, so that a
    slow body's client reads the ingress's 408 (which names the body) before HAProxy
    closes its connection, this long after the 408 (a 2 s body timeout: the 408 at 2 s,
    the close at 5.0 s, measured on the CPU box)."""
    return math.ceil(config.http_body_timeout_s) + 1


def cluster_runs_haproxy() -> bool:
    """Whether the connected Ray cluster's Serve runs its HAProxy ingress: read by a task
    on the cluster, since this process's environment need not be the cluster's."""
    import ray

    @ray.remote(num_cpus=0)
    def serve_haproxy_enabled() -> bool:
        from ray.serve._private import constants

        return constants.RAY_SERVE_ENABLE_HA_PROXY

    return bool(ray.get(serve_haproxy_enabled.remote()))


def check_http_proxy(config: ClusterConfig, cluster_haproxy: bool) -> None:
    """ValueError naming http_proxy and the environment variable when config asks for
    HAProxy and the Ray cluster's Serve runs without it (cluster_haproxy: its
    RAY_SERVE_ENABLE_HA_PROXY), instead of serving HTTP through the slower proxy."""
    if use_haproxy(config) and not cluster_haproxy:
        raise ValueError(
            f"http_proxy is 'haproxy' but the Ray cluster runs Serve without it: start Ray "
            f"with {HAPROXY_ENV}=1 (and {THROUGHPUT_ENV}=1) in its environment, or set "
            "http_proxy to 'serve'"
        )
