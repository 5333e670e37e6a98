"""Broadcasts to every replica (stats, serving counters, aborts) whose caller stops waiting:
the broadcast runs to its end, and asyncio logs no unretrieved error. No Ray: a handle
whose broadcast has the shape of Ray Serve 2.60's (the replicas' calls gathered under
asyncio.wait_for), the shape that left a CancelledError unretrieved on Python 3.11 when
a `./run.sh demo` stopped its stats poller mid-call."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from cluster.client import Client
from cluster.transport import CallerTransport, broadcast
from replica.stats import ReplicaStats

pytestmark = pytest.mark.timeout(60)


class _Broadcast:
    def __init__(self, handle: _Handle, method_name: str, args: tuple) -> None:
        self.handle, self.method_name, self.args = handle, method_name, args

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        async def one(replica: int) -> Any:
            await asyncio.sleep(self.handle.delay_s)
            self.handle.answered.append((replica, self.method_name, self.args))
            if self.method_name == "stats":
                return _stats(f"r{replica}").to_msgpack()
            return True

        calls = asyncio.gather(one(0), one(1), return_exceptions=return_exceptions)
        return list(await asyncio.wait_for(calls, timeout=timeout_s))  # TimeoutError past it


def _stats(replica_id: str) -> ReplicaStats:
    return ReplicaStats(
        replica_id=replica_id, num_blocks_total=8, num_blocks_free=8, num_blocks_cached=0,
        kv_usage=0.0, num_running=0, num_waiting=0, num_preempted_total=0, max_num_seqs=4,
        tokens_per_s=0.0,
    )  # fmt: skip


class _Handle:
    """The DeploymentHandle surface Client and CallerTransport touch here."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.answered: list[tuple[int, str, tuple]] = []

    def options(self, **kwargs: Any) -> None:
        return None  # no submits in these tests

    def broadcast(self, method_name: str, *args: Any) -> _Broadcast:
        return _Broadcast(self, method_name, args)


async def _cancel_soon(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)  # the replicas' calls are under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _unretrieved_errors(caplog: pytest.LogCaptureFixture, scenario: Any) -> list[str]:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()  # an unretrieved exception is logged when its future is collected
    return [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_stats_answer_from_every_replica():
    client = Client("x", handle=_Handle(delay_s=0.0))
    assert sorted(s.replica_id for s in asyncio.run(client.stats_async())) == ["r0", "r1"]


def test_a_stats_call_cancelled_mid_broadcast_logs_no_error(caplog):
    handle = _Handle(delay_s=0.05)
    client = Client("x", handle=handle)

    async def scenario() -> None:
        await _cancel_soon(client.stats_async())
        await asyncio.sleep(0.1)  # the broadcast ends by itself

    assert _unretrieved_errors(caplog, scenario) == []
    assert [r for r, *_ in handle.answered] == [0, 1]


def test_an_abort_whose_caller_stops_waiting_still_reaches_every_replica(caplog):
    handle = _Handle(delay_s=0.05)
    transport = CallerTransport(handle)

    async def scenario() -> None:
        await _cancel_soon(transport.abort("req-1"))
        await asyncio.sleep(0.1)

    assert _unretrieved_errors(caplog, scenario) == []
    assert sorted(handle.answered) == [(0, "abort", ("req-1",)), (1, "abort", ("req-1",))]


def test_a_broadcast_past_its_timeout_raises_to_its_caller():
    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await broadcast(_Handle(delay_s=1.0), "stats", timeout_s=0.05)

    asyncio.run(scenario())
