"""Step-batched output path between replicas and one caller process.

Shape chosen: **self-electing carrier streams**. Every request is submitted through the
Serve request router as a streaming call `submit(request)`, so the KV router sees the
prompt (first positional argument: a dict with "prompt_token_ids" and "max_tokens")
and picks the replica. The replica answers with one `SubmitAck`:

- if the caller (`caller_id`) has no live stream on that replica yet, this submit's
  stream *becomes* the carrier: it stays open and carries one `StepBatch` per engine
  step holding the new tokens of every request that caller has in flight there (and a
  `Heartbeat` every heartbeat period while no step has output for it), and it closes
  once that set is empty. A `CarrierBatch` message holds the step batches that were
  pending when the carrier ran: one step while the transport keeps up and the replica
  has few callers, several when steps come faster than messages go, or when the
  replica has more callers than ClusterConfig.carrier_messages_per_step (each carrier
  then sends every few steps, at most CARRIER_MAX_HOLD_S late; first tokens and
  finishes go out at once);
- otherwise the ack says "attached" and the submit stream ends at once; the request's
  tokens ride on the existing carrier.

Why this shape: Ray Serve 2.60's DeploymentHandle cannot address a given replica
(`choose_replica`/`dispatch` only dispatch to the router's own choice; `broadcast` is
unary), so a subscription opened *per replica* would need a router-side hint that the
policy code does not own. The carrier elects itself on whichever replica the router
picked, so no targeting is needed, routing stays the policy's, and the replica's output
path is at most one message per (caller, step) whatever the number of requests, as
DESIGN.md asks. Per request the cost is one short streaming call (ack + end). Aborts are rare and
go through `handle.broadcast("abort", request_id)`; only the owning replica acts on it.

Submit groups: a Serve call costs the replica's process ~1.4 ms of CPU whatever it
carries, so the submits one caller makes in one pass of its event loop go out as one
streaming call `submit_group([request, ...])` (up to max_group_size; a lone submit goes
out alone, as above). The router places the group as one request (its first prompt,
every prompt's blocks), or refuses it at once (GroupRefusedError) where it does not fit
as a whole, and its requests then go one by one, admitted each on its own; the replica
answers with one GroupAck holding each request's outcome, and the group's stream is
elected carrier, or attaches, as one submit's would.

Submits and the carriers they elect go over each replica's gRPC server (Serve's by-value
handle path) unless the transport is made with serve_grpc=False (Ray actor calls): the
same streams, with less time and CPU per call and per streamed item on both sides: on
an H200 host the TTFT Serve adds falls from 3.4-3.9 to 2.3-2.9 ms, and a replica's
process spends a third less CPU per request (docs/design.md, "Serve's gRPC path"). A
replica lost mid-stream surfaces the same way on either path (Serve maps gRPC's
UNAVAILABLE to ActorUnavailableError).

Cost per token, both sides: a step batch is columns (request ids, token counts, flat
token ids), one msgpack per message; the caller appends each request's tokens to its
DeltaStream and wakes its reader at most once per message, and a reader that falls
behind takes everything pending in one wake-up (one Chunk of several steps' tokens).

Failure handling, caller side. Invariant: every request submitted here ends with exactly
one last item on its DeltaStream: a finished TokenDelta, or a ReplicaError instance; or
submit raises. Nothing hangs:
- a bad request gets an ack carrying the error: submit raises ValueError naming the field;
- a submit whose replica died before acking raises ReplicaDiedError (nothing was
  streamed, so the caller may resubmit it: see Client.stream);
- a carrier that fails (actor died, stream broke) or stays silent for carrier_timeout_s
  (node lost: the heartbeat stops) fails every request it carried with ReplicaDiedError;
  a silent one is cancelled, which makes the replica abort that caller's requests there;
- a submit whose caller stops waiting (its task is cancelled) still has its ack read in
  the background: if the replica elected that stream as the carrier, other requests
  may ride on it, so it is read like any carrier;
- a request attached to a carrier that this caller never sees alive within
  carrier_timeout_s (its carrier's submit failed) fails the same way;
- after a carrier failure, or a "no live carrier", the transport takes a new caller_id,
  so a replica that is in fact alive elects a fresh carrier instead of attaching to the
  one given up on;
- an engine that fails on the replica ends its requests with finish_reason "error"
  (ReplicaError, not retried: the request may be what broke it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from cluster import live_stats
from cluster.errors import ReplicaDiedError, ReplicaError
from cluster.messages import (
    ABORTED,
    ERROR_FINISH,
    MAX_GROUP_SIZE,
    UNAVAILABLE,
    CarrierBatch,
    GroupAck,
    GroupRefusedError,
    Heartbeat,
    StepBatch,
    SubmitAck,
    SubmitRequest,
    TokenDelta,
    decode_message,
    num_samples,
)
from replica.outputs import Logprobs
from replica.sampling_params import sample_request_id

logger = logging.getLogger(__name__)

__all__ = [
    "CallerTransport",
    "Heartbeat",
    "ReplicaDiedError",
    "ReplicaError",
    "CarrierBatch",
    "DeltaStream",
    "StepBatch",
    "SubmitAck",
    "SubmitRequest",
    "TokenDelta",
    "decode_message",
]


class DeltaStream:
    """One request's output on the caller side: tokens in order, then its end.

    The carrier's demux appends to it (no wake-up unless a reader waits); take() (or
    get(), which waits) returns everything that arrived since the last one as one
    TokenDelta, so a reader that falls behind catches up in one wake-up instead of one
    per step. Invariant: the
    items a reader gets are its tokens in order, then either a finished TokenDelta or
    the ReplicaError it ends with (after any tokens received before the failure).
    Nothing is read after that last item.
    """

    __slots__ = (
        "request_id",
        "_token_ids",
        "_finish_reason",
        "_error",
        "_waiter",
        "_logprobs",
        "_prompt_logprobs",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._token_ids: list[int] = []
        self._finish_reason: str | None = None
        self._error: ReplicaError | None = None
        self._waiter: asyncio.Future | None = None
        # Only for requests that asked for them: pushed before the tokens they belong to.
        self._logprobs: list[Logprobs] | None = None
        self._prompt_logprobs: list[Logprobs | None] | None = None

    def push_logprobs(
        self, logprobs: list[Logprobs] | None, prompt_logprobs: list[Logprobs | None] | None
    ) -> None:
        if logprobs:
            self._logprobs = (self._logprobs or []) + logprobs
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs

    def push(self, token_ids: list[int]) -> None:
        self._token_ids += token_ids
        if self._waiter is not None:
            self._wake()

    def push_one(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        if self._waiter is not None:
            self._wake()

    def finish(self, finish_reason: str) -> None:
        self._finish_reason = finish_reason
        self._wake()

    def fail(self, error: ReplicaError) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> TokenDelta | ReplicaError | None:
        """Everything that arrived since the last take() as one delta, else the error it
        ended with, else None (nothing yet: await wait(), then take() again)."""
        if self._token_ids or self._finish_reason is not None:
            token_ids, self._token_ids = self._token_ids, []
            delta = TokenDelta(self.request_id, token_ids, self._finish_reason)
            if self._logprobs is not None or self._prompt_logprobs is not None:
                delta.logprobs, self._logprobs = self._logprobs, None
                delta.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
            return delta
        return self._error

    def wait(self) -> asyncio.Future:
        """A future that is done once take() has something; for the one reader."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    async def get(self) -> TokenDelta | ReplicaError:
        while (item := self.take()) is None:
            await self.wait()
        return item


