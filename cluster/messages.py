"""Typed messages between the caller transport and the replicas (msgpack on the wire).

A submit carries a SubmitRequest; the replica answers with one SubmitAck (a group submit,
a list of SubmitRequest wires, with one GroupAck holding every request's), then, on an
elected carrier stream, CarrierBatch messages (one or more engine steps' StepBatch
columns: request ids, token counts, flat token ids) and Heartbeats. See
cluster/transport.py for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from replica.outputs import Logprobs
from replica.sampling_params import MAX_N
from router.errors import OverloadedError

_ACK = 0
_BATCH = 1
_BEAT = 2
_GROUP_ACK = 3

# SubmitAck.error_kind values.
INVALID = "invalid"  # bad input: ValueError naming the field
UNAVAILABLE = "unavailable"  # the replica cannot serve (engine failed, shutting down)
ABORTED = "aborted"  # the caller aborted the request before it was admitted

# The most requests one group submit may carry (the caller's cap is
# CallerTransport.max_group_size): bounds one ack and one admission pass.
MAX_GROUP_SIZE = 256

ERROR_FINISH = "error"  # TokenDelta.finish_reason when the replica's engine failed


class GroupRefusedError(OverloadedError):
    """The router could not place a submit group as a whole now: its requests go again
    one by one, each admitted (or held, or rejected) on its own.

    A group's need is its requests' sum, which may fit no replica where each request
    alone would (a burst of 20 on two replicas of 48 blocks: tests/cluster/test_faults.py);
    holding or rejecting the group would change what admission does to its requests.
    """

    def __init__(self, reason: str = "the group does not fit any replica now") -> None:
        super().__init__(0.0, reason)


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
            # n samples share the prompt's blocks and take max_tokens each.
            "max_tokens": _max_tokens(self.params),
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


def _max_tokens(params: dict[str, Any]) -> Any:
    max_tokens = params.get("max_tokens", 16)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        return max_tokens * num_samples(params)
    return max_tokens  # the router names a bad one


def num_samples(params: dict[str, Any]) -> int:
    """The samples a submit's params ask for (1 for a bad n, which the replica refuses)."""
    n = params.get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


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
class GroupAck:
    """The first message of a group submit: one ack per request of the group, in order.

    The carrier election is the group's (one stream); each request has its own outcome,
    as columns: errors[i] and error_kinds[i] (None when admitted), admitted_s[i] (None
    when refused). carrier_id is "" when no request was admitted and the stream does not
    carry.
    """

    replica_id: str
    carrier: bool
    carrier_id: str
    errors: list[str | None]
    error_kinds: list[str | None]
    admitted_s: list[float | None]

    def __len__(self) -> int:
        return len(self.errors)

    def ack(self, i: int) -> SubmitAck:
        """Request i's outcome as the SubmitAck a submit of it alone would have had."""
        carrier_id = self.carrier_id if self.errors[i] is None else ""
        return SubmitAck(
            self.replica_id,
            self.carrier,
            carrier_id,
            self.errors[i],
            self.error_kinds[i],
            self.admitted_s[i],
        )

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                _GROUP_ACK,
                self.replica_id,
                self.carrier,
                self.carrier_id,
                self.errors,
                self.error_kinds,
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
    # One per token of token_ids when the request asked for logprobs; the prompt's (entry
    # 0 None) on the delta that starts the output when it asked for prompt_logprobs.
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepBatch:
    """What one engine step produced for one caller on one replica, as columns.

    Request request_ids[i] got num_tokens[i] new tokens, the next ones of the flat
    token_ids; finishes lists (i, finish_reason) for the requests that ended; logprobs
    and prompt_logprobs list (i, wire rows) for the requests that asked for them
    (Logprobs.to_wire per token; None for the prompt's first token). Columns
    rather than one record per request: msgpack packs and unpacks flat lists of ints
    in C, and neither side builds a Python object per token. urgent (replica side, not
    sent): the batch holds a request's first token or its end, which the replica sends
    at once rather than within its carrier's step interval.
    """

    request_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finishes: list[tuple[int, str]] = field(default_factory=list)
    logprobs: list[tuple[int, list]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)
    urgent: bool = False

    def add(
        self,
        request_id: str,
        token_ids: list[int],
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[Logprobs] | None = None,
        prompt_logprobs: list[Logprobs | None] | None = None,
    ) -> None:
        """first: token_ids start the request's output."""
        if finish_reason is not None or first:
            self.urgent = True
        i = len(self.request_ids)
        if finish_reason is not None:
            self.finishes.append((i, finish_reason))
        if logprobs:
            self.logprobs.append((i, [lp.to_wire() for lp in logprobs]))
        if prompt_logprobs:
            wire = [None if lp is None else lp.to_wire() for lp in prompt_logprobs]
            self.prompt_logprobs.append((i, wire))
        self.request_ids.append(request_id)
        self.num_tokens.append(len(token_ids))
        self.token_ids += token_ids

    def to_row(self) -> list[Any]:
        row = [self.request_ids, self.num_tokens, self.token_ids, self.finishes]
        if self.logprobs or self.prompt_logprobs:  # most steps: four columns, no more
            row += [self.logprobs, self.prompt_logprobs]
        return row

    def logprobs_of(self) -> tuple[dict[int, list[Logprobs]], dict[int, list]]:
        """Row -> its tokens' Logprobs, and row -> its prompt's (None for the first)."""
        rows = {i: [Logprobs.from_wire(w) for w in wire] for i, wire in self.logprobs}
        prompt = {
            i: [None if w is None else Logprobs.from_wire(w) for w in wire]
            for i, wire in self.prompt_logprobs
        }
        return rows, prompt

    def deltas(self) -> list[TokenDelta]:
        """One TokenDelta per request (for tests and tools; the caller's demux uses columns)."""
        reasons = dict(self.finishes)
        logprobs, prompt_logprobs = self.logprobs_of()
        out, offset = [], 0
        for i, (rid, n) in enumerate(zip(self.request_ids, self.num_tokens, strict=True)):
            tokens = self.token_ids[offset : offset + n]
            out.append(
                TokenDelta(rid, tokens, reasons.get(i), logprobs.get(i), prompt_logprobs.get(i))
            )
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


def decode_message(data: bytes) -> SubmitAck | GroupAck | CarrierBatch | Heartbeat:
    raw = msgpack.unpackb(data)
    if raw[0] == _ACK:
        return SubmitAck(*raw[1:7])
    if raw[0] == _GROUP_ACK:
        return GroupAck(*raw[1:7])
    if raw[0] == _BATCH:
        return CarrierBatch(raw[1], [StepBatch(*row) for row in raw[2]], raw[3])
    if raw[0] == _BEAT:
        return Heartbeat(raw[1])
    raise ValueError(f"unknown transport message kind {raw[0]!r}")
