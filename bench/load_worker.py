"""One generator process of the load test: its own Ray driver, event loop and Client (or,
with WorkerPlan.http_url, one aiohttp session on the OpenAI endpoint: bench.load_http).

Driven by bench.load_pool (its docstring has the protocol). After "go" the process sends
its share of the trace against the shared start time (wall clock): open loop at each
request's arrival offset, or closed loop with `concurrency` users each sending its next
request when the previous one ends. At last arrival + timeout_s (closed loop: start +
timeout_s) whatever is still in flight is cancelled and stays "lost".

A generator process must cost little per token, or it measures itself: its event loop is
uvloop's (a Ray Serve dependency; asyncio's own loop spends more per task wake-up, and
there is one per streamed chunk), and once warmed up it freezes the garbage collector's
view of the start-up heap (Ray, torch), as the engine does, so collections triggered by
the per-chunk allocations do not walk it.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import math
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bench.load_http import open_session, send_one_http
from bench.load_metrics import RequestRecord
from bench.load_workload import RequestSpec

MONITOR_PERIOD_S = 0.5
SATURATION_FRACTION = 0.9  # of one core
REJECTION_TYPES = ("OverloadedError", "BackPressureError")


@dataclass(frozen=True)
class WorkerPlan:
    """One process's part of one round."""

    proc: int
    app_name: str
    requests: list[RequestSpec]
    concurrency: int | None  # closed-loop users in this process; None: open loop
    timeout_s: float
    warmup: bool = True
    routing_trace: bool = False  # record this process's routing decisions (cluster.routing_trace)
    http_url: str | None = None  # drive this OpenAI endpoint (bench.load_http), not a Client
    submit_group_size: int = 1  # the Client's max_group_size (ClusterConfig.submit_group_size)