def is_replica_gone(exc: BaseException) -> bool:
    """Whether a Ray/Serve call failed because its replica died or is unreachable."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    gone = (ActorDiedError, ActorUnavailableError, RayActorError)
    return isinstance(exc, gone) or isinstance(getattr(exc, "cause", None), gone)


class _Attempt(DeltaStream):
    """One submission of a request, from submit until its last item."""

    __slots__ = ("caller_id", "replica_id", "carrier_id", "acked_s")

    def __init__(self, request_id: str, caller_id: str) -> None:
        super().__init__(request_id)
        self.caller_id = caller_id  # the caller id it was submitted under
        self.replica_id = ""
        self.carrier_id: str | None = None  # set by the ack
        self.acked_s = 0.0


@dataclass
class _Pending:
    """A submit gathered for the next group call; future: its replica id once admitted,
    None when it goes alone, or the error its submit raises."""

    request: SubmitRequest
    samples: list[_Attempt]
    future: asyncio.Future


@dataclass
class _Link:
    """A live carrier stream being read."""

    replica_id: str
    caller_id: str
    gen: Any
    last_message_s: float
    task: asyncio.Task | None = None
    cut: bool = False  # cancelled by the watchdog (silent), not by the loop closing


# A burst of submits becomes one call per this many requests: 64 cuts a closed loop of
# 256 users' Serve calls per request to 1/64, while one group's admission (its
# requests' engine adds) stays a small part of one engine step.
DEFAULT_MAX_GROUP_SIZE = 64


class CallerTransport:
    """The caller side: submits requests and demultiplexes carrier streams.

    Bound to the event loop it is first used on. Each in-flight request has a
    DeltaStream that gives its tokens, then either a finished delta or a ReplicaError
    instance as its last item (see the module docstring).
    """

    MAX_GIVEN_UP = 1024

    def __init__(
        self,
        handle: Any,
        carrier_timeout_s: float = 10.0,
        abort_timeout_s: float = 5.0,
        serve_grpc: bool = True,
        max_group_size: int = DEFAULT_MAX_GROUP_SIZE,
    ) -> None:
        if carrier_timeout_s <= 0 or abort_timeout_s <= 0:
            raise ValueError("carrier_timeout_s and abort_timeout_s must be > 0")
        if not 1 <= max_group_size <= MAX_GROUP_SIZE:
            raise ValueError(
                f"max_group_size must be in [1, {MAX_GROUP_SIZE}], got {max_group_size!r}"
            )
        self._base_caller_id = uuid.uuid4().hex
        self._epoch = 0
        self.caller_id = f"{self._base_caller_id}.0"
        self.carrier_timeout_s = carrier_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self._handle = handle
        # serve_grpc: submits (and the carriers they elect) go over the replica's gRPC
        # server (Serve's by-value handle path) instead of Ray actor calls; see Client.
        self._submit = handle.options(
            method_name="submit", stream=True, _by_reference=not serve_grpc
        )
        self._submit_group_call = handle.options(
            method_name="submit_group", stream=True, _by_reference=not serve_grpc
        )
        # max_group_size: the most submits sent as one group call (1: each alone).
        self.max_group_size = max_group_size
        self._gathering: list[_Pending] = []  # submits of this loop pass, not yet sent
        self._attempts: dict[str, _Attempt] = {}
        self._links: dict[str, _Link] = {}  # by carrier id
        # Carrier ids given up on, newest last; only acks of submits sent before the
        # loss can name one, so the oldest are dropped beyond MAX_GIVEN_UP.
        self._given_up: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None

    @property
    def handle(self) -> Any:
        return self._handle

    @property
    def num_in_flight(self) -> int:
        return len(self._attempts)

    @property
    def num_carriers(self) -> int:
        return len(self._links)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]
    ) -> tuple[str, DeltaStream]:
        """Route one request; returns (replica_id, the stream of its deltas).

        Raises ValueError (naming the field) when the replica rejects the request,
        whatever the router raises (e.g. OverloadedError) when it is not admitted,
        ReplicaDiedError when the replica died or cannot serve before acknowledging
        (nothing was generated: safe to resubmit under a new request id), and
        ReplicaError for any other failure of the call.
        """
        replica_id, streams = await self.submit_samples(request_id, prompt_token_ids, params)
        return replica_id, streams[0]

    async def submit_samples(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]
    ) -> tuple[str, list[DeltaStream]]:
        """submit for params["n"] samples of one prompt (one replica, one prefill): a
        stream per sample, in order (sample i's request id is
        replica.sampling_params.sample_request_id(request_id, i)).

        Submits made in one pass of the event loop go out as one group call (see
        _flush_group), up to max_group_size; a lone one goes out alone, one loop pass
        later than it was made."""
        n = num_samples(params)
        request = SubmitRequest(request_id, self.caller_id, prompt_token_ids, params)
        samples = [_Attempt(sample_request_id(request_id, i), request.caller_id) for i in range(n)]
        # Registered before sending: tokens may arrive on a live carrier before the ack.
        for sample in samples:
            self._attempts[sample.request_id] = sample
        self._ensure_watchdog()
        if self.max_group_size == 1:
            return await self._submit_alone(request, samples)
        pending = _Pending(request, samples, asyncio.get_running_loop().create_future())
        self._gathering.append(pending)
        if len(self._gathering) == 1:
            asyncio.get_running_loop().call_soon(self._flush_group)
        elif len(self._gathering) >= self.max_group_size:
            self._flush_group()
        try:
            replica_id = await pending.future
        except BaseException:  # refused, failed, or this caller stopped waiting
            for sample in samples:
                self._forget(sample.request_id)
            raise
        if replica_id is None:  # alone in its loop pass
            return await self._submit_alone(pending.request, samples)
        return replica_id, list(samples)

    def _flush_group(self) -> None:
        """Send what was gathered: alone if one request is left, else as one group call."""
        group = [p for p in self._gathering if not p.future.done()]  # done: cancelled
        self._gathering = []
        if not group:
            return
        # Under the caller id of now: a carrier lost since the submit changed it.
        caller_id = self.caller_id
        for pending in group:
            if pending.request.caller_id != caller_id:
                pending.request = replace(pending.request, caller_id=caller_id)
                for sample in pending.samples:
                    sample.caller_id = caller_id
        if len(group) == 1:
            group[0].future.set_result(None)
            return
        self._spawn(self._submit_group(group))

    async def _submit_group(self, group: list[_Pending]) -> None:
        """One group call for these requests; resolves each one's future with its own
        outcome: its replica id, or the error its submit raises; None for all (each goes
        alone) when the router could not place the group as a whole.

        Run by a task of the transport, not by the callers: a caller that stops waiting
        leaves the ack to be read all the same, since its stream may be the carrier."""
        caller_id = group[0].request.caller_id
        gen: Any = None
        try:
            gen = self._submit_group_call.remote([p.request.to_wire() for p in group])
            ack = decode_message(await gen.__anext__())
        except GroupRefusedError:  # each request goes again alone, admitted on its own
            for pending in group:
                if not pending.future.done():
                    pending.future.set_result(None)
            return
        except BaseException as exc:
            for pending in group:
                for sample in pending.samples:
                    self._forget(sample.request_id)
                if isinstance(exc, asyncio.CancelledError):
                    pending.future.cancel()
                else:
                    _settle(pending.future, _submit_error(exc, pending.request.request_id))
            if isinstance(exc, asyncio.CancelledError):
                if gen is not None:
                    with contextlib.suppress(Exception):
                        gen.cancel()  # the replica aborts what it admitted of the group
                raise
            return
        assert isinstance(ack, GroupAck), ack
        if ack.carrier:
            self._start_carrier(ack.carrier_id, ack.replica_id, caller_id, gen)
        else:
            self._spawn(_drain(gen))
        if len(ack) != len(group):  # a malformed group: its one error is every request's
            ack = GroupAck(
                ack.replica_id,
                ack.carrier,
                "",
                [ack.errors[0]] * len(group),
                [ack.error_kinds[0]] * len(group),
                [None] * len(group),
            )
        admitted_s = [s for s in ack.admitted_s if s is not None]
        if admitted_s:  # the router's reservation for the group is keyed by its first id
            first_id = group[0].request.request_id
            live_stats.note_admitted(first_id, ack.replica_id, max(admitted_s))
        for i, pending in enumerate(group):
            error = self._take_ack(pending.request.request_id, pending.samples, ack.ack(i))
            if pending.future.done():  # its caller stopped waiting: it forgot the samples
                continue
            if error is None:
                pending.future.set_result(ack.replica_id)
            elif isinstance(error, asyncio.CancelledError):
                pending.future.cancel(str(error))
            else:
                pending.future.set_exception(error)

    async def _submit_alone(
        self, request: SubmitRequest, samples: list[_Attempt]
    ) -> tuple[str, list[DeltaStream]]:
        """One request as its own submit call (its samples already registered)."""
        request_id = request.request_id
        gen: Any = None
        try:
            gen = self._submit.remote(request.to_wire())
            # The ack is read by a task of its own: if this caller stops waiting, the
            # replica may still have elected this stream as the carrier of requests that
            # attach to it, so the ack is still acted on (see _on_abandoned_ack).
            reading = asyncio.ensure_future(gen.__anext__())
            try:
                ack = decode_message(await asyncio.shield(reading))
            except asyncio.CancelledError:
                reading.add_done_callback(
                    functools.partial(self._on_abandoned_ack, gen, request.caller_id)
                )
                raise
        except BaseException as exc:
            for sample in samples:
                self._forget(sample.request_id)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _submit_error(exc, request_id) from exc
        assert isinstance(ack, SubmitAck), ack
        if ack.admitted_s is not None:
            live_stats.note_admitted(request_id, ack.replica_id, ack.admitted_s)
        if ack.carrier:
            self._start_carrier(ack.carrier_id, ack.replica_id, request.caller_id, gen)
        else:
            self._spawn(_drain(gen))
        error = self._take_ack(request_id, samples, ack)
        if error is not None:
            raise error
        return ack.replica_id, list(samples)

    def _take_ack(
        self, request_id: str, samples: list[_Attempt], ack: SubmitAck
    ) -> BaseException | None:
        """Act on one request's ack: None when admitted (its samples now wait on their
        carrier), else the error its submit raises (its samples forgotten)."""
        if ack.error is not None:
            for sample in samples:
                self._forget(sample.request_id)
            if ack.error_kind == UNAVAILABLE:
                return ReplicaDiedError(ack.error, request_id, ack.replica_id)
            if ack.error_kind == ABORTED:
                return asyncio.CancelledError(ack.error)
            return ValueError(ack.error)
        for sample in samples:
            rid = sample.request_id
            if rid in self._attempts:  # not already finished on the carrier
                sample.replica_id, sample.carrier_id = ack.replica_id, ack.carrier_id
                sample.acked_s = time.monotonic()
                if ack.carrier_id in self._given_up:
                    error = ReplicaDiedError("its carrier was lost", rid, ack.replica_id)
                    self._fail(rid, error)
        return None

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it runs (or will run); its stream gets no more items."""
        self._forget(request_id)
        try:
            await broadcast(self._handle, "abort", request_id, timeout_s=self.abort_timeout_s)
        except TimeoutError:
            # A replica that does not answer in time is gone or its carrier is cut: either
            # way the request's blocks are (or will be) freed on the replica side.
            logger.warning("abort of %s not acknowledged by every replica in time", request_id)

    def abort_soon(self, request_id: str) -> None:
        """abort() in the background (after a failure, where nobody needs to wait)."""
        self._spawn(self.abort(request_id))

    def _on_abandoned_ack(self, gen: Any, caller_id: str, reading: asyncio.Future) -> None:
        """The ack of a submit whose caller stopped waiting: serve the carrier it elected."""
        if reading.cancelled() or reading.exception() is not None:
            return  # no ack: the stream (and any carrier on it) is gone
        ack = decode_message(reading.result())
        if isinstance(ack, SubmitAck) and ack.carrier:
            self._start_carrier(ack.carrier_id, ack.replica_id, caller_id, gen)
        else:
            self._spawn(_drain(gen))

    # --- carriers --------------------------------------------------------------------

    def _start_carrier(self, carrier_id: str, replica_id: str, caller_id: str, gen: Any) -> None:
        link = _Link(replica_id, caller_id, gen, time.monotonic())
        self._links[carrier_id] = link
        link.task = self._spawn(self._read_carrier(carrier_id, link))

    async def _read_carrier(self, carrier_id: str, link: _Link) -> None:
        error: ReplicaError | None = None
        try:
            async for data in link.gen:
                link.last_message_s = time.monotonic()
                message = decode_message(data)
                if isinstance(message, CarrierBatch):
                    for step in message.steps:
                        self._dispatch(link.replica_id, step)
                    if message.stats is not None:
                        live_stats.note(link.replica_id, message.stats)
        except asyncio.CancelledError:  # by the watchdog, or the loop is closing
            with contextlib.suppress(Exception):
                link.gen.cancel()  # the replica then aborts this caller's requests there
            if not link.cut:
                raise
            error = ReplicaDiedError(
                f"carrier silent for more than {self.carrier_timeout_s}s",
                replica_id=link.replica_id,
            )
        except Exception as exc:  # the replica or its stream is gone
            error = ReplicaDiedError(f"carrier failed: {exc!r}", replica_id=link.replica_id)
        finally:
            self._links.pop(carrier_id, None)
        if error is not None:
            self._give_up(carrier_id, link, error)

    def _dispatch(self, replica_id: str, step: StepBatch) -> None:
        """Hand one step's tokens to their streams (unknown ids: aborted by this caller)."""
        attempts = self._attempts
        rids, counts, token_ids = step.request_ids, step.num_tokens, step.token_ids
        if step.logprobs or step.prompt_logprobs:  # before the tokens they belong to
            logprobs, prompt_logprobs = step.logprobs_of()
            for i in logprobs.keys() | prompt_logprobs.keys():
                attempt = attempts.get(rids[i])
                if attempt is not None:
                    attempt.push_logprobs(logprobs.get(i), prompt_logprobs.get(i))
        if len(token_ids) == len(rids) and 0 not in counts:  # one token each: decode steps
            for rid, token_id in zip(rids, token_ids, strict=True):
                attempt = attempts.get(rid)
                if attempt is not None:
                    attempt.push_one(token_id)
        else:
            offset = 0
            for rid, n in zip(rids, counts, strict=True):
                attempt = attempts.get(rid)
                if attempt is not None and n:
                    attempt.push(token_ids[offset : offset + n])
                offset += n
        for i, reason in step.finishes:
            rid = rids[i]
            attempt = attempts.get(rid)
            if attempt is None:
                continue
            if reason == ERROR_FINISH:
                self._fail(rid, ReplicaError("the replica's engine failed", rid, replica_id))
                continue
            attempt.finish(reason)
            self._forget(rid)

    def _give_up(self, carrier_id: str, link: _Link, error: ReplicaError) -> None:
        """Fail every request on a lost carrier; later submits use a fresh caller_id."""
        logger.warning("giving up on carrier %s of %s: %s", carrier_id, link.replica_id, error)
        self._lose_carrier(carrier_id, link.caller_id)
        for rid, attempt in list(self._attempts.items()):
            if attempt.carrier_id == carrier_id:
                self._fail(rid, error.with_progress(rid, (), 1))

    def _lose_carrier(self, carrier_id: str, caller_id: str) -> None:
        """Never attach to carrier_id again: a replica that is in fact alive may keep
        it registered for caller_id, so later submits go out under a fresh caller id."""
        self._given_up[carrier_id] = None
        while len(self._given_up) > self.MAX_GIVEN_UP:
            self._given_up.popitem(last=False)
        if caller_id == self.caller_id:
            self._epoch += 1
            self.caller_id = f"{self._base_caller_id}.{self._epoch}"

    def _fail(self, request_id: str, error: ReplicaError) -> None:
        attempt = self._attempts.get(request_id)
        if attempt is None:
            return
        attempt.fail(error)
        self._forget(request_id)
        self.abort_soon(request_id)  # in case its replica is in fact alive

    # --- watchdog --------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = self._spawn(self._watch())

    async def _watch(self) -> None:
        """While requests are in flight: cut silent carriers, fail requests with none."""
        period_s = min(1.0, self.carrier_timeout_s / 4)
        while self._attempts:
            await asyncio.sleep(period_s)
            deadline_s = time.monotonic() - self.carrier_timeout_s
            for link in list(self._links.values()):
                if link.last_message_s < deadline_s and link.task is not None:
                    link.cut = True
                    link.task.cancel()
            for rid, attempt in list(self._attempts.items()):
                carrier_id = attempt.carrier_id
                if carrier_id is None or carrier_id in self._links:
                    continue
                if attempt.acked_s < deadline_s:
                    self._lose_carrier(carrier_id, attempt.caller_id)
                    self._fail(rid, ReplicaDiedError("no live carrier", rid, attempt.replica_id))

    def _forget(self, request_id: str) -> None:
        self._attempts.pop(request_id, None)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def broadcast(handle: Any, method_name: str, *args: Any, timeout_s: float) -> list[Any]:
    """Every live replica's answer to handle.broadcast(method_name, *args), a replica's
    exception in place of its answer; TimeoutError past timeout_s.

    A caller that stops waiting (its task cancelled: a stats poller stopped, a stream
    closed while its abort is on its way) leaves the broadcast to end by itself, within
    timeout_s, rather than cancel it: an abort still reaches the replicas, and Serve,
    which gathers the replicas' calls under asyncio.wait_for, leaves a cancelled
    gather's CancelledError unretrieved on Python 3.11, which asyncio then logs as an
    error with a traceback."""
    response = handle.broadcast(method_name, *args)
    fetch = asyncio.ensure_future(
        response.results_async(timeout_s=timeout_s, return_exceptions=True)
    )
    fetch.add_done_callback(_retrieve)
    return await asyncio.shield(fetch)


