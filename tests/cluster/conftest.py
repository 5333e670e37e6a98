"""One local Ray + Serve app shared by a whole test module: Ray start is slow on 2 cores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cluster import Client, ClusterConfig, build_app
from tests.cluster.local_ray import local_serve

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
