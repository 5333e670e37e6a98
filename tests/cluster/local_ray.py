"""Starting a local Ray for a test module, and a free port for Serve's HTTP proxy.

Every cluster test module starts and stops its own Ray, one after another, on a
2-core CI machine. A start can fail there for reasons outside the code under test
(the previous module's Ray processes still exiting, a slow GCS, a node that "timed out
during startup"): init_local_ray and start_local_cluster retry a failed start after
a clean shutdown instead of failing the module, and print why each failed start
failed so that a real regression stays visible.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

START_ATTEMPTS = 3
RETRY_PAUSE_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_with_retries(what: str, start: Callable[[], T], clean_up: Callable[[], None]) -> T:
    """start(); after a failure, clean_up() and try again, up to START_ATTEMPTS tries."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start()
        except Exception as e:
            print(f"{what} attempt {attempt} failed: {e!r}", file=sys.stderr)
            clean_up()
            if attempt == START_ATTEMPTS:
                raise
            time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def init_local_ray(num_cpus: int) -> None:
    """ray.init a new local cluster of num_cpus logical CPUs; up to START_ATTEMPTS tries."""
    import ray

    # "local": never attach to a cluster someone else started on this machine.
    _start_with_retries(
        "ray.init",
        lambda: ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False
        ),
        ray.shutdown,
    )


def start_local_cluster(nodes: list[dict]):
    """A ray.cluster_utils.Cluster of these nodes (add_node's arguments; the first is the
    head), connected with ray.init; up to START_ATTEMPTS tries, as init_local_ray. Returns
    (cluster, the Node objects in order)."""
    import ray
    from ray.cluster_utils import Cluster

    clusters: list[Cluster] = []  # the attempt in progress

    def start():
        clusters.append(Cluster())
        added = [clusters[-1].add_node(**node) for node in nodes]
        ray.init(address=clusters[-1].address, log_to_driver=False)
        clusters[-1].wait_for_nodes()
        return clusters[-1], added

    def clean_up() -> None:
        ray.shutdown()
        clusters.pop().shutdown()

    return _start_with_retries("local cluster", start, clean_up)


@contextlib.contextmanager
def local_serve(num_cpus: int) -> Iterator[str]:
    """A local Ray (num_cpus logical CPUs) with Serve's HTTP proxy on a free port.

    Yields the proxy's base URL; shuts Serve and Ray down on exit. Each replica
    takes one logical CPU (cluster.build_app), so num_cpus bounds the replicas.
    """
    import ray
    from ray import serve

    init_local_ray(num_cpus)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
