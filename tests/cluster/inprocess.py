"""LLMServer and CallerTransport in one process and one event loop, without Ray.

InProcessHandle stands in for a DeploymentHandle on one replica with what the
transport relies on from Serve: a streaming call's generator is driven by the replica
whether or not the caller reads it (so a caller that stops awaiting an item does not
cancel the call, and dropping the response does not either), `cancel()` cancels the
replica's generator at its current await, and `broadcast(...)` reaches the replica.
Everything runs on the caller's loop, so a test can hold that loop (a blocking wait)
to order what the engine thread hands over against what the coroutines do next.

GatedEngine wraps FakeEngine so that a test can hold an add inside the engine thread
and learn when a step's outputs have been handed to the replica's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from bench.cluster import FakeEngine
from cluster.config import ClusterConfig
from cluster.deployment import LLMServer
from replica.outputs import StepOutputs
from replica.sampling_params import SamplingParams


class GatedEngine:
    """FakeEngine whose add_request waits for `release_add` once `gate_adds` is set.

    `add_entered` is set when an add is waiting at the gate; `fanned_out` once a step
    that produced outputs has been fanned out; `idle` once it has stepped and then has
    nothing left (every step's batches delivered). The engine loop asks has_unfinished
    once between a step and its delivery (whether it is still decoding) and again only
    after the delivery, so a step's batches are out at the second ask after it.
    """

    def __init__(self, replica_id: str, step_s: float = 0.0) -> None:
        self.engine = FakeEngine(replica_id, step_s)
        self.gate_adds = threading.Event()
        self.add_entered = threading.Event()
        self.release_add = threading.Event()
        self.fanned_out = threading.Event()
        self.idle = threading.Event()
        self._stepped = False
        self._asks_since_step = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if self.gate_adds.is_set():
            self.add_entered.set()
            assert self.release_add.wait(30), "the test never released the add"
        self.engine.add_request(request_id, prompt_token_ids, params)

    def step(self) -> StepOutputs:
        outputs = self.engine.step()
        self._stepped = bool(outputs)
        self._asks_since_step = 0
        return outputs

    def has_unfinished(self) -> bool:
        unfinished = self.engine.has_unfinished()
        self._asks_since_step += 1
        if self._stepped and self._asks_since_step >= 2:  # the step's batches are out
            self.fanned_out.set()
            if not unfinished:
                self.idle.set()
        return unfinished


def local_server(
    engine: Any, replica_id: str = "r0", heartbeat_s: float = 1.0, **overrides: Any
) -> LLMServer:
    """An LLMServer around engine; overrides: ClusterConfig fields."""
    fields = {"model": "fake", "device": "cpu", "stats_period_s": 0.05, **overrides}
    config = ClusterConfig(**fields)
    return LLMServer(
        config,
        engine_factory=lambda *_: engine,
        heartbeat_s=heartbeat_s,
        replica_id=replica_id,
        gil_switch_interval_s=None,  # a process-wide setting: not the test runner's
    )


@contextlib.contextmanager
def in_process(engine: Any, **overrides: Any) -> Iterator[InProcessHandle]:
    """A handle on local_server(engine, **overrides), shut down on exit."""
    server = local_server(engine, **overrides)
    try:
        yield InProcessHandle(server)
    finally:
        server.shutdown()


class InProcessResponse:
    """A streaming call's response: the replica's generator runs in its own task."""

    _END = object()

    def __init__(self, items: AsyncIterator[bytes]) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        self.items: list[bytes] = []  # messages the replica sent on this stream
        self._task = asyncio.get_running_loop().create_task(self._drive(items))

    async def _drive(self, items: AsyncIterator[bytes]) -> None:
        try:
            async for item in items:
                self.items.append(item)
                self._items.put_nowait(item)
        except asyncio.CancelledError:
            self._items.put_nowait(asyncio.CancelledError("request cancelled"))
            raise
        except Exception as exc:
            self._items.put_nowait(exc)
        else:
            self._items.put_nowait(self._END)

    def __aiter__(self) -> InProcessResponse:
        return self

    async def __anext__(self) -> bytes:
        item = await self._items.get()
        if item is self._END:
            self._items.put_nowait(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def num_items(self) -> int:
        return len(self.items)

    def cancel(self) -> None:
        self._task.cancel()


class _StreamingMethod:
    def __init__(self, server: LLMServer, method_name: str) -> None:
        self._method = getattr(server, method_name)
        self.responses: list[InProcessResponse] = []

    def remote(self, *args: Any) -> InProcessResponse:
        response = InProcessResponse(self._method(*args))
        self.responses.append(response)
        return response


class _Broadcast:
    def __init__(self, call: Any) -> None:
        self._call = call

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        try:
            return [await asyncio.wait_for(self._call, timeout_s)]
        except Exception as exc:
            if not return_exceptions:
                raise
            return [exc]


class InProcessHandle:
    """The subset of DeploymentHandle that CallerTransport uses, on one local server."""

    def __init__(self, server: LLMServer) -> None:
        self.server = server
        self.streams: dict[str, _StreamingMethod] = {}

    def options(
        self, method_name: str, stream: bool, _by_reference: bool = True
    ) -> _StreamingMethod:
        # _by_reference (Ray actor call or Serve's gRPC path) has no meaning in-process.
        assert stream, "the transport only makes streaming calls through options()"
        if method_name not in self.streams:
            self.streams[method_name] = _StreamingMethod(self.server, method_name)
        return self.streams[method_name]

    def broadcast(self, method_name: str, *args: Any) -> _Broadcast:
        return _Broadcast(getattr(self.server, method_name)(*args))


async def wait_thread_event(event: threading.Event) -> None:
    """Yield to the loop until another thread sets event (the test's timeout bounds it)."""
    while not event.is_set():
        await asyncio.sleep(0.001)
