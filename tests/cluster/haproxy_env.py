"""The environment a local Ray needs to run Serve's HAProxy ingress in a test process.

`python -m cluster serve` sets HAProxy's variables before it starts Ray
(cluster.app.set_ray_env); a test module does the same, plus free ports for HAProxy's
stats and metrics (fixed by default, 8404 and 9101, so a second Ray with HAProxy on this
host would take them) and no draining period for ingress replicas (30 s by default, which
Serve's shutdown at the end of the module would wait out). Everything is put back after.
"""

from __future__ import annotations

import contextlib
import os
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
