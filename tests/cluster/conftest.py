"""One local Ray + Serve app shared by a whole test module: Ray start is slow on 2 cores."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cluster import Client, ClusterConfig, build_app

APP_NAME = "kvfleet-test"


def cluster_config() -> ClusterConfig:
    return ClusterConfig(
        model="gpt2-tiny",
        num_replicas=2,
        router="kv",
        num_blocks=256,
        max_num_seqs=32,
        device="cpu",
        http=True,
        app_name=APP_NAME,
    )


@dataclass(frozen=True)
class RunningApp:
    config: ClusterConfig
    client: Client
    base_url: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(num_cpus: int) -> Iterator[str]:
    """A local Ray (num_cpus logical CPUs) with Serve's HTTP proxy on a free port.

    Yields the proxy's base URL; shuts Serve and Ray down on exit. Each replica
    takes one logical CPU (cluster.build_app), so num_cpus bounds the replicas.
    """
    import ray
    from ray import serve

    # "local": never attach to a cluster someone else started on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def serve_base_url() -> Iterator[str]:
    """A bare local Ray (8 logical CPUs) + Serve for a module to deploy its own apps on."""
    with local_serve(num_cpus=8) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def running_app() -> Iterator[RunningApp]:
    from ray import serve

    with local_serve(num_cpus=6) as base_url:
        config = cluster_config()
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        yield RunningApp(config, Client(APP_NAME), base_url)
