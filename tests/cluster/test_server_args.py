"""LLMServer's own arguments: bad values name the field; the GIL switch interval is set."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator

import pytest

from bench.cluster import FakeEngine
from cluster.config import ClusterConfig
from cluster.deployment import LLMServer

CONFIG = ClusterConfig(model="fake", device="cpu")


def build(**kwargs: object) -> LLMServer:
    return LLMServer(CONFIG, engine_factory=lambda *_: FakeEngine("r0"), replica_id="r0", **kwargs)


@pytest.fixture
def switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("field", "value"),
    [("heartbeat_s", 0.0), ("heartbeat_s", -1.0), ("gil_switch_interval_s", 0.0)],
)
def test_bad_values_name_the_field(field: str, value: float, switch_interval: float) -> None:
    with pytest.raises(ValueError, match=field):
        build(**{field: value})
    assert sys.getswitchinterval() == switch_interval  # nothing half-applied


def test_gil_switch_interval_is_set_for_the_process(switch_interval: float) -> None:
    server = build(gil_switch_interval_s=0.002)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        server.shutdown()
    unchanged = build(gil_switch_interval_s=None)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        unchanged.shutdown()


@pytest.mark.parametrize(("num_gpus", "on_engine_thread"), [(0.0, True), (0.5, False)])
def test_where_the_engine_factory_runs(num_gpus: float, on_engine_thread: bool) -> None:
    """A CPU replica builds its engine on the thread that steps it, so that its torch work
    stays on one thread; a GPU replica's is built on the caller's (engine_builder)."""
    called_on: list[threading.Thread] = []

    def factory(config: ClusterConfig, replica_id: str, num_gpus: float) -> FakeEngine:
        called_on.append(threading.current_thread())
        return FakeEngine(replica_id)

    in_thread = dataclasses.replace(CONFIG, engine_process=False)
    server = LLMServer(in_thread, num_gpus, factory, replica_id="r7", gil_switch_interval_s=None)
    try:
        (thread,) = called_on
        if on_engine_thread:
            assert thread.name == "kvfleet-engine"
        else:
            assert thread is threading.current_thread()
        assert server._engine_loop.engine.replica_id == "r7"
    finally:
        server.shutdown()


def test_an_engine_factory_that_raises_fails_the_replica_with_its_error() -> None:
    def factory(config: ClusterConfig, replica_id: str, num_gpus: float) -> FakeEngine:
        raise ValueError("model: no such preset 'nope'")

    with pytest.raises(ValueError, match="model: no such preset"):
        LLMServer(CONFIG, engine_factory=factory, replica_id="r0", gil_switch_interval_s=None)
