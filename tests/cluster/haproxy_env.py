"""The environment a local Ray needs to run Serve's HAProxy ingress in a test process.

`python -m cluster serve` sets HAProxy's variables before it starts Ray
(cluster.app.set_ray_env); a test module does the same, plus free ports for HAProxy's
stats and metrics (fixed by default, 8404 and 9101, so a second Ray with HAProxy on this
host would take them) and no draining period for ingress replicas (30 s by default, which
Serve's shutdown at the end of the module would wait out). Everything is put back after.
"""

from __future__ import annotations

import contextlib
import csv
import os
import socket
import time
from collections.abc import Iterator

from cluster import ClusterConfig
from cluster.app import (
    HAPROXY_CLIENT_TIMEOUT_ENV,
    HAPROXY_ENV,
    HAPROXY_RETRY_ON_ENV,
    THROUGHPUT_ENV,
    set_ray_env,
)
from tests.cluster.local_ray import free_port

DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


@contextlib.contextmanager
def haproxy_env(config: ClusterConfig) -> Iterator[None]:
    """While open, the process environment of a Ray started for config (HAProxy when
    config.http_proxy is "haproxy"), restored on exit."""
    test_env = {
        DRAINING_ENV: "1",
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }
    names = (HAPROXY_ENV, THROUGHPUT_ENV, HAPROXY_CLIENT_TIMEOUT_ENV, HAPROXY_RETRY_ON_ENV)
    names += tuple(test_env)
    saved = {k: os.environ.get(k) for k in names}
    set_ray_env(config)
    os.environ.update(test_env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ingress_server_stats(app_name: str) -> dict[str, tuple[int, str]]:
    """HAProxy's view of each of the app's ingress replicas, by the replica's id: the
    client sessions it holds now (its stats socket's scur, over every backend) and its
    status."""
    import ray
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH

    folder, name = os.path.split(RAY_SERVE_HAPROXY_SOCKET_PATH)
    path = os.path.join(folder, ray.get_runtime_context().get_node_id(), name)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(b"show stat\n")
        text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
    rows = list(csv.reader(text.lstrip("# ").splitlines()))
    column = {name: i for i, name in enumerate(rows[0])}
    prefix = f"SERVE_REPLICA_{app_name}-Ingress-"
    servers: dict[str, tuple[int, str]] = {}
    for row in rows[1:]:
        if len(row) > column["status"] and row[column["svname"]].startswith(prefix):
            replica_id = row[column["svname"]][len(prefix) :]
            num_sessions = servers.get(replica_id, (0, ""))[0] + int(row[column["scur"]] or 0)
            servers[replica_id] = (num_sessions, row[column["status"]])
    return servers


def wait_for_ingress_replicas_up(app_name: str, count: int, timeout_s: float = 60.0) -> None:
    """Until HAProxy balances over the app's `count` ingress replicas. serve.run returns,
    and Serve reports them RUNNING, before HAProxy has reloaded with the last one and its
    health checks (every 5 s, two to rise) let it take connections (~2 s on the CPU box);
    connections made before that all go to the first."""
    deadline_s = time.monotonic() + timeout_s
    while [status for _, status in ingress_server_stats(app_name).values()] != ["UP"] * count:
        assert time.monotonic() < deadline_s, ingress_server_stats(app_name)
        time.sleep(0.2)
