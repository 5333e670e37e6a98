"""bench.serve_handle's figures, over a fake handle (no Ray)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from bench.serve_handle import measure

REPLICA_S_PER_CALL = 0.002


class FakeHandle:
    """A Serve handle whose replica spends REPLICA_S_PER_CALL of CPU on each echo call."""

    def __init__(self) -> None:
        self.replica_cpu_s = 0.0
        self.calls: collections.Counter = collections.Counter()

    def options(self, method_name: str, stream: bool = False) -> FakeHandle._Method:
        return FakeHandle._Method(self, method_name, stream)

    class _Method:
        def __init__(self, handle: FakeHandle, name: str, stream: bool) -> None:
            self.handle, self.name, self.stream = handle, name, stream

        def remote(self, *args):
            handle = self.handle
            handle.calls[self.name] += 1
            if self.name == "cpu_s":
                return _value(handle.replica_cpu_s)
            handle.replica_cpu_s += REPLICA_S_PER_CALL
            return _items(args[0]) if self.stream else _value(args[0])


async def _value(value):
    await asyncio.sleep(0)
    return value


async def _items(value):
    await asyncio.sleep(0)
    yield value


def test_rows_give_latencies_and_each_sides_cpu_per_call() -> None:
    handle = FakeHandle()
    rows = asyncio.run(measure(handle, n=5, concurrency=3))
    assert [(r["call"], r["concurrency"]) for r in rows] == [
        ("unary", 1), ("stream first item", 1), ("stream", 1), ("unary", 3), ("stream", 3),
    ]  # fmt: skip
    for row in rows[:3]:
        assert 0 < row["p50_ms"] <= row["p90_ms"]
    for row in rows[3:]:
        assert row["calls_per_s"] > 0 and row["caller_cpu_ms_per_call"] > 0
        # the replica's CPU over the 10 x n calls, read before and after them
        assert row["replica_cpu_ms_per_call"] == pytest.approx(1e3 * REPLICA_S_PER_CALL)
    assert handle.calls["cpu_s"] == 4  # twice per concurrent figure
    assert handle.calls["unary"] == 20 + 5 + 50 and handle.calls["stream"] == 20 + 10 + 50
