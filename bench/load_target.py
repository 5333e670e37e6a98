"""The load test's target: a local Ray + Serve app it starts itself, or a running app.

Also the two things the parent does against the target while generators run: sampling
every replica's ReplicaStats (KV usage over time) and, after the run, the leak check.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict
from typing import Any

from replica.stats import ReplicaStats

LEAK_CHECK_TIMEOUT_S = 10.0
HTTP_READY_TIMEOUT_S = 60.0
FRESH_WAIT_S = 2.0  # leak_check: how long a drained fleet may wait for fresh snapshots


def start_local_ray(num_cpus: int, config: Any = None) -> str:
    """Start a small local Ray; returns the GCS address generator processes connect to.

    config (a ClusterConfig, or None for none over HTTP): the app the Ray is for; with
    http and http_proxy "haproxy" its Serve runs the HAProxy ingress (cluster.app.set_ray_env).
    """
    import ray

    if config is not None:
        from cluster.app import set_ray_env

        set_ray_env(config)
    # "local": always a new cluster, never one another user started with `ray start`.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


def attach_ray(address: str) -> str:
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    return ray.get_runtime_context().gcs_address


def start_http(url: str) -> None:
    """Start Serve with its HTTP proxy on url's host and port (before the first deploy)."""
    from ray import serve

    parts = urllib.parse.urlsplit(url)
    serve.start(http_options={"host": parts.hostname, "port": parts.port or 80})


def deploy(config: Any, engine_factory: Any = None) -> None:
    """Run build_app(config) as app config.app_name: at route "/" with config.http (its
    HTTP ingress), else with no HTTP route (Python client only); engine_factory as
    build_app takes it (None: the model's LLMEngine)."""
    from ray import serve

    from cluster.app import build_app

    route_prefix = "/" if config.http else None
    app = build_app(config, engine_factory=engine_factory)
    serve.run(app, name=config.app_name, route_prefix=route_prefix)


def wait_http_ready(url: str, timeout_s: float = HTTP_READY_TIMEOUT_S) -> None:
    """Poll url's /health until it answers 200 (the ingress says 503 until every replica
    is ready, and Serve's proxy 404s until it has the app's route); RuntimeError after
    timeout_s, with the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5.0) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:  # HTTPError included: a 503, a 404
            last = repr(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not ready within {timeout_s:.0f} s: {last}")
        time.sleep(0.5)


def undeploy(app_name: str) -> None:
    from ray import serve

    serve.delete(app_name)


def shutdown() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def stats_rows(stats: list[ReplicaStats], t_s: float) -> list[dict]:
    """One sample row per replica: KV usage over time (the JSON's kv_samples)."""
    return [
        {
            "t_s": round(t_s, 4),
            "replica_id": s.replica_id,
            "kv_usage": s.kv_usage,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_blocks_free": s.num_blocks_free,
            "num_blocks_cached": s.num_blocks_cached,
        }
        for s in stats
    ]


def prefix_cache_hits(before: list[ReplicaStats], after: list[ReplicaStats]) -> dict:
    """The prefix-cache hit rate between two snapshots of every replica: cached tokens over
    the tokens of the sequences admitted in between, overall and per replica (None where
    nothing was admitted)."""
    first = {s.replica_id: s for s in before}
    by_replica, hits, queries = {}, 0, 0
    for s in after:
        b = first.get(s.replica_id)
        h = s.prefix_hit_tokens - (b.prefix_hit_tokens if b else 0)
        q = s.prefix_query_tokens - (b.prefix_query_tokens if b else 0)
        by_replica[s.replica_id] = round(h / q, 4) if q else None
        hits, queries = hits + h, queries + q
    return {
        "hit_rate": round(hits / queries, 4) if queries else None,
        "hit_tokens": hits,
        "query_tokens": queries,
        "by_replica": by_replica,
    }


def is_drained(s: ReplicaStats) -> bool:
    """Idle and every block back: free + cached == total, nothing running or waiting."""
    return (
        s.num_running == 0
        and s.num_waiting == 0
        and s.num_blocks_free + s.num_blocks_cached == s.num_blocks_total
    )


def leak_check(
    client: Any, not_before_s: float = 0.0, timeout_s: float = LEAK_CHECK_TIMEOUT_S
) -> tuple[dict, list[ReplicaStats]]:
    """Poll until every replica is drained, or report the ones that are not; the report
    and the snapshots it ended on.

    Waits because aborts and the last steps land asynchronously; a replica still
    holding blocks or sequences after timeout_s is a leak. A replica's snapshot is up
    to a stats period old, and one taken in a lull before the last requests reads
    drained too, without their counters: once drained, it also waits (at most
    FRESH_WAIT_S) for snapshots stamped at or after not_before_s (the round's end, on
    this host's clock; a replica whose clock is behind only costs that wait).
    """
    start = time.perf_counter()
    while True:
        stats = client.stats()
        ok = bool(stats) and all(is_drained(s) for s in stats)
        fresh = all(s.timestamp_s >= not_before_s for s in stats)
        waited_s = time.perf_counter() - start
        if (ok and (fresh or waited_s > FRESH_WAIT_S)) or waited_s > timeout_s:
            break
        time.sleep(0.05 if ok else 0.2)
    keys = ("num_running", "num_waiting", "num_blocks_free", "num_blocks_cached")
    report = {
        "ok": ok,
        "waited_s": round(waited_s, 2),
        "replicas": [
            {"replica_id": s.replica_id, "num_blocks_total": s.num_blocks_total}
            | {k: asdict(s)[k] for k in keys}
            | {"drained": is_drained(s)}
            for s in stats
        ],
    }
    return report, stats
