"""EngineLoop: the one thread that owns a replica's LLMEngine.

The engine is blocking torch code, so it runs in one background thread that owns it
exclusively: callers (the Serve deployment's asyncio loop, cluster.engine_process's
pipe reader) never touch the engine, they post commands (add, abort) and receive,
once per engine step, one StepBatch per caller with requests here (cut from the step's
outputs by cluster.fan_out; carried by cluster.transport). ReplicaStats are computed
by the engine thread every stats_period_s and cached, so a stats read answers without
waiting for a step.

A CPU replica's engine is built on its thread too, so that one thread runs all of its
torch work (engine_builder). torch's CPU ops run on an OpenMP pool per calling thread,
with OMP_NUM_THREADS threads, which Ray sets to the replica's num_cpus
(ClusterConfig.num_cpus_per_replica). Once a second thread has a pool, a replica given
more than half of the cores holds more OpenMP threads than cores, the pools' idle
threads sleep instead of spinning (libgomp's throttled spin), and every parallel op
waits for a wake-up: on a 2-core box at 2 threads a 32 x 256 GELU took 89 us on the
second pool against 10 on one (25 with GOMP_SPINCOUNT=1e8), and a gpt2-tiny engine built
on the caller's thread and stepped on this one took 32.6 against 7.7 ms a step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cluster.config import ClusterConfig
from cluster.fan_out import FanOut
from cluster.messages import StepBatch
from cluster.metrics import ReplicaMetrics
from replica.protocol import ServingEngine
from replica.sampling_params import SamplingParams, sample_request_id
from replica.stats import ReplicaStats

logger = logging.getLogger(__name__)

# Carrier messages carry the replica's load (cluster.live_stats) as of a step at most
# this long ago, or of the last step that ended a request.
LOAD_STATS_PERIOD_S = 0.002
# While requests decode, a pass of the engine thread runs posted commands for this long,
# and on while the device still runs the step in flight; then it steps, and the rest of
# the commands wait for the next pass, in order. A burst of adds (~30 us each on an H200
# host) then goes in beside the device's steps instead of holding every running
# request's next token behind the whole burst: during a burst of 256 adds the running
# requests' longest gap was 3.5-6 ms against 15-18 ms unsliced. With nothing decoding, a
# pass runs every command: a burst into an idle replica is added whole and prefilled in
# full steps. Sliced too, its last requests got their first token up to ~8 ms later on
# an H200 (docs/design.md, "Command slices").
COMMAND_SLICE_S = 0.001
# The GIL switch interval of a process that runs an EngineLoop (cluster.deployment,
# cluster.engine_process): its other threads wait for the engine thread up to this long
# per hand-off, against Python's 5 ms.
GIL_SWITCH_INTERVAL_S = 0.0005

# (caller_id, what one step produced for that caller), called on the engine thread
Deliver = Callable[[str, StepBatch], None]

# What builds a replica's engine: (config, replica_id, num_gpus) -> the engine.
EngineFactory = Callable[[ClusterConfig, str, float], ServingEngine]


class EngineUnavailableError(RuntimeError):
    """The engine loop has stopped (its engine failed, or the replica is shutting down)."""


class AbortedBeforeAdmissionError(RuntimeError):
    """The caller aborted this request id before its add reached the engine."""


class Outcome(Protocol):
    """Where a command's outcome goes: its concurrent.futures.Future, or its slot in an
    add_many's group."""

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, exception: BaseException | None) -> None: ...


class _AddGroup:
    """The outcomes of an add_many's adds, in order; its future gets them once the last
    one is in. Settled on the engine thread only (or, when the loop had stopped, by
    _post_all before any command of the group could run)."""

    def __init__(self, num_requests: int) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.outcomes: list[Any] = [None] * num_requests
        self._num_left = num_requests
        if not num_requests:
            self.future.set_result([])

    def settle(self, i: int, outcome: Any) -> None:
        self.outcomes[i] = outcome
        self._num_left -= 1
        if not self._num_left:
            settle(self.future, self.future.set_result, self.outcomes)


