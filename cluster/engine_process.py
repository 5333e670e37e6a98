"""The replica's engine in a process of its own (ClusterConfig.engine_process).

Why: a replica's Serve process handles every request and sends every streamed message
(~1.6 ms of GIL time per request in all, two thirds of it Serve's request path on the
replica's loop: py-spy on the CPU box); the engine thread's host work (scheduling,
fan-out) needs the same GIL, so at a few hundred requests/s the step waits for Serve.
With the engine in its own process, as vLLM's engine core, the two no longer share a
GIL: the child runs the unchanged EngineLoop; the replica process only forwards. One
gpt2 replica on an H200 served 1.56x the tokens/s (55.3K -> 86.1K; docs/design.md,
"Engine in a child process"), so it is the default for replicas with a GPU.

Wire (multiprocessing Connection, pickled tuples; one pipe, both directions):
  parent -> child  ("init", config, replica_id, num_gpus, engine_factory) first, then
                   ("add", cmd_id, caller_id, request_id, prompt, params),
                   ("add_many", cmd_id, caller_id, [(request_id, prompt, params)]),
                   ("abort", cmd_id, request_id), ("shutdown",)
  child -> parent  ("ready", model_info, stats, load_stats) or ("failed", reason),
                   ("done", cmd_id, error, result)  a command's outcome,
                   ("out", [(caller_id, StepBatch)], load_stats)
                                                    one engine pass's deliveries,
                   ("stats", ReplicaStats, ReplicaMetrics)
                                                    every stats period (the
                                                    child's totals, cluster.metrics).
The parent counts a request as the child's from when it sends the add until the
child's "done" refuses it: the adds of an add_many may span several passes of the
child's engine loop (its command slices), so a request's tokens, even its end, can come
before the "done" of its group.

Failure: when the child dies or its engine fails, every request it held ends with
"error" (one whose add it had not answered is also refused: EngineUnavailableError),
later commands raise EngineUnavailableError, and is_alive turns False, so
Serve's health check replaces the replica. When the parent dies, the child reads EOF
and exits (the GPU memory goes with it).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing.connection
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig
from cluster.engine_loop import (
    GIL_SWITCH_INTERVAL_S,
    Deliver,
    EngineFactory,
    EngineLoop,
    EngineUnavailableError,
    engine_builder,
    engine_model_info,
    settle,
)
from cluster.fan_out import error_batches
from cluster.messages import StepBatch
from cluster.metrics import ReplicaMetrics
from replica.protocol import ServingEngine
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # model load and CUDA graph capture happen before "ready"


class EngineProcess:
    """EngineLoop's interface (add, abort, stats, load_stats, is_alive, failure,
    child_cpu_s, shutdown) over an engine that runs in a child process."""

    def __init__(
        self,
        config: ClusterConfig,
        replica_id: str,
        num_gpus: float,
        engine_factory: EngineFactory | None,
        deliver: Deliver,
        metrics: ReplicaMetrics | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._deliver = deliver
        self._metrics = metrics
        self.failure: str | None = None
        self._lock = threading.Lock()  # guards sends, _futures and failure
        # cmd_id -> (its future, the adds' caller ("" for an abort), the request ids it
        # adds: one for an add, whose future gives when, or each of an add_many's, whose
        # future gives a list of outcomes; None in place of an id already running there)
        self._futures: dict[int, tuple[concurrent.futures.Future, str, list[str | None]]]
        self._futures = {}
        self._ids = itertools.count()
        self._callers: dict[str, str] = {}  # request id -> caller id, while it runs
        conn, child_conn = multiprocessing.Pipe(duplex=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.engine_process", str(child_conn.fileno())],
            pass_fds=(child_conn.fileno(),),
            env=env,
        )
        child_conn.close()
        self._conn = conn
        try:
            conn.send(("init", config, replica_id, num_gpus, engine_factory))
        except Exception as exc:  # e.g. a lambda: the child imports the factory by name
            self._kill_child()
            raise ValueError(
                f"engine_factory must be picklable with engine_process=True: {exc!r}"
            ) from exc
        if not conn.poll(READY_TIMEOUT_S):
            self._kill_child()
            raise RuntimeError(f"engine process of {replica_id} not ready in {READY_TIMEOUT_S}s")
        try:
            message = conn.recv()
            while message[0] == "stats":
                message = conn.recv()
        except EOFError:
            message = ("failed", f"exited with code {self._proc.wait()}")
        if message[0] != "ready":
            self._kill_child()
            raise RuntimeError(f"engine process of {replica_id} failed to start: {message[1]}")
        _, self.model_info, self._stats, self.load_stats = message
        self._reader = threading.Thread(
            target=self._read, name="kvfleet-engine-reader", daemon=True
        )
        self._reader.start()

    def _kill_child(self) -> None:
        self._proc.kill()
        self._proc.wait()

    @property
    def stats(self) -> ReplicaStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self.failure is None and self._reader.is_alive()

    def child_cpu_s(self) -> float | None:
        """CPU seconds (user + system, all threads) the child has used; None where
        /proc cannot tell (not Linux, or the child is gone)."""
        try:
            with open(f"/proc/{self._proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # Fields 14 and 15 of proc(5) (utime, stime), counted after the ")" of comm.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def add(
        self, caller_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> concurrent.futures.Future:
        """Admit a request: as EngineLoop.add (the future gives when the child's engine
        took it, or raises its ValueError for bad input)."""
        return self._command("add", caller_id, [request_id], prompt_token_ids, params)

    def add_many(
        self, caller_id: str, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> concurrent.futures.Future:
        """As EngineLoop.add_many: one message each way for the group (a message costs
        the replica's process a pickle and a pipe write, and its reader an unpickle)."""
        return self._command("add_many", caller_id, [r[0] for r in requests], requests)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request if it runs there (frees its blocks); the future gives a bool."""
        return self._command("abort", "", [request_id])

    def shutdown(self) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = "shutting down"
            try:
                self._conn.send(("shutdown",))
            except OSError:
                pass  # already gone
        try:
            self._proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._kill_child()

    def _command(self, kind: str, caller_id: str, request_ids: list[str], *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.failure is not None:
                future.set_exception(EngineUnavailableError(self.failure))
                return future
            cmd_id = next(self._ids)
            # Adds (see the docstring); an id already running there keeps its entry: the
            # engine refuses the second add.
            added = [None if r in self._callers else r for r in request_ids if caller_id]
            for request_id in added:
                if request_id is not None:
                    self._callers[request_id] = caller_id
            self._futures[cmd_id] = (future, caller_id, added)
            try:
                if kind == "add":
                    self._conn.send((kind, cmd_id, caller_id, request_ids[0], *args))
                elif kind == "add_many":
                    self._conn.send((kind, cmd_id, caller_id, *args))
                else:
                    self._conn.send((kind, cmd_id, request_ids[0]))
            except OSError as exc:  # the child is gone; the reader fails everything
                del self._futures[cmd_id]
                for request_id in added:
                    self._callers.pop(request_id, None)  # type: ignore[arg-type]
                future.set_exception(EngineUnavailableError(f"engine process: {exc!r}"))
        return future

    def _read(self) -> None:
        """Reader thread: hand each message on; on EOF, fail what the child held."""
        reason = "engine process exited"
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":
                    self._on_out(*message[1:])
                elif kind == "done":
                    self._on_done(*message[1:])
                elif kind == "stats":
                    self._stats = message[1]
                    if self._metrics is not None:
                        self._metrics.load(message[2])
                elif kind == "failed":  # the engine raised; the child's loop sends
                    reason = message[1]  # "error" for each of its requests next
                    self._fail(reason)
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a bug on this side: nothing more can reach the callers
            logger.exception("kvfleet engine process reader of replica %s", self.replica_id)
            reason = f"engine process reader failed: {exc!r}"
            self._proc.kill()
        code = self._proc.poll()
        self._fail(reason if code is None else f"{reason} (exit code {code})")
        self._end_requests()

    def _on_done(self, cmd_id: int, error: BaseException | None, result: Any) -> None:
        with self._lock:
            entry = self._futures.pop(cmd_id, None)
        if entry is None:
            return  # failed already (_fail)
        future, caller_id, added = entry
        if caller_id:  # adds: the ones refused never ran there
            outcomes = [error] if error is not None else result
            if not isinstance(outcomes, list):
                outcomes = [outcomes]
            for request_id, outcome in zip(added, outcomes, strict=True):
                if request_id is not None and isinstance(outcome, BaseException):
                    self._callers.pop(request_id, None)
        if error is None:
            settle(future, future.set_result, result)
        else:
            settle(future, future.set_exception, error)

    def _on_out(self, deliveries: list[tuple[str, StepBatch]], load_stats: bytes) -> None:
        self.load_stats = load_stats
        callers = self._callers
        for caller_id, batch in deliveries:
            self._deliver(caller_id, batch)
            for i, _ in batch.finishes:
                callers.pop(batch.request_ids[i], None)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = reason
                logger.error("kvfleet engine process of replica %s: %s", self.replica_id, reason)
            futures, self._futures = list(self._futures.values()), {}
        for future, _, _ in futures:
            settle(future, future.set_exception, EngineUnavailableError(self.failure))

    def _end_requests(self) -> None:
        """The child is gone: "error" for each request it had not ended."""
        ended = error_batches(self._callers.items())
        self._callers.clear()
        for caller_id, batch in ended.items():
            try:
                self._deliver(caller_id, batch)
            except Exception:  # noqa: BLE001 - the other callers still get theirs
                logger.exception("kvfleet: ending %s's requests", caller_id)


# ---- the child ---------------------------------------------------------------------


class _ChildEngineLoop(EngineLoop):
    """EngineLoop whose deliveries, stats and failure go to the parent's pipe."""

    def __init__(
        self,
        build: Callable[[], ServingEngine],
        replica_id: str,
        stats_period_s: float,
        send: Any,
    ) -> None:
        self._send = send
        self._reported = False
        self._pending: list[tuple[str, StepBatch]] = []
        self._child_metrics = ReplicaMetrics()
        super().__init__(
            build, replica_id, stats_period_s, self._pending_append, self._child_metrics
        )

    def _pending_append(self, caller_id: str, batch: StepBatch) -> None:
        self._pending.append((caller_id, batch))

    def _refresh_stats(self) -> None:
        super()._refresh_stats()
        self._send(("stats", self._stats, self._child_metrics))

    def _end_iteration(self) -> None:
        if self.failure is not None and not self._reported:  # before the "error" ends
            self._reported = True
            self._send(("failed", self.failure))
        if self._pending:
            deliveries, self._pending = self._pending, []
            self._send(("out", deliveries, self.load_stats))


def _child_main(fd: int) -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the command reader waits less for it
    conn = multiprocessing.connection.Connection(fd)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    replica_id = "?"
    try:
        _, config, replica_id, num_gpus, engine_factory = conn.recv()
        build = engine_builder(engine_factory, config, replica_id, num_gpus)
        loop = _ChildEngineLoop(build, replica_id, config.stats_period_s, send)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        logger.exception("kvfleet engine process of replica %s failed to start", replica_id)
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # The engine thread already runs: a "stats" may precede this (the parent skips it).
    send(("ready", engine_model_info(config, loop.engine), loop.stats, loop.load_stats))

    def answer(cmd_id: int) -> Callable[[concurrent.futures.Future], None]:
        def done(future: concurrent.futures.Future) -> None:
            error = future.exception()
            send(("done", cmd_id, error, None if error is not None else future.result()))

        return done

    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "add":
                _, cmd_id, caller_id, request_id, prompt, params = message
                loop.add(caller_id, request_id, prompt, params).add_done_callback(answer(cmd_id))
            elif kind == "add_many":
                _, cmd_id, caller_id, requests = message
                loop.add_many(caller_id, requests).add_done_callback(answer(cmd_id))
            elif kind == "abort":
                _, cmd_id, request_id = message
                loop.abort(request_id).add_done_callback(answer(cmd_id))
            elif kind == "shutdown":
                break
    except (EOFError, OSError):
        pass  # the parent is gone
    loop.shutdown()


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
    os._exit(0)  # the engine thread is a daemon; do not wait on CUDA or Ray teardown
