"""Step-batched output path between replicas and one caller process.

Shape chosen: **self-electing carrier streams**. Every request is submitted through the
Serve request router as a streaming call `submit(request)`, so the KV router sees the
prompt (first positional argument: a dict with "prompt_token_ids" and "max_tokens")
and picks the replica. The replica answers with one `SubmitAck`:

- if the caller (`caller_id`, one per transport, i.e. per process and event loop) has no
  live stream on that replica yet, this submit's stream *becomes* the carrier: it stays
  open and carries one `StepBatch` per engine step holding the new tokens of every
  request that caller has in flight there, and it closes once that set is empty;
- otherwise the ack says "attached" and the submit stream ends at once; the request's
  tokens ride on the existing carrier.

Why this shape: Ray Serve 2.60's DeploymentHandle cannot address a given replica
(`choose_replica`/`dispatch` only dispatch to the router's own choice; `broadcast` is
unary), so a subscription opened *per replica* would need a router-side hint that the
policy code does not own. The carrier elects itself on whichever replica the router
picked, so no targeting is needed, routing stays the policy's, and the replica's output
path is one message per (caller, step) whatever the number of requests, as DESIGN.md
asks. Per request the cost is one short streaming call (ack + end). Aborts are rare and
go through `handle.broadcast("abort", request_id)`; only the owning replica acts on it.

Nothing is lost silently: a bad request gets an ack carrying the error (raised as
ValueError naming the field); a carrier that fails (replica died) fails every request
of this caller on that replica with ReplicaError; a carrier cancelled on the caller side
(process gone) makes the replica abort that caller's requests and free their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

_ACK = 0
_BATCH = 1


class ReplicaError(RuntimeError):
    """The replica serving a request failed (died, or its stream broke) mid-request."""


@dataclass(frozen=True)
class SubmitRequest:
    """One request as the router and the replica see it."""

    request_id: str
    caller_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict()

    def to_wire(self) -> dict[str, Any]:
        # The request router reads "prompt_token_ids" and "max_tokens" from this dict.
        return {
            "request_id": self.request_id,
            "caller_id": self.caller_id,
            "prompt_token_ids": self.prompt_token_ids,
            "max_tokens": self.params.get("max_tokens", 16),
            "params": self.params,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> SubmitRequest:
        return cls(
            request_id=str(wire["request_id"]),
            caller_id=str(wire["caller_id"]),
            prompt_token_ids=wire["prompt_token_ids"],
            params=wire["params"],
        )


@dataclass(frozen=True)
class SubmitAck:
    """The first (and, unless carrier, only) message of a submit stream."""

    replica_id: str
    carrier: bool
    error: str | None = None

    def encode(self) -> bytes:
        return msgpack.packb([_ACK, self.replica_id, self.carrier, self.error])


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request from one engine step."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length" | "stop" | "abort" once finished
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepBatch:
    """Everything one engine step produced for one caller on one replica."""

    replica_id: str
    deltas: list[TokenDelta] = field(default_factory=list)

    def encode(self) -> bytes:
        rows = [
            [d.request_id, d.token_ids, d.finish_reason, d.num_prompt_tokens] for d in self.deltas
        ]
        return msgpack.packb([_BATCH, self.replica_id, rows])


def decode_message(data: bytes) -> SubmitAck | StepBatch:
    raw = msgpack.unpackb(data)
    if raw[0] == _ACK:
        return SubmitAck(replica_id=raw[1], carrier=raw[2], error=raw[3])
    if raw[0] == _BATCH:
        return StepBatch(raw[1], [TokenDelta(r[0], r[1], r[2], r[3]) for r in raw[2]])
    raise ValueError(f"unknown transport message kind {raw[0]!r}")


class CallerTransport:
    """The caller side: submits requests and demultiplexes carrier streams.

    Bound to the event loop it is first used on. Each in-flight request has an
    asyncio.Queue receiving TokenDelta items, then either a finished delta or an
    exception instance (ReplicaError) as its last item.
    """

    def __init__(self, handle: Any) -> None:
        self.caller_id = uuid.uuid4().hex
        self._handle = handle
        self._submit = handle.options(method_name="submit", stream=True)
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def submit(self, request: SubmitRequest) -> tuple[str, asyncio.Queue]:
        """Route one request; returns (replica_id, queue of its deltas).

        Raises ValueError (naming the field) when the replica rejects the request,
        and whatever the router raises (e.g. OverloadedError) when it is not admitted.
        """
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        # Registered before sending: tokens may arrive on a live carrier before the ack.
        self._queues[rid] = queue
        try:
            gen = self._submit.remote(request.to_wire())
            ack = decode_message(await gen.__anext__())
        except BaseException:
            self._forget(rid)
            raise
        assert isinstance(ack, SubmitAck)
        if ack.carrier:
            self._spawn(self._read_carrier(gen, ack.replica_id))
        else:
            self._spawn(_drain(gen))
        if ack.error is not None:
            self._forget(rid)
            raise ValueError(ack.error)
        if rid in self._queues:  # not already finished on the carrier
            self._replica_of[rid] = ack.replica_id
        return ack.replica_id, queue

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it runs; its queue gets no more items."""
        self._forget(request_id)
        await self._handle.broadcast("abort", request_id).results_async(return_exceptions=True)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_carrier(self, gen: Any, replica_id: str) -> None:
        try:
            async for data in gen:
                batch = decode_message(data)
                assert isinstance(batch, StepBatch)
                for delta in batch.deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is None:
                        continue  # aborted by this caller
                    queue.put_nowait(delta)
                    if delta.finished:
                        self._forget(delta.request_id)
        except Exception as exc:  # the replica or its stream is gone
            error = ReplicaError(f"replica {replica_id} failed mid-request: {exc!r}")
            for rid, owner in list(self._replica_of.items()):
                if owner == replica_id:
                    self._queues[rid].put_nowait(error)
                    self._forget(rid)


async def _drain(gen: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in gen:
            pass
