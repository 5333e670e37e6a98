"""LLMServer's own arguments: bad values name the field; the GIL switch interval is set."""

from __future__ import annotations

import sys
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


def test_an_engine_factory_that_raises_fails_the_replica_with_its_error() -> None:
    def factory(config: ClusterConfig, replica_id: str, num_gpus: float) -> FakeEngine:
        raise ValueError("model: no such preset 'nope'")

    with pytest.raises(ValueError, match="model: no such preset"):
        LLMServer(CONFIG, engine_factory=factory, replica_id="r0", gil_switch_interval_s=None)