def _retrieve(fetch: asyncio.Future) -> None:
    """Done callback of a fetch nobody may await any more: its outcome counts as read."""
    if not fetch.cancelled():
        fetch.exception()


def _submit_error(exc: BaseException, request_id: str) -> BaseException:
    """What a submit raises when its call failed before an ack: ValueError and
    ReplicaError as they are, ReplicaDiedError when the replica is gone, the router's
    OverloadedError as it is, else a ReplicaError."""
    if isinstance(exc, ValueError | ReplicaError):
        return exc
    if is_replica_gone(exc):
        error: BaseException = ReplicaDiedError(
            f"replica died before acknowledging: {exc!r}", request_id
        )
    elif type(exc).__name__ == "OverloadedError":  # router.OverloadedError, as sent
        return exc
    elif _is_backpressure(exc):
        return _overloaded(exc)
    else:
        error = ReplicaError(f"submit failed: {exc!r}", request_id)
    error.__cause__ = exc
    return error


def _is_backpressure(exc: BaseException) -> bool:
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


def _overloaded(exc: Any) -> BaseException:
    """Serve's BackPressureError (a caller's queue to the deployment is full:
    ClusterConfig.max_queued_requests) as the router's OverloadedError, the one type a
    caller handles for "not admitted, retry later"."""
    from router.errors import OverloadedError

    retry_after_s = exc.retry_after_s if exc.retry_after_s is not None else 1.0
    error = OverloadedError(retry_after_s, f"queue full: {exc}")
    error.__cause__ = exc
    return error


def _settle(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


async def _drain(gen: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in gen:
            pass
