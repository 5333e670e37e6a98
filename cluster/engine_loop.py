"""EngineLoop: the one thread that owns a replica's LLMEngine.

The engine is blocking torch code, so it runs in one background thread that owns it
exclusively: callers (the Serve deployment's asyncio loop, cluster.engine_process's
pipe reader) never touch the engine, they post commands (add, abort) and receive,
once per engine step, one StepBatch per caller with requests here (see
cluster.transport). ReplicaStats are computed by the engine thread every
stats_period_s and cached, so a stats read answers without waiting for a step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.config import ClusterConfig
from cluster.messages import ERROR_FINISH, StepBatch
from cluster.metrics import ReplicaMetrics
from replica.outputs import StepOutputs
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

logger = logging.getLogger(__name__)

# Carrier messages carry the replica's load (cluster.live_stats) as of a step at most
# this long ago, or of the last step that ended a request.
LOAD_STATS_PERIOD_S = 0.002

# (caller_id, what one step produced for that caller), called on the engine thread
Deliver = Callable[[str, StepBatch], None]


@dataclass(slots=True, eq=False)  # eq=False: `None in trackeds` compares identities, in C
class _Tracked:
    caller_id: str
    admitted_s: float
    first_token_s: float | None = None


_CALLER_ID = operator.attrgetter("caller_id")


class EngineUnavailableError(RuntimeError):
    """The engine loop has stopped (its engine failed, or the replica is shutting down)."""


class AbortedBeforeAdmissionError(RuntimeError):
    """The caller aborted this request id before its add reached the engine."""


def error_batches(requests: Iterable[tuple[str, str]]) -> dict[str, StepBatch]:
    """(request id, caller id) pairs of requests an engine failure ends: one StepBatch
    per caller, each request finished with ERROR_FINISH and no tokens."""
    per_caller: dict[str, StepBatch] = {}
    for request_id, caller_id in requests:
        per_caller.setdefault(caller_id, StepBatch()).add(request_id, [], ERROR_FINISH)
    return per_caller


def settle(future: concurrent.futures.Future, setter: Callable[[Any], None], value: Any) -> None:
    """Hand a command's outcome to its future, unless the awaiting caller cancelled it.

    A command runs even when its caller has gone (an abort must still happen; an add
    is followed by the caller's abort), so only the hand-over is skipped.
    """
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        setter(value)


class EngineLoop:
    """Owns the engine in one thread: drain commands, step, fan out per caller, stats.

    Invariant: every request added here ends with exactly one finished TokenDelta
    delivered to its caller (length/stop from the engine, "abort", or "error" when the
    engine raised). Failure: an exception out of the engine stops the loop for good
    (its state may be inconsistent): every tracked request gets "error", every later
    command fails with EngineUnavailableError, and `failure` says why, so the replica's
    health check fails and Serve replaces it. An abort that arrives before its add
    leaves a tombstone, so the add is refused instead of running unobserved.
    """

    MAX_TOMBSTONES = 4096

    def __init__(
        self,
        engine: Any,
        replica_id: str,
        stats_period_s: float,
        deliver: Deliver,
        metrics: ReplicaMetrics | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._engine = engine
        self._stats_period_s = stats_period_s
        self._deliver = deliver
        self._metrics = metrics
        self._lock = threading.Lock()  # guards _commands against _closed
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = collections.deque()
        self._closed = False
        self.failure: str | None = None
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._awaiting_first: set[str] = set()  # tracked requests with no token delivered yet
        # Tokens delivered per tracked request, for TPOT (counted only with metrics).
        self._num_tokens: collections.Counter[str] = collections.Counter()
        self._tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stats = engine.stats()
        self._stats_at_s = time.monotonic()
        # What carrier messages carry (cluster.live_stats): refreshed by _fan_out.
        self._refresh_load_stats()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ReplicaStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def child_cpu_s(self) -> float | None:
        """The engine runs in this process (its CPU is the process's): None."""
        return None

    def add(
        self, caller_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> concurrent.futures.Future:
        """Admit a request; the future gives when (time.time(), the clock of stats
        timestamps: every later snapshot counts it) or raises the engine's ValueError."""

        def command() -> float:
            if request_id in self._tombstones:
                del self._tombstones[request_id]
                raise AbortedBeforeAdmissionError(f"request {request_id!r} was aborted")
            self._engine.add_request(request_id, prompt_token_ids, params)
            self._tracked[request_id] = _Tracked(caller_id, time.monotonic())
            self._awaiting_first.add(request_id)
            return time.time()

        return self._post(command)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request if it runs here (frees its blocks); the future gives a bool."""

        def command() -> bool:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                self._tombstones[request_id] = None
                while len(self._tombstones) > self.MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
                return False
            self._untrack(request_id)
            self._engine.abort(request_id)
            batch = StepBatch()
            batch.add(request_id, [], "abort")
            self._deliver(tracked.caller_id, batch)
            return True

        return self._post(command)

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=5.0)

    def _post(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineUnavailableError(self.failure or "shutting down"))
                return future
            self._commands.append((command, future))
        self._wakeup.set()
        return future

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                while self._commands:
                    command, future = self._commands.popleft()
                    try:
                        result = command()
                    except Exception as exc:  # handed to the awaiting coroutine
                        settle(future, future.set_exception, exc)
                    else:
                        settle(future, future.set_result, result)
                if self._engine.has_unfinished():
                    self._fan_out(self._engine.step())
                else:
                    self._wakeup.wait(timeout=self._stats_period_s)
                if time.monotonic() - self._stats_at_s >= self._stats_period_s:
                    self._refresh_stats()
                self._end_iteration()
        except BaseException as exc:
            self.failure = f"engine loop failed: {exc!r}"
            logger.exception("kvfleet engine loop of replica %s failed", self.replica_id)
            self._fail_tracked()
        finally:
            with self._lock:
                self._closed = True
                pending, self._commands = list(self._commands), collections.deque()
            for _, future in pending:
                error = EngineUnavailableError(self.failure or "shutting down")
                settle(future, future.set_exception, error)
            self._end_iteration()

    def _end_iteration(self) -> None:
        """After each pass of commands and step (cluster.engine_process ships its
        deliveries here, one message per pass)."""

    def _fail_tracked(self) -> None:
        ended = error_batches((rid, t.caller_id) for rid, t in self._tracked.items())
        self._tracked.clear()
        self._awaiting_first.clear()
        self._num_tokens.clear()
        for caller_id, batch in ended.items():
            self._deliver(caller_id, batch)

    def _refresh_stats(self) -> None:
        self._stats = self._engine.stats()
        self._stats_at_s = time.monotonic()
        if self._metrics is not None:
            self._metrics.record_stats(self._stats)

    def _refresh_load_stats(self) -> None:
        self.load_stats = self._engine.stats(with_hashes=False).to_msgpack()
        self._load_stats_at_s = time.monotonic()

    def _fan_out(self, outputs: Sequence[Any]) -> None:
        """One StepBatch per caller with output in this step (runs once per step, on the
        engine thread). An LLMEngine's StepOutputs goes by its columns: a caller's batch is
        sliced from them, and only the rows that start or end a request are visited one by
        one."""
        now_s = time.monotonic()
        batches = None
        if isinstance(outputs, StepOutputs):
            batches = self._column_batches(outputs, now_s)
        if batches is None:
            batches = self._row_batches(_rows(outputs), now_s)
        # Before delivering: the batch that ends requests carries the load without them.
        any_finished = any(batch.finishes for batch in batches.values())
        if any_finished or now_s - self._load_stats_at_s >= LOAD_STATS_PERIOD_S:
            self._refresh_load_stats()
        for caller_id, batch in batches.items():
            self._deliver(caller_id, batch)

    def _column_batches(self, outputs: StepOutputs, now_s: float) -> dict[str, StepBatch] | None:
        """The step's batches from its columns (one token a row); None when a row's request
        is no longer tracked (aborted after its step launched), which the rows path skips."""
        request_ids, token_ids, ends = outputs.request_ids, outputs.token_ids, outputs.finishes
        trackeds = list(map(self._tracked.get, request_ids))
        if None in trackeds:
            return None
        firsts = self._awaiting_first.intersection(request_ids) if self._awaiting_first else set()
        if self._metrics is not None:
            self._num_tokens.update(request_ids)
        callers = set(map(_CALLER_ID, trackeds))
        batches: dict[str, StepBatch] = {}
        if len(callers) == 1:  # the common case: the whole step is one caller's
            finishes = [(i, ends[i][0]) for i in sorted(ends)]
            rows = [1] * len(request_ids)
            batches[callers.pop()] = StepBatch(list(request_ids), rows, list(token_ids), finishes)
        else:
            groups: dict[str, list[int]] = {}
            for i, caller_id in enumerate(map(_CALLER_ID, trackeds)):
                groups.setdefault(caller_id, []).append(i)
            for caller_id, rows in groups.items():
                finishes = [(k, ends[i][0]) for k, i in enumerate(rows) if i in ends]
                batches[caller_id] = StepBatch(
                    [request_ids[i] for i in rows], [1] * len(rows),
                    [token_ids[i] for i in rows], finishes,
                )  # fmt: skip
        for batch in batches.values():
            batch.urgent = bool(batch.finishes) or not firsts.isdisjoint(batch.request_ids)
        for request_id in firsts:
            self._first_token(request_id, now_s)
        for i in ends:
            self._finished(request_ids[i], now_s)
        return batches

    def _row_batches(
        self, rows: Iterable[tuple[str, list[int], str | None]], now_s: float
    ) -> dict[str, StepBatch]:
        """The step's batches row by row: any engine's outputs (test and bench engines)."""
        batches: dict[str, StepBatch] = {}
        for request_id, token_ids, finish_reason in rows:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # aborted: its final delta is already sent
            if not token_ids and finish_reason is None:
                continue  # e.g. a prefill chunk: nothing for the caller yet
            first = request_id in self._awaiting_first
            if first and token_ids:
                self._first_token(request_id, now_s)
            if self._metrics is not None:
                self._num_tokens[request_id] += len(token_ids)
            batch = batches.get(tracked.caller_id)
            if batch is None:
                batch = batches[tracked.caller_id] = StepBatch()
            batch.add(request_id, token_ids, finish_reason, first)
            if finish_reason is not None:
                self._finished(request_id, now_s)
        return batches

    def _first_token(self, request_id: str, now_s: float) -> None:
        """A tracked request's first token is out: its TTFT."""
        self._awaiting_first.discard(request_id)
        tracked = self._tracked[request_id]
        tracked.first_token_s = now_s
        if self._metrics is not None:
            self._metrics.observe_ttft(now_s - tracked.admitted_s)

    def _finished(self, request_id: str, now_s: float) -> None:
        """A tracked request ended on the engine: its TPOT, and it is no longer tracked."""
        tracked = self._tracked[request_id]
        num_tokens = self._num_tokens[request_id]
        self._untrack(request_id)
        if self._metrics is not None and num_tokens > 1 and tracked.first_token_s is not None:
            self._metrics.tpot_s.observe((now_s - tracked.first_token_s) / (num_tokens - 1))

    def _untrack(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._awaiting_first.discard(request_id)
        self._num_tokens.pop(request_id, None)


def _rows(outputs: Sequence[Any]) -> Iterable[tuple[str, list[int], str | None]]:
    """(request id, new token ids, finish reason or None) per output of a step: a
    StepOutputs by its columns, else each RequestOutput's fields (test and bench engines)."""
    if isinstance(outputs, StepOutputs):
        ends = outputs.finishes
        return (
            (request_id, [token], ends[i][0] if i in ends else None)
            for i, (request_id, token) in enumerate(
                zip(outputs.request_ids, outputs.token_ids, strict=True)
            )
        )
    return (
        (out.request_id, out.new_token_ids, (out.finish_reason or "stop") if out.finished else None)
        for out in outputs
    )


def default_engine_factory(config: ClusterConfig, replica_id: str, num_gpus: float) -> Any:
    from replica import LLMEngine

    return LLMEngine(config.engine_config(replica_id, num_gpus))


def engine_model_info(config: ClusterConfig, engine: Any) -> dict[str, Any]:
    """What LLMServer.model_info answers (Client.model_info reads it)."""
    model_config = engine.model_config
    return {
        "model": config.model,
        "vocab_size": model_config.vocab_size,
        "eos_token_id": model_config.eos_token_id,
        "has_tokenizer": engine.tokenizer is not None,
        "max_model_len": engine.max_model_len,
    }