class _GroupSlot:
    """One add's Outcome in an add_many: its place in the group's list."""

    __slots__ = ("_group", "_i")

    def __init__(self, group: _AddGroup, i: int) -> None:
        self._group, self._i = group, i

    def set_result(self, result: Any) -> None:
        self._group.settle(self._i, result)

    def set_exception(self, exception: BaseException | None) -> None:
        self._group.settle(self._i, exception)


def settle(future: Outcome, setter: Callable[[Any], None], value: Any) -> None:
    """Hand a command's outcome to its future, unless the awaiting caller cancelled it.

    A command runs even when its caller has gone (an abort must still happen; an add
    is followed by the caller's abort), so only the hand-over is skipped.
    """
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        setter(value)


class EngineLoop:
    """Owns the engine in one thread: build it (`build()`, whose error the constructor
    raises), then drain commands, step, fan out per caller, stats.

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
        build: Callable[[], ServingEngine],
        replica_id: str,
        stats_period_s: float,
        deliver: Deliver,
        metrics: ReplicaMetrics | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._stats_period_s = stats_period_s
        self._deliver = deliver
        self._lock = threading.Lock()  # guards _commands against _closed
        self._commands: collections.deque[tuple[Callable[[], Any], Outcome]]
        self._commands = collections.deque()
        self._closed = False
        self.failure: str | None = None
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._fan_out = FanOut(metrics)  # the engine thread's alone
        self._tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._decoding = False  # the last step gave tokens: requests are decoding
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(build,), name="kvfleet-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @property
    def engine(self) -> ServingEngine:
        """The engine, for its fixed facts (model_config, max_model_len): its methods are
        the engine thread's alone."""
        return self._engine

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
        return self._post(
            functools.partial(self._add, caller_id, request_id, prompt_token_ids, params)
        )

    def add_many(
        self, caller_id: str, requests: Sequence[tuple[str, list[int], SamplingParams]]
    ) -> concurrent.futures.Future:
        """add for each of one caller's (request_id, prompt_token_ids, params), in order:
        the future gives a list of what each add's future would give (when admitted) or
        the exception it would raise, so each request is admitted or refused on its own.

        Each add is a command of its own (a pass's command slice cuts a group where it
        cuts single adds), but the group has one future and one hand-over to its caller:
        64 adds posted one by one cost the replica's loop 64 futures, 64 wake-ups from
        this thread and 64 tasks. A loop that stops before running them all gives
        EngineUnavailableError for those it did not run, as add's futures do.
        """
        group = _AddGroup(len(requests))
        commands = [
            (functools.partial(self._add, caller_id, *request), _GroupSlot(group, i))
            for i, request in enumerate(requests)
        ]
        self._post_all(commands)
        return group.future

    def _add(
        self, caller_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> float:
        """Engine thread: add's command."""
        if request_id in self._tombstones:
            del self._tombstones[request_id]
            raise AbortedBeforeAdmissionError(f"request {request_id!r} was aborted")
        self._engine.add_request(request_id, prompt_token_ids, params)
        now_s = time.monotonic()
        for i in range(params.n):  # n > 1: the engine runs n samples (n request ids)
            # The samples share one prefill: its prompt tokens count once, on the first.
            num_prompt_tokens = len(prompt_token_ids) if i == 0 else 0
            sample_id = sample_request_id(request_id, i)
            self._fan_out.track(sample_id, caller_id, now_s, num_prompt_tokens)
        return time.time()

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request if it runs here (frees its blocks); the future gives a bool."""

        def command() -> bool:
            caller_id = self._fan_out.abort(request_id)
            if caller_id is None:
                self._tombstones[request_id] = None
                while len(self._tombstones) > self.MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
                return False
            self._engine.abort(request_id)
            batch = StepBatch()
            batch.add(request_id, [], "abort")
            self._deliver(caller_id, batch)
            return True

        return self._post(command)

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=5.0)

    def _post(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post_all([(command, future)])
        return future

    def _post_all(self, commands: list[tuple[Callable[[], Any], Outcome]]) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._commands.extend(commands)
        if closed:  # nothing will run them
            for _, outcome in commands:
                outcome.set_exception(EngineUnavailableError(self.failure or "shutting down"))
            return
        self._wakeup.set()

    def _build(self, build: Callable[[], ServingEngine]) -> bool:
        """Build the engine and its first snapshots on this thread; False if that raised
        (the constructor raises it)."""
        try:
            self._engine = build()
            self._stats = self._engine.stats()
            self._stats_at_s = time.monotonic()
            # What carrier messages carry (cluster.live_stats): refreshed by _deliver_step.
            self._refresh_load_stats()
        except BaseException as exc:  # the constructor raises it; no one holds this loop
            self._build_error = exc
            return False
        finally:
            self._built.set()
        return True

    def _run(self, build: Callable[[], ServingEngine]) -> None:
        if not self._build(build):
            return
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._run_commands()
                if self._engine.has_unfinished():
                    outputs = self._engine.step()
                    self._decoding = len(outputs) > 0 and self._engine.has_unfinished()
                    self._deliver_step(outputs)
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

    def _run_commands(self) -> None:
        """Run posted commands in order: while requests decode, until COMMAND_SLICE_S has
        passed and the device is done with the step in flight (at least one command);
        otherwise every one."""
        engine, commands = self._engine, self._commands
        end_s = time.monotonic() + COMMAND_SLICE_S
        while commands:
            command, future = commands.popleft()
            try:
                result = command()
            except Exception as exc:  # handed to the awaiting coroutine
                settle(future, future.set_exception, exc)
            else:
                settle(future, future.set_result, result)
            if (
                self._decoding
                and time.monotonic() >= end_s
                and engine.has_unfinished()  # (an abort may have ended the last request)
                and not engine.device_busy()
            ):
                return

    def _end_iteration(self) -> None:
        """After each pass of commands and step (cluster.engine_process ships its
        deliveries here, one message per pass)."""

    def _fail_tracked(self) -> None:
        for caller_id, batch in self._fan_out.fail_all().items():
            self._deliver(caller_id, batch)

    def _refresh_stats(self) -> None:
        self._stats = self._engine.stats()
        self._stats_at_s = time.monotonic()

    def _refresh_load_stats(self) -> None:
        self.load_stats = self._engine.stats(with_hashes=False).to_msgpack()
        self._load_stats_at_s = time.monotonic()

    def _deliver_step(self, outputs: Sequence[Any]) -> None:
        """Hand each caller its part of the step (cluster.fan_out), after refreshing the
        load snapshot when the step ended requests: their batch carries the load
        without them."""
        now_s = time.monotonic()
        batches = self._fan_out.step(outputs, now_s)
        any_finished = any(batch.finishes for batch in batches.values())
        if any_finished or now_s - self._load_stats_at_s >= LOAD_STATS_PERIOD_S:
            self._refresh_load_stats()
        for caller_id, batch in batches.items():
            self._deliver(caller_id, batch)


def default_engine_factory(
    config: ClusterConfig, replica_id: str, num_gpus: float
) -> ServingEngine:
    from replica import LLMEngine

    return LLMEngine(config.engine_config(replica_id, num_gpus))


def engine_builder(
    factory: EngineFactory | None,
    config: ClusterConfig,
    replica_id: str,
    num_gpus: float,
) -> Callable[[], ServingEngine]:
    """What a replica's EngineLoop builds its engine with (factory: None for LLMEngine).

    A CPU replica's engine is built on the engine thread (this module's docstring: with
    as many torch threads as cores, its steps ran ~4x faster; docs/design.md, "CPU
    replicas and OpenMP pools"). A GPU replica's is built here, on the caller's thread,
    where every GPU figure was measured: it gains nothing from the engine-thread build
    (decode steps took 1.12-1.16 ms either way on an H100), and built on the engine
    thread, one replica serving in-thread on an H100 gave fewer requests/s in each of
    four alternating pairs (364-466 against 436-505, 12% on average), for a reason not
    found.
    """
    build = functools.partial(factory or default_engine_factory, config, replica_id, num_gpus)
    if num_gpus == 0:
        return build
    engine = build()
    return lambda: engine


def engine_model_info(config: ClusterConfig, engine: ServingEngine) -> dict[str, Any]:
    """What LLMServer.model_info answers (Client.model_info reads it)."""
    model_config = engine.model_config
    return {
        "model": config.model,
        "vocab_size": model_config.vocab_size,
        "eos_token_id": model_config.eos_token_id,
        "has_tokenizer": engine.tokenizer is not None,
        "max_model_len": engine.max_model_len,
    }
