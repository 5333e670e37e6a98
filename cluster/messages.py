"""Typed messages between the caller transport and the replicas (msgpack on the wire).

A submit carries a SubmitRequest; the replica answers with one SubmitAck, then, on an
elected carrier stream, CarrierBatch messages (one or more engine steps' StepBatch
columns: request ids, token counts, flat token ids) and Heartbeats. See
cluster/transport.py for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

_ACK = 0
_BATCH = 1
_BEAT = 2

# SubmitAck.error_kind values.
INVALID = "invalid"  # bad input: ValueError naming the field
UNAVAILABLE = "unavailable"  # the replica cannot serve (engine failed, shutting down)
ABORTED = "aborted"  # the caller aborted the request before it was admitted

ERROR_FINISH = "error"  # TokenDelta.finish_reason when the replica's engine failed


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
    def from_wire(cls, wire: Any) -> SubmitRequest:
        """Parse a submit payload; anything malformed raises ValueError naming the field."""
        if not isinstance(wire, dict):
            raise ValueError(f"request: must be a dict, got {type(wire).__name__}")
        for name in ("request_id", "caller_id"):
            if not isinstance(wire.get(name), str) or not wire[name]:
                raise ValueError(f"{name}: must be a non-empty string, got {wire.get(name)!r}")
        if not isinstance(wire.get("params"), dict):
            raise ValueError(f"params: must be a dict, got {type(wire.get('params')).__name__}")
        return cls(
            request_id=wire["request_id"],
            caller_id=wire["caller_id"],
            prompt_token_ids=wire.get("prompt_token_ids"),  # type: ignore[arg-type]
            params=wire["params"],
        )


@dataclass(frozen=True)
class SubmitAck:
    """The first (and, unless carrier, only) message of a submit stream."""

    replica_id: str
    carrier: bool  # this submit's stream is the carrier (else: attached to carrier_id)
    carrier_id: str = ""  # the carrier this request's tokens ride on ("" when rejected)
    error: str | None = None
    error_kind: str | None = None  # INVALID | UNAVAILABLE | ABORTED when error is set
    # When the engine admitted the request (the replica's time.time()): any load
    # snapshot of the replica stamped later counts it (router.ReservationBook).
    admitted_s: float | None = None

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                _ACK,
                self.replica_id,
                self.carrier,
                self.carrier_id,
                self.error,
                self.error_kind,
                self.admitted_s,
            ]
        )


@dataclass(frozen=True)
class Heartbeat:
    """Sent on an idle carrier every heartbeat period: the replica is alive."""

    replica_id: str

    def encode(self) -> bytes:
        return msgpack.packb([_BEAT, self.replica_id])


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request, as the caller takes them from its DeltaStream."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error" once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepBatch:
    """What one engine step produced for one caller on one replica, as columns.

    Request request_ids[i] got num_tokens[i] new tokens, the next ones of the flat
    token_ids; finishes lists (i, finish_reason) for the requests that ended. Columns
    rather than one record per request: msgpack packs and unpacks flat lists of ints
    in C, and neither side builds a Python object per token. urgent (replica side, not
    sent): the batch holds a request's first token or its end, which the replica sends
    at once rather than within its carrier's step interval.
    """

    request_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finishes: list[tuple[int, str]] = field(default_factory=list)
    urgent: bool = False

    def add(
        self, request_id: str, token_ids: list[int], finish_reason: str | None, first: bool = False
    ) -> None:
        """first: token_ids start the request's output."""
        if finish_reason is not None or first:
            self.urgent = True
        if finish_reason is not None:
            self.finishes.append((len(self.request_ids), finish_reason))
        self.request_ids.append(request_id)
        self.num_tokens.append(len(token_ids))
        self.token_ids += token_ids

    def to_row(self) -> list[Any]:
        return [self.request_ids, self.num_tokens, self.token_ids, self.finishes]

    def deltas(self) -> list[TokenDelta]:
        """One TokenDelta per request (for tests and tools; the caller's demux uses columns)."""
        reasons = dict(self.finishes)
        out, offset = [], 0
        for i, (rid, n) in enumerate(zip(self.request_ids, self.num_tokens, strict=True)):
            out.append(TokenDelta(rid, self.token_ids[offset : offset + n], reasons.get(i)))
            offset += n
        return out


@dataclass(frozen=True)
class CarrierBatch:
    """One carrier message: the step batches of one or more consecutive engine steps.

    The replica sends whatever steps are pending for the caller each time its carrier
    runs, so when a step comes faster than a message can be sent, steps share a message
    instead of queueing up one message each.
    """

    replica_id: str
    steps: list[StepBatch]
    # The replica's latest ReplicaStats.to_msgpack() without prefix hashes, for the
    # caller's routers (cluster.live_stats); None when the replica sends none.
    stats: bytes | None = None

    def encode(self) -> bytes:
        rows = [s.to_row() for s in self.steps]
        return msgpack.packb([_BATCH, self.replica_id, rows, self.stats])


def decode_message(data: bytes) -> SubmitAck | CarrierBatch | Heartbeat:
    raw = msgpack.unpackb(data)
    if raw[0] == _ACK:
        return SubmitAck(*raw[1:7])
    if raw[0] == _BATCH:
        return CarrierBatch(raw[1], [StepBatch(*row) for row in raw[2]], raw[3])
    if raw[0] == _BEAT:
        return Heartbeat(raw[1])
    raise ValueError(f"unknown transport message kind {raw[0]!r}")
