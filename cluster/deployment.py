"""LLMServer: the Serve deployment that owns one LLMEngine.

The engine runs in one background thread (cluster.engine_loop.EngineLoop), or in a
child process with a thread of its own there (cluster.engine_process): the replica's
asyncio loop never touches the engine, it posts commands (add, abort) and receives,
once per engine step, one StepBatch per caller with requests on this replica, which
it encodes onto that caller's carrier stream (see cluster.transport). ReplicaStats
are cached by the engine thread, so `record_routing_stats` answers without waiting
for a step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.autoscale import ReplicaMeter
from cluster.config import ClusterConfig
from cluster.engine_loop import (
    GIL_SWITCH_INTERVAL_S,
    AbortedBeforeAdmissionError,
    EngineFactory,
    EngineLoop,
    EngineUnavailableError,
    engine_builder,
    engine_model_info,
)
from cluster.messages import (
    ABORTED,
    INVALID,
    MAX_GROUP_SIZE,
    UNAVAILABLE,
    CarrierBatch,
    GroupAck,
    Heartbeat,
    StepBatch,
    SubmitAck,
    SubmitRequest,
    num_samples,
)
from cluster.metrics import MetricsSnapshot, ReplicaMetrics
from cluster.request_router import encode_routing_stats
from replica.sampling_params import ParamsCache, SamplingParams, sample_request_id

if TYPE_CHECKING:
    from cluster.engine_process import EngineProcess

logger = logging.getLogger(__name__)

# The longest a step batch waits on the replica for its carrier's interval to pass.
CARRIER_MAX_HOLD_S = 0.02


@dataclass
class _Carrier:
    """This replica's live stream to one caller, and that caller's requests here."""

    carrier_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    in_flight: set[str] = field(default_factory=set)
    pending: list[StepBatch] = field(default_factory=list)  # not yet sent, in step order
    due: bool = False  # send pending now (its interval passed, or a batch is urgent)
    hold_until_s: float = 0.0  # loop time by which pending goes out regardless
    waiter: asyncio.Future | None = None  # set while the carrier waits for work

    def wake(self, beat: bool = False) -> None:
        """Resume a waiting carrier; beat: its wait timed out (heartbeat or hold)."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(beat)


# torch.Generator.manual_seed takes [-2**63, 2**64); the sampler builds int64 tensors.
_SEED_RANGE = (-(2**63), 2**64)
_INT64_MAX = 2**63 - 1


def _engine_params(data: dict) -> SamplingParams:
    params = SamplingParams.from_dict(data)
    check_engine_ranges(params)
    return params


def check_engine_ranges(params: SamplingParams) -> None:
    """Reject values SamplingParams accepts but the engine's step would raise on.

    Without this a seed of 2**64 or a top_k of 2**63 passes add_request and then
    fails every step of the replica (torch overflow), killing it for all callers.
    """
    if params.seed is not None and not _SEED_RANGE[0] <= params.seed < _SEED_RANGE[1]:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {params.seed!r}")
    if params.top_k > _INT64_MAX:
        raise ValueError(f"top_k must be at most 2**63 - 1, got {params.top_k!r}")
    if any(t > _INT64_MAX for t in params.stop_token_ids):
        raise ValueError("stop_token_ids: each must be at most 2**63 - 1")


def _add_outcome(outcome: Any) -> tuple[str | None, str | None, float | None]:
    """An add's outcome (when admitted, or the exception it raised) as _admit's triple."""
    if not isinstance(outcome, BaseException):
        return None, None, outcome
    if isinstance(outcome, ValueError | TypeError):
        return str(outcome), INVALID, None
    if isinstance(outcome, EngineUnavailableError):
        return str(outcome), UNAVAILABLE, None
    if isinstance(outcome, AbortedBeforeAdmissionError):
        return str(outcome), ABORTED, None
    raise outcome


