"""The parent side of the generator processes: spawn once, run one round per router.

Processes are spawned (never forked: the parent is a Ray driver) before the first app is
deployed, so their start-up (torch, Ray driver) overlaps the replicas'. Per round:
  parent -> ("prepare", WorkerPlan) each: new Client, warm-up, then ("ready", proc, None)
  parent -> ("go", start_wall_s)    each: send its share against the shared start time
  each   -> ("progress", proc, n) ... ("result", proc, WorkerResult)
A process that fails or dies is reported, and its requests of that round (and of every
later round) have no records, so they count as lost.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.load_worker import WorkerPlan, WorkerResult, worker_main
from bench.load_workload import RequestSpec, split_concurrency, split_round_robin

READY_TIMEOUT_S = 300.0
START_DELAY_S = 0.5  # between "go" and the trace's time zero, so every process starts on time


@dataclass
class Round:
    """What one round brought back, by process index."""

    results: dict[int, WorkerResult] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    done_by_proc: dict[int, int] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    start_wall_s: float = math.nan

    def finished(self, num_procs: int) -> bool:
        return len(self.results) + len(self.failures) >= num_procs


class GeneratorPool:
    """num_procs generator processes, each a Ray driver connected to ray_address."""

    def __init__(
        self,
        num_procs: int,
        ray_address: str,
        routing_trace: bool = False,
        http_url: str | None = None,
        submit_group_size: int = 1,
    ) -> None:
        """routing_trace: each generator records its routers' decisions
        (WorkerResult.routing_rows); http_url: the generators drive this OpenAI endpoint
        instead of a Client (bench.load_http); submit_group_size: their Clients'
        max_group_size."""
        self.routing_trace = routing_trace
        self.http_url = http_url
        self.submit_group_size = submit_group_size
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(num_procs)]
        self.procs = []
        for p in range(num_procs):
            proc = ctx.Process(
                target=worker_main,
                args=(p, ray_address, self.events, self.commands[p]),
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
        self.dead: dict[int, str] = {}

    @property
    def num_procs(self) -> int:
        return len(self.procs)

    def run_round(
        self,
        app_name: str,
        trace: list[RequestSpec],
        concurrency: int | None,
        timeout_s: float,
        on_tick: Callable[[Round], None],
    ) -> Round:
        """Split the trace over the live processes, start them together, collect.

        Request i goes to process i % num_procs (every process spans the whole trace);
        closed-loop users are split as evenly. on_tick(state) runs every ~50 ms.
        """
        state = Round(failures=dict(self.dead))
        shares = split_round_robin(trace, self.num_procs)
        users = split_concurrency(concurrency, self.num_procs) if concurrency else None
        for p, commands in enumerate(self.commands):
            if p not in self.dead:
                plan = WorkerPlan(
                    p, app_name, shares[p], users[p] if users else None, timeout_s,
                    routing_trace=self.routing_trace, http_url=self.http_url,
                    submit_group_size=self.submit_group_size,
                )  # fmt: skip
                commands.put(("prepare", plan))
        t_prepare = time.monotonic()
        while len(state.ready) + len(state.failures) < self.num_procs:
            if time.monotonic() - t_prepare > READY_TIMEOUT_S:
                for p in set(range(self.num_procs)) - state.ready - set(state.failures):
                    state.failures[p] = f"not ready within {READY_TIMEOUT_S:.0f} s"
                break
            self._poll(state, 0.5)
        print(
            f"{len(state.ready)}/{self.num_procs} generator processes ready "
            f"in {time.monotonic() - t_prepare:.1f} s"
        )
        state.start_wall_s = time.time() + START_DELAY_S
        for p in state.ready:
            self.commands[p].put(("go", state.start_wall_s))
        while not state.finished(self.num_procs):
            on_tick(state)
            self._poll(state, 0.05)
        self.dead.update(state.failures)
        return state

    def close(self) -> None:
        for p, commands in enumerate(self.commands):
            if p not in self.dead:
                commands.put(("stop", None))
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.exitcode is None:
                proc.kill()

    def _poll(self, state: Round, timeout_s: float) -> None:
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            self._check_alive(state)
            return
        _dispatch(state, event)

    def _check_alive(self, state: Round) -> None:
        for p, proc in enumerate(self.procs):
            if p in state.results or p in state.failures or proc.exitcode is None:
                continue
            with contextlib.suppress(queue.Empty):  # its last words may still be in the pipe
                while p not in state.results and p not in state.failures:
                    _dispatch(state, self.events.get(timeout=1.0))
            if p not in state.results and p not in state.failures:
                state.failures[p] = f"generator process exited with code {proc.exitcode}"


def _dispatch(state: Round, event: tuple) -> None:
    kind, proc, payload = event
    if kind == "ready":
        state.ready.add(proc)
    elif kind == "progress":
        state.done_by_proc[proc] = payload
    elif kind == "result":
        state.results[proc] = payload
        state.done_by_proc[proc] = sum(1 for r in payload.records if r.outcome != "lost")
    else:
        state.failures[proc] = payload
