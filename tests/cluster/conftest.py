"""One local Ray + Serve app shared by a whole test module: Ray start is slow on 2 cores."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def running_app() -> Iterator[RunningApp]:
    import ray
    from ray import serve

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = cluster_config()
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    try:
        yield RunningApp(config, Client(APP_NAME), f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