class LLMServer:
    """One replica: an LLMEngine behind the carrier-stream transport.

    heartbeat_s: an idle carrier (requests in flight, no output for its caller) sends a
    Heartbeat this often, so callers can tell a slow replica from a lost one.
    replica_id: None inside Serve (the replica context's id); set when the server runs
    outside Serve, in one process with its callers (tests, profiling).
    gil_switch_interval_s: the replica process's GIL switch interval (None: leave it).
    The engine thread holds the GIL through the host work of its steps, and every
    thread that carries a step's output on (this server's loop, Serve's loop, Ray's
    callbacks) waits for it up to the switch interval per hand-off, 5 ms by default:
    with an engine holding the GIL 3 ms per step, 0.5 ms cut TTFT p50 at concurrency 1
    from 18-20 ms to 12-13 ms on a 2-core CPU box, at the same tokens/s.
    """

    def __init__(
        self,
        config: ClusterConfig,
        num_gpus: float = 0.0,
        engine_factory: EngineFactory | None = None,
        heartbeat_s: float = 1.0,
        replica_id: str | None = None,
        gil_switch_interval_s: float | None = GIL_SWITCH_INTERVAL_S,
    ) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s!r}")
        if gil_switch_interval_s is not None:
            if not gil_switch_interval_s > 0:
                raise ValueError(
                    f"gil_switch_interval_s must be > 0 or None, got {gil_switch_interval_s!r}"
                )
            sys.setswitchinterval(gil_switch_interval_s)
        if replica_id is None:
            from ray import serve

            replica_id = serve.get_replica_context().replica_id.unique_id
        self.replica_id = replica_id
        self._config = config
        self._heartbeat = Heartbeat(self.replica_id).encode()
        self._heartbeat_s = heartbeat_s
        self._carriers: dict[str, _Carrier] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: collections.deque[tuple[str, StepBatch]] = collections.deque()
        self._drain_scheduled = False
        # What the replica's process has done since it started (serving_counters).
        self._num_submits = 0  # requests submitted, alone or in groups
        self._num_submit_calls = 0  # Serve calls that submitted them
        self._num_messages = 0
        self._num_heartbeats = 0
        self._metrics = ReplicaMetrics()
        self._scale_meter = ReplicaMeter()
        self._params = ParamsCache(_engine_params)
        self._engine_loop: EngineLoop | EngineProcess
        in_child = config.engine_process if config.engine_process is not None else num_gpus > 0
        if in_child:
            from cluster.engine_process import EngineProcess

            self._engine_loop = EngineProcess(
                config,
                self.replica_id,
                num_gpus,
                engine_factory,
                self._deliver_threadsafe,
                self._metrics,
            )
            self._model_info = self._engine_loop.model_info
        else:
            self._engine_loop = EngineLoop(
                engine_builder(engine_factory, config, self.replica_id, num_gpus),
                self.replica_id,
                config.stats_period_s,
                self._deliver_threadsafe,
                self._metrics,
            )
            self._model_info = engine_model_info(config, self._engine_loop.engine)

    async def submit(self, wire: dict) -> AsyncIterator[bytes]:
        """Admit one request; this stream becomes the caller's carrier if it has none here.

        Election happens on arrival, so requests of the same caller that arrive while
        this one is being admitted attach to it. Invariant: a stream elected as carrier
        carries from its ack until the carrier has nothing left, whatever happened to its
        own request meanwhile (it may have failed, or already finished: its last delta
        is then queued on the carrier); a stream that ends before it could carry
        unregisters its carrier and aborts what rode on it (see _close_carrier).
        """
        self._loop = asyncio.get_running_loop()
        self._num_submits += 1
        self._num_submit_calls += 1
        try:
            request = SubmitRequest.from_wire(wire)
        except ValueError as exc:
            yield SubmitAck(self.replica_id, False, "", str(exc), INVALID).encode()
            return
        caller_id, rid = request.caller_id, request.request_id
        carrier, is_carrier = self._elect(caller_id)
        # n > 1: the engine runs n samples, each under its own id, all carried here.
        rids = [sample_request_id(rid, i) for i in range(num_samples(request.params))]
        carrier.in_flight.update(rids)
        try:
            ((error, error_kind, admitted_s),) = await self._admit(caller_id, [request])
        except BaseException:  # cancelled by the caller, or an engine bug: never leak blocks
            self._abandon(caller_id, carrier, is_carrier, rids)
            raise
        if error is not None:
            for sample_id in rids:
                self._drop(caller_id, carrier, sample_id)
        carrier_id = carrier.carrier_id if error is None or is_carrier else ""
        ack = SubmitAck(
            self.replica_id, is_carrier, carrier_id, error, error_kind, admitted_s
        ).encode()
        # aclosing: a caller that goes away closes the carrier now, not when collected.
        async with contextlib.aclosing(
            self._ack_and_carry(ack, is_carrier, caller_id, carrier)
        ) as messages:
            async for message in messages:
                yield message

    async def submit_group(self, wires: list) -> AsyncIterator[bytes]:
        """Admit a group of one caller's requests (a list of SubmitRequest wires) in one
        call; one GroupAck answers for each, then this stream carries if elected.

        One Serve call costs the replica's process ~1.4 ms of CPU whatever it carries
        (docs/design.md, "Submit groups"), so a caller's burst comes as one call. Each
        request is admitted or refused on its own, as by submit: a bad one fails alone.
        Election and carrying are submit's, for the group's caller. Invariant as submit's:
        a group call cancelled before its ack aborts every request it admitted.
        """
        self._loop = asyncio.get_running_loop()
        self._num_submit_calls += 1
        requests, errors = self._parse_group(wires)
        self._num_submits += len(errors)
        if not requests:
            kinds: list[str | None] = [INVALID] * len(errors)
            yield GroupAck(self.replica_id, False, "", errors, kinds, [None] * len(errors)).encode()
            return
        caller_id = next(iter(requests.values())).caller_id
        carrier, is_carrier = self._elect(caller_id)
        sample_ids = {
            i: [sample_request_id(r.request_id, k) for k in range(num_samples(r.params))]
            for i, r in requests.items()
        }
        for rids in sample_ids.values():
            carrier.in_flight.update(rids)
        try:
            outcomes = await self._admit(caller_id, list(requests.values()))
        except BaseException:  # cancelled by the caller, or an engine bug: never leak blocks
            self._abandon(
                caller_id, carrier, is_carrier, [r for rs in sample_ids.values() for r in rs]
            )
            raise
        error_kinds: list[str | None] = [None if e is None else INVALID for e in errors]
        admitted_s: list[float | None] = [None] * len(errors)
        for i, (error, error_kind, admitted_at_s) in zip(requests, outcomes, strict=True):
            errors[i], error_kinds[i], admitted_s[i] = error, error_kind, admitted_at_s
            if error is not None:
                for sample_id in sample_ids[i]:
                    self._drop(caller_id, carrier, sample_id)
        any_admitted = any(s is not None for s in admitted_s)
        carrier_id = carrier.carrier_id if any_admitted or is_carrier else ""
        ack = GroupAck(
            self.replica_id, is_carrier, carrier_id, errors, error_kinds, admitted_s
        ).encode()
        # aclosing: a caller that goes away closes the carrier now, not when collected.
        async with contextlib.aclosing(
            self._ack_and_carry(ack, is_carrier, caller_id, carrier)
        ) as messages:
            async for message in messages:
                yield message

    @staticmethod
    def _parse_group(wires: Any) -> tuple[dict[int, SubmitRequest], list[str | None]]:
        """The group's well-formed requests by position, and an error per position (None
        where well-formed). All must share the first well-formed request's caller_id: the
        carrier is elected per caller."""
        if not isinstance(wires, list) or not 1 <= len(wires) <= MAX_GROUP_SIZE:
            got = len(wires) if isinstance(wires, list) else type(wires).__name__
            return {}, [f"requests: must be a list of 1 to {MAX_GROUP_SIZE} requests, got {got}"]
        requests: dict[int, SubmitRequest] = {}
        errors: list[str | None] = [None] * len(wires)
        for i, wire in enumerate(wires):
            try:
                request = SubmitRequest.from_wire(wire)
            except ValueError as exc:
                errors[i] = str(exc)
                continue
            if requests and request.caller_id != next(iter(requests.values())).caller_id:
                errors[i] = f"caller_id: must be the group's, got {request.caller_id!r}"
                continue
            requests[i] = request
        return requests, errors

    async def _admit(
        self, caller_id: str, requests: list[SubmitRequest]
    ) -> list[tuple[str | None, str | None, float | None]]:
        """Add one caller's requests to the engine, each on its own: per request, (None,
        None, admitted at), or (error, error_kind, None) when it is refused. Raises what
        the engine raised that is no refusal (a bug: the caller aborts the group).

        The valid ones go in one add_many (one future and one wake-up of this loop for
        all of them, where an add each cost a task, a future and a wake-up each)."""
        outcomes: list[tuple[str | None, str | None, float | None] | None] = []
        valid: list[tuple[str, list[int], SamplingParams]] = []
        for request in requests:
            try:
                params = self._params.get(request.params)
            except (ValueError, TypeError) as exc:  # TypeError: a wrong-typed field
                outcomes.append((str(exc), INVALID, None))
                continue
            outcomes.append(None)  # the engine's to say
            valid.append((request.request_id, request.prompt_token_ids, params))
        added: list[Any] = []
        if valid:
            try:
                added = await asyncio.wrap_future(self._engine_loop.add_many(caller_id, valid))
            except EngineUnavailableError as exc:  # the engine process is gone: none runs
                added = [exc] * len(valid)
        results = iter(added)
        return [_add_outcome(next(results)) if o is None else o for o in outcomes]

    def _elect(self, caller_id: str) -> tuple[_Carrier, bool]:
        """The caller's carrier here, and whether this call's stream becomes it (the caller
        has none yet: election on arrival, so later submits attach to it)."""
        carrier = self._carriers.get(caller_id)
        if carrier is not None:
            return carrier, False
        carrier = self._carriers[caller_id] = _Carrier()
        return carrier, True

    def _abandon(
        self, caller_id: str, carrier: _Carrier, is_carrier: bool, rids: list[str]
    ) -> None:
        """A submit call that ends before its ack: abort what it admitted (no leaked
        blocks), and close the carrier it was elected as."""
        for rid in rids:
            self._drop(caller_id, carrier, rid)
            self._engine_loop.abort(rid)
        if is_carrier:
            self._close_carrier(caller_id, carrier)

    async def _ack_and_carry(
        self, ack: bytes, is_carrier: bool, caller_id: str, carrier: _Carrier
    ) -> AsyncIterator[bytes]:
        """The ack; then, for the elected stream, the carrier's messages until it is done."""
        if not is_carrier:
            yield ack
            return
        try:
            yield ack
            async for message in self._carry(carrier):
                yield message
        finally:  # done, or the caller went away (cancelled / closed at any yield)
            self._close_carrier(caller_id, carrier)

    def _drop(self, caller_id: str, carrier: _Carrier, rid: str) -> None:
        carrier.in_flight.discard(rid)
        if not carrier.in_flight and self._carriers.get(caller_id) is carrier:
            del self._carriers[caller_id]
        carrier.wake()  # a running carrier may have nothing left

    def _close_carrier(self, caller_id: str, carrier: _Carrier) -> None:
        """The carrier's stream is over: later submits elect a new one; what still rode
        on this one can no longer reach its caller, so it is aborted (blocks freed)."""
        if self._carriers.get(caller_id) is carrier:
            del self._carriers[caller_id]
        for rid in list(carrier.in_flight):
            self._engine_loop.abort(rid)
        carrier.in_flight.clear()

    async def _carry(self, carrier: _Carrier) -> AsyncIterator[bytes]:
        """Send what is pending as one message once it is due (see _drain_outbox) or has
        waited CARRIER_MAX_HOLD_S, or a heartbeat after a quiet period."""
        loop = asyncio.get_running_loop()
        while carrier.in_flight or carrier.pending:
            if carrier.in_flight and not carrier.due:
                if carrier.pending:
                    wait_s = max(0.0, carrier.hold_until_s - loop.time())
                else:
                    wait_s = self._heartbeat_s
                carrier.waiter = waiter = loop.create_future()
                timer = loop.call_later(wait_s, carrier.wake, True)
                try:
                    timed_out = await waiter
                finally:
                    timer.cancel()
                    carrier.waiter = None
                if not timed_out:
                    continue  # woken: pending is due, or a request was dropped
                if not carrier.pending:
                    if carrier.in_flight:
                        self._num_heartbeats += 1
                        yield self._heartbeat
                    continue
            steps, carrier.pending, carrier.due = carrier.pending, [], False
            self._num_messages += 1
            yield CarrierBatch(self.replica_id, steps, self._engine_loop.load_stats).encode()

    async def abort(self, request_id: str) -> bool:
        try:
            return await asyncio.wrap_future(self._engine_loop.abort(request_id))
        except EngineUnavailableError:
            return False

    # The small methods below are async although they never await: Serve runs a sync
    # method on a worker thread, a thread hop (and a GIL handoff) for every call.
    async def check_health(self) -> None:
        """Serve's health probe: fails once the engine loop has stopped, so it is replaced."""
        if not self._engine_loop.is_alive:
            raise RuntimeError(self._engine_loop.failure or "engine loop is not running")

    async def record_routing_stats(self) -> dict[str, bytes]:
        return encode_routing_stats(self._engine_loop.stats)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (with autoscale): KV usage, queued prompt
        tokens and the prompt-token admission rate (cluster.autoscale.ReplicaMeter)."""
        return self._scale_meter.record(self._engine_loop.stats)

    async def stats(self) -> bytes:
        return self._engine_loop.stats.to_msgpack()

    async def model_info(self) -> dict[str, Any]:
        return self._model_info

    async def serving_counters(self) -> dict[str, Any]:
        """Totals since the replica started, for load tests to difference over a run:
        submits (requests) and the Serve calls that made them, carrier messages and
        heartbeats sent, this process's CPU seconds (all its threads) and, with
        engine_process, the engine child's (else None), and the engine-side TTFT
        (admission to first token) summed over requests."""
        return {
            "replica_id": self.replica_id,
            "time_s": time.monotonic(),
            "submits": self._num_submits,
            "submit_calls": self._num_submit_calls,
            "messages": self._num_messages,
            "heartbeats": self._num_heartbeats,
            "cpu_s": time.process_time(),
            "engine_cpu_s": self._engine_loop.child_cpu_s(),
            "ttft_total_s": self._metrics.ttft_s.sum,
            "num_ttft": self._metrics.ttft_s.count,
        }

    async def metrics_snapshot(self) -> dict[str, Any]:
        """This replica's gauges (its latest ReplicaStats) and engine totals, for /metrics:
        a MetricsSnapshot's wire form (cluster.metrics)."""
        return MetricsSnapshot.of(self._engine_loop.stats, self._metrics).to_wire()

    def shutdown(self) -> None:
        """Stop the engine loop (Serve: at replica teardown, through __del__)."""
        engine_loop = getattr(self, "_engine_loop", None)
        if engine_loop is not None:
            engine_loop.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def _deliver_threadsafe(self, caller_id: str, batch: StepBatch) -> None:
        """Engine thread: queue a step batch for the replica's loop. One loop wake-up per
        burst, not per caller and step: the drain is scheduled only when none is."""
        assert self._loop is not None, "outputs before any submit"
        self._outbox.append((caller_id, batch))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon_threadsafe(self._drain_outbox)

    def _drain_outbox(self) -> None:
        # Cleared before popping: a batch appended after this line schedules a new drain,
        # one appended before it is popped below.
        self._drain_scheduled = False
        outbox = self._outbox
        # Every step goes out while there are at most carrier_messages_per_step callers;
        # beyond, each carrier sends every `interval` steps (ClusterConfig).
        interval = -(-len(self._carriers) // self._config.carrier_messages_per_step)
        now_s = asyncio.get_running_loop().time()
        while outbox:
            caller_id, batch = outbox.popleft()
            carrier = self._carriers.get(caller_id)
            if carrier is None:
                continue  # the caller went away; its requests are being aborted
            if batch.finishes:
                ids = batch.request_ids
                carrier.in_flight.difference_update([ids[i] for i, _ in batch.finishes])
            starts_hold = not carrier.pending
            if starts_hold:
                carrier.hold_until_s = now_s + CARRIER_MAX_HOLD_S
            carrier.pending.append(batch)
            if batch.urgent or len(carrier.pending) >= interval:
                carrier.due = True
            if carrier.waiter is not None and (carrier.due or starts_hold):
                carrier.wake()  # to send, or to wait until hold_until_s instead