@dataclass
class WorkerResult:
    proc: int
    records: list[RequestRecord]
    wall_s: float = 0.0
    cpu_s: float = 0.0
    cpu_windows: list[float] = field(default_factory=list)  # cores used per monitor period
    routing_rows: list = field(default_factory=list)  # cluster.routing_trace.RoutingRow
    routing_rows_dropped: int = 0

    @property
    def cpu_fraction(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens received per second of this process's CPU: its cost per token."""
        num_tokens = sum(r.num_output_tokens for r in self.records)
        return num_tokens / self.cpu_s if self.cpu_s > 0 else math.nan

    @property
    def num_saturated_windows(self) -> int:
        return sum(1 for w in self.cpu_windows if w > SATURATION_FRACTION)

    @property
    def saturated(self) -> bool:
        return self.cpu_fraction > SATURATION_FRACTION or self.num_saturated_windows > 0


def worker_main(proc: int, ray_address: str, events: Any, commands: Any) -> None:
    """Process entry point (multiprocessing, spawn): connect, run rounds, disconnect."""
    import ray
    import uvloop

    try:
        ray.init(address=ray_address, log_to_driver=False, logging_level="ERROR")
        import cluster.client  # noqa: F401  (torch and all: now, while the replicas start)

        uvloop.run(_rounds(proc, events, commands))
    except BaseException:
        events.put(("failed", proc, traceback.format_exc()))
    events.close()
    events.join_thread()  # the parent has every event before this process goes
    ray.shutdown()
    # Leftover non-daemon threads (Ray's, the Client's) could hold the exit for seconds.
    os._exit(0)


_past_clients: list[Any] = []  # one per finished round (see the end of _run)


async def _rounds(proc: int, events: Any, commands: Any) -> None:
    loop = asyncio.get_running_loop()
    while True:
        kind, plan = await loop.run_in_executor(None, commands.get)
        if kind == "stop":
            return
        events.put(("result", proc, await _run(plan, events, commands)))


def _classify(exc: BaseException) -> str:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "rejected" if names & set(REJECTION_TYPES) else "error"


async def send_one(client: Any, spec: RequestSpec, record: RequestRecord, t0: float) -> None:
    """Stream one request, filling its record; leaves it "lost" if it neither ends nor fails."""
    from cluster import live_stats
    from replica.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    sent = time.perf_counter()
    sent_wall = time.time()
    record.sent_s = sent - t0
    try:
        async for chunk in client.stream(spec.prompt_token_ids, params):
            if math.isnan(record.admit_s):
                admitted = live_stats.admitted_at(chunk.request_id, chunk.replica_id)
                if admitted is not None:
                    record.admit_s = admitted - sent_wall
            if chunk.token_ids:
                record.chunk_times_s.append(time.perf_counter() - sent)
                record.chunk_num_tokens.append(len(chunk.token_ids))
            record.replica_id = chunk.replica_id
            record.finish_reason = chunk.finish_reason or record.finish_reason
        if record.finish_reason is None:
            record.error_message = "stream ended without a finish reason"
            return
        record.outcome = "ok"
    except asyncio.CancelledError:
        record.error_message = "no completion or typed error before the run's timeout"
        raise
    except Exception as exc:  # every typed failure is an outcome, counted by type
        record.outcome = _classify(exc)
        record.error_type = type(exc).__name__
        record.error_message = str(exc)[:300]
    finally:
        if record.outcome != "lost":
            record.end_s = time.perf_counter() - t0


# send(spec, record, t0): send_one on a Client or send_one_http on a session.
Send = Callable[[RequestSpec, RequestRecord, float], Awaitable[None]]


async def _open_loop(send: Send, plan: WorkerPlan, records: dict, t0: float) -> set:
    tasks: set[asyncio.Task] = set()
    for spec in plan.requests:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.add(asyncio.create_task(send(spec, records[spec.index], t0)))
    return tasks


async def _closed_loop(send: Send, plan: WorkerPlan, records: dict, t0: float) -> set:
    queue = collections.deque(plan.requests)

    async def user() -> None:
        while queue:
            spec = queue.popleft()
            records[spec.index].scheduled_s = time.perf_counter() - t0
            await send(spec, records[spec.index], t0)

    return {asyncio.create_task(user()) for _ in range(plan.concurrency or 0)}


async def _monitor(result: WorkerResult, records: dict, events: Any, proc: int) -> None:
    cpu, wall = time.process_time(), time.perf_counter()
    while True:
        await asyncio.sleep(MONITOR_PERIOD_S)
        now_cpu, now_wall = time.process_time(), time.perf_counter()
        result.cpu_windows.append((now_cpu - cpu) / (now_wall - wall))
        cpu, wall = now_cpu, now_wall
        done = sum(1 for r in records.values() if r.outcome != "lost")
        events.put(("progress", proc, done))


async def _sender(plan: WorkerPlan) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """This round's send function, warmed up, and what closes it after the round."""
    from cluster.client import Client

    # A warm-up builds the handle's router and the carrier path (or the HTTP connection)
    # so the first traced request does not pay for it; two tokens fill no KV block, so no
    # prefix is cached. Its outcome is not the run's: a refused warm-up changes nothing.
    warmup = RequestSpec(-1, [1, 2], 1, 0.0)
    if plan.http_url is not None:
        session = open_session()
        send = partial(send_one_http, session, plan.http_url)
        if plan.warmup:
            await send(warmup, RequestRecord(-1, 2, 1, 0.0), time.perf_counter())
        return send, session.close
    # A new one per round (the app was redeployed), on this round's loop.
    client = Client(plan.app_name, max_group_size=plan.submit_group_size)
    await client.model_info_async()
    send = partial(send_one, client)
    if plan.warmup:
        await send(warmup, RequestRecord(-1, 2, 1, 0.0), time.perf_counter())

    async def keep() -> None:
        # Not client.aclose(): a round after a redeploy has hung before "ready" once the
        # previous round's router was shut down on this loop; the client stays referenced.
        _past_clients.append(client)

    return send, keep


async def _run(plan: WorkerPlan, events: Any, commands: Any) -> WorkerResult:
    from cluster import routing_trace

    send, close = await _sender(plan)
    if plan.routing_trace:
        routing_trace.enable()  # after the warm-up, whose decision is not the trace's
    gc.freeze()  # start-up is over: later collections skip its objects
    events.put(("ready", plan.proc, None))
    kind, start_wall_s = await asyncio.get_running_loop().run_in_executor(None, commands.get)
    assert kind == "go", kind
    t0 = time.perf_counter() + (start_wall_s - time.time())
    records = {
        s.index: RequestRecord(s.index, len(s.prompt_token_ids), s.max_tokens, s.arrival_s)
        for s in plan.requests
    }
    result = WorkerResult(plan.proc, [])
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    monitor = asyncio.create_task(_monitor(result, records, events, plan.proc))
    if plan.concurrency is None:
        last_arrival_s = max((s.arrival_s for s in plan.requests), default=0.0)
        tasks = await _open_loop(send, plan, records, t0)
    else:
        last_arrival_s = 0.0
        tasks = await _closed_loop(send, plan, records, t0)
    deadline_s = t0 + last_arrival_s + plan.timeout_s - time.perf_counter()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    monitor.cancel()
    result.wall_s = time.perf_counter() - wall0
    result.cpu_s = time.process_time() - cpu0
    result.records = list(records.values())
    result.routing_rows, result.routing_rows_dropped = routing_trace.drain()
    await close()
    return result
