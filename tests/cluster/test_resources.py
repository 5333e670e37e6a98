"""Replicas that cannot fit the Ray cluster fail `python -m cluster serve` at once,
naming the resource and the flag, instead of an app that never becomes healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from cluster.__main__ import _parser, prepare_serve
from cluster.config import ClusterConfig
from cluster.resources import check_fits, replica_bundle
from tests.cluster.local_ray import init_local_ray

CPU_BOX = [{"CPU": 2.0, "memory": 4e9}]


def test_the_default_replicas_fit_a_2_cpu_host():
    check_fits(ClusterConfig(model="gpt2-tiny", num_replicas=2), CPU_BOX)
    check_fits(ClusterConfig(model="gpt2-tiny", num_replicas=2), [{"CPU": 1.0}, {"CPU": 1.0}])


@pytest.mark.parametrize(
    ("fields", "nodes", "named"),
    [
        ({"num_replicas": 8, "num_gpus_per_replica": 1}, CPU_BOX, "GPU: --replicas 8 with "
         "--num-gpus-per-replica 1 needs 8 GPU, and the Ray cluster has 0"),
        ({"num_replicas": 3}, CPU_BOX, "CPU: --replicas 3 with --num-cpus-per-replica 1 needs 3"),
        # Enough CPUs in all, but a replica's 1.5 fits each 2-CPU node once, the third never.
        ({"num_replicas": 3, "num_cpus_per_replica": 1.5}, [{"CPU": 2.0}] * 2 + [{"CPU": 0.5}],
         "CPU: --replicas 3 with --num-cpus-per-replica 1.5 needs 4.5 CPU, and the Ray "
         "cluster has 4.5 over 3 node(s): 2 replica(s) fit"),
        ({"num_replicas": 4, "num_gpus_per_replica": 0.5}, [{"CPU": 8.0, "GPU": 1.0}],
         "GPU: --replicas 4 with --num-gpus-per-replica 0.5 needs 2 GPU"),
        ({"num_replicas": 2, "replica_resources": {"slot": 1}}, [{"CPU": 8.0, "slot": 1.0}],
         "slot: --replicas 2 with --replica-resources '{\"slot\": 1}' needs 2 "
         "slot"),
    ],
)  # fmt: skip
def test_replicas_that_do_not_fit_name_the_resource_and_the_flag(fields, nodes, named):
    with pytest.raises(ValueError) as error:
        check_fits(ClusterConfig(model="gpt2-tiny", **fields), nodes)
    assert str(error.value).startswith(named), str(error.value)


def test_fractions_and_gpus_that_fit_pass():
    check_fits(ClusterConfig(num_replicas=10, num_gpus_per_replica=0.1), [{"GPU": 1.0}])
    check_fits(ClusterConfig(num_replicas=8), [{"CPU": 16.0, "GPU": 8.0}])  # 1 GPU, 0 CPU each
    assert replica_bundle(ClusterConfig(), 1.0) == {"GPU": 1.0}


# --- on a local Ray of 2 CPUs, as the CLI runs -------------------------------------------


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    import ray

    init_local_ray(num_cpus=2)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


SERVE = ["serve", "--model", "gpt2-tiny", "--http-proxy", "serve", "--device", "cpu"]


@pytest.mark.ray
def test_prepare_serve_checks_the_connected_ray(ray_address):
    config = prepare_serve(_parser().parse_args([*SERVE, "--replicas", "2"]))
    assert config.num_replicas == 2
    with pytest.raises(ValueError, match="CPU: --replicas 3 with --num-cpus-per-replica 1"):
        prepare_serve(_parser().parse_args([*SERVE, "--replicas", "3"]))


@pytest.mark.ray
def test_the_cli_fails_fast_on_gpus_the_cluster_lacks(ray_address):
    args = [*SERVE[:-2], "--replicas", "8", "--num-gpus-per-replica", "1"]
    start_s = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "cluster", *args],
        env=os.environ | {"RAY_ADDRESS": ray_address},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "GPU: --replicas 8 with --num-gpus-per-replica 1 needs 8 GPU" in out.stderr
    assert "Traceback" not in out.stderr
    print(f"failed in {time.monotonic() - start_s:.1f} s")
