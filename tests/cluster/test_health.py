"""/health on a real local Ray + Serve: 503 while the engine replicas start, 200 after.

The replicas' engine factory (FakeEngine) waits until the test creates a gate file, so
the app stays in its start-up for as long as the test wants: serve.run, which returns
only once every replica is up, runs in a thread meanwhile.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import httpx

from bench.cluster import FakeEngine, fake_engine
from cluster import ClusterConfig, build_app

APP_NAME = "kvfleet-health"
GATE_TIMEOUT_S = 120.0
# The ingress asks every replica for its stats within Client's stats_timeout_s (10 s):
# a /health that outlives this has hung.
HEALTH_TIMEOUT_S = 30.0


def gated_engine(config: ClusterConfig, replica_id: str, num_gpus: float, gate: str) -> FakeEngine:
    """engine_factory: a FakeEngine, built once the file `gate` exists."""
    deadline_s = time.monotonic() + GATE_TIMEOUT_S
    while not Path(gate).exists():
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.05)
    return fake_engine(config, replica_id, num_gpus)


def _wait_for_ingress(app_name: str, timeout_s: float = 180.0) -> None:
    """Until the app's Ingress replica runs. Before that Serve's proxy holds a request
    (an Ingress replica took 42 s to start on a loaded 2-core box), which is Serve's
    start-up, not /health's answer."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    deadline_s = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        ingress = app.deployments.get("Ingress") if app is not None else None
        if ingress is not None and ingress.status == DeploymentStatus.HEALTHY:
            return
        assert time.monotonic() < deadline_s, f"the Ingress never started: {ingress}"
        time.sleep(0.2)


def _is_ingress_error(response: httpx.Response) -> bool:
    try:
        return response.json()["error"]["type"] == "unavailable"
    except (ValueError, KeyError, TypeError):
        return False


def test_health_is_503_until_every_replica_is_ready(serve_base_url: str, tmp_path: Path) -> None:
    from ray import serve

    gate = tmp_path / "gate"
    config = ClusterConfig(
        model="gpt2-tiny", num_replicas=2, num_blocks=64, max_num_seqs=8, device="cpu",
        http=True, app_name=APP_NAME,
    )  # fmt: skip
    app = build_app(config, engine_factory=functools.partial(gated_engine, gate=str(gate)))
    deploy = threading.Thread(
        target=serve.run, args=(app,), kwargs={"name": APP_NAME, "route_prefix": "/"}
    )
    deploy.start()
    try:
        with httpx.Client(base_url=serve_base_url, timeout=HEALTH_TIMEOUT_S) as http:
            _wait_for_ingress(APP_NAME)
            starting = http.get("/health")
            assert starting.status_code == 503 and _is_ingress_error(starting), starting.text
            assert deploy.is_alive()  # the replicas are still starting: not ready
            again = http.get("/health")
            assert again.status_code == 503 and _is_ingress_error(again), again.text

            gate.touch()
            deploy.join(timeout=120.0)
            assert not deploy.is_alive(), "serve.run did not return once the engines built"
            ready = http.get("/health")
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"status": "ok"}
    finally:
        gate.touch()
        deploy.join(timeout=120.0)
        serve.delete(APP_NAME)
