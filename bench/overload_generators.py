"""bench.overload's client: generator processes and the shares of load they send.

The client runs in spawned generator processes (GeneratorPool), started once for a whole
run: a share of the capacity loop's users (ClosedLoopShare) or of a step's Poisson
arrivals (OpenLoopShare) goes to each, and each runs its share on its own event loop and
aiohttp session, timed from one shared wall-clock start, then sends back its records and
its CPU use.
"""

from __future__ import annotations

import asyncio
import gc
import math
import multiprocessing as mp
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
import numpy as np

from bench.load_http import open_session, send_one_http
from bench.load_metrics import RequestRecord
from bench.load_workload import RequestSpec

REJECTED_PAUSE_S = 0.05  # a closed-loop user refused with 503 waits this, then sends again
CAPACITY_WARMUP = 1 / 3  # of the closed loop's time, left out of its rate
# One generator process per this many offered req/s: on the H200 run (1,024-token prompts,
# 64-token streams) one process used 0.77 of a core at 220 req/s, so 150 keeps each near 0.5.
RATE_PER_PROC_RPS = 150.0
START_DELAY_S = 0.5  # from handing out the shares to their time zero: every process on time
READY_TIMEOUT_S = 120.0  # a spawned generator's imports (numpy, aiohttp, torch via bench.common)


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    vocab_size: int
    timeout_s: float  # the client's: a request with no outcome by then is lost

    def spec(self, index: int, rng: np.random.Generator, arrival_s: float = 0.0) -> RequestSpec:
        # Random prompts: no two share a cached prefix, so every step costs the same.
        tokens = rng.integers(0, self.vocab_size - 1, self.input_len).tolist()
        return RequestSpec(index, tokens, self.output_len, arrival_s)


async def send(
    session: aiohttp.ClientSession, url: str, spec: RequestSpec, t0: float, timeout_s: float
) -> RequestRecord:
    record = RequestRecord(spec.index, len(spec.prompt_token_ids), spec.max_tokens, spec.arrival_s)
    try:
        await asyncio.wait_for(send_one_http(session, url, spec, record, t0), timeout_s)
    except TimeoutError:
        record.error_message = f"no outcome within the client timeout ({timeout_s:g} s)"
    return record


def time_zero(start_wall_s: float) -> float:
    """The shared start, a wall-clock time, on this process's perf_counter."""
    return time.perf_counter() + (start_wall_s - time.time())


@dataclass(frozen=True)
class ClosedLoopShare:
    """One generator's part of the capacity loop: num_users back-to-back streaming users
    from the shared start for duration_s."""

    url: str
    workload: Workload
    num_users: int
    duration_s: float
    seed: int
    proc: int
    start_wall_s: float

    async def run(self) -> tuple[int, float]:
        """(completions within the counted window, CPU fraction of one core): the users
        start together, so completions before CAPACITY_WARMUP of duration_s come late and
        would understate the rate."""
        rng = np.random.default_rng((self.seed, self.proc))
        t0 = time_zero(self.start_wall_s)
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        cpu0 = time.process_time()
        done: list[RequestRecord] = []
        start_s = CAPACITY_WARMUP * self.duration_s
        timeout_s = self.workload.timeout_s

        async def user(session: aiohttp.ClientSession) -> None:
            while time.perf_counter() - t0 < self.duration_s:
                spec = self.workload.spec(len(done), rng)
                record = await send(session, self.url, spec, t0, timeout_s)
                if record.outcome == "ok" and start_s <= record.end_s <= self.duration_s:
                    done.append(record)
                elif record.outcome != "ok":
                    await asyncio.sleep(REJECTED_PAUSE_S)

        async with open_session() as session:
            await asyncio.gather(*(user(session) for _ in range(self.num_users)))
        wall_s = time.perf_counter() - t0
        return len(done), (time.process_time() - cpu0) / wall_s if wall_s > 0 else math.nan


@dataclass(frozen=True)
class OpenLoopResult:
    records: list[RequestRecord]
    cpu_fraction: float  # of one core, over this share's arrivals (what delays them)
    cpu_s: float  # from the start to this share's last response
    last_response_s: float  # from the shared start


@dataclass(frozen=True)
class OpenLoopShare:
    """One generator's part of an open-loop step: the arrivals (offsets from the shared
    start) of requests first_index, first_index + stride, ... of the step's Poisson trace."""

    url: str
    workload: Workload
    arrivals_s: list[float]
    first_index: int
    stride: int
    seed: int
    start_wall_s: float

    async def run(self) -> OpenLoopResult:
        """Send each request at its arrival, streamed under the client timeout; the
        records once every one has an outcome."""
        rng = np.random.default_rng((self.seed, self.first_index))
        t0 = time_zero(self.start_wall_s)
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        cpu0 = time.process_time()
        timeout_s = self.workload.timeout_s
        async with open_session() as session:
            tasks = []
            for j, arrival_s in enumerate(self.arrivals_s):
                delay_s = arrival_s - (time.perf_counter() - t0)
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                spec = self.workload.spec(self.first_index + j * self.stride, rng, arrival_s)
                tasks.append(asyncio.ensure_future(send(session, self.url, spec, t0, timeout_s)))
            arrivals_cpu_s = time.process_time() - cpu0
            arrivals_wall_s = time.perf_counter() - t0
            records = await asyncio.gather(*tasks)
        return OpenLoopResult(
            list(records),
            arrivals_cpu_s / arrivals_wall_s if arrivals_wall_s > 0 else math.nan,
            time.process_time() - cpu0,
            time.perf_counter() - t0,
        )


Share = ClosedLoopShare | OpenLoopShare


def _generator_main(conn: mp.connection.Connection) -> None:
    """A generator process (spawned): run each share it is handed on a fresh uvloop (a Ray
    Serve dependency; asyncio's own loop spends more per wake-up, one per streamed chunk)
    and send back its result, or the traceback of its failure; None ends it."""
    import uvloop

    gc.freeze()  # imports are done: collections triggered per chunk skip their objects
    conn.send("ready")
    while (share := conn.recv()) is not None:
        try:
            conn.send(uvloop.run(share.run()))
        except Exception:
            conn.send(traceback.format_exc())


class GeneratorPool:
    """num_procs spawned generator processes (never forked: the parent may be a Ray
    driver), each with its own event loop and aiohttp session per share, and a pipe; the
    same processes serve every step. A failed or dead process fails the run: its requests
    would have no outcome."""

    def __init__(self, num_procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[mp.connection.Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for _ in range(num_procs):
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_generator_main, args=(child_conn,), daemon=True)
            proc.start()
            child_conn.close()
            self.conns.append(conn)
            self.procs.append(proc)
        for p in range(num_procs):
            if not self.conns[p].poll(READY_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"generator process {p} not ready in {READY_TIMEOUT_S:g} s")
            self._check(p, self._recv(p))
        self.executor = ThreadPoolExecutor(num_procs)  # one blocking recv per process

    @property
    def num_procs(self) -> int:
        return len(self.procs)

    async def run(self, shares: list[Share]) -> list:
        """Each process runs its share (shares[p]); their results, by process."""
        if len(shares) != self.num_procs:
            raise ValueError(f"shares: {len(shares)} for {self.num_procs} generator processes")
        for conn, share in zip(self.conns, shares):
            conn.send(share)
        loop = asyncio.get_running_loop()
        replies = await asyncio.gather(
            *(loop.run_in_executor(self.executor, self._recv, p) for p in range(self.num_procs))
        )
        for p, reply in enumerate(replies):
            self._check(p, reply)
        return list(replies)

    def shrink(self, num_procs: int) -> None:
        """Stop all but the first num_procs processes."""
        for p in range(num_procs, self.num_procs):
            self._stop(p)
        del self.conns[num_procs:], self.procs[num_procs:]

    def close(self) -> None:
        for p in range(self.num_procs):
            self._stop(p)
        if hasattr(self, "executor"):
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _recv(self, p: int) -> object:
        try:
            return self.conns[p].recv()
        except EOFError:
            self.procs[p].join(timeout=5)
            return f"generator process exited with code {self.procs[p].exitcode}"

    def _check(self, p: int, reply: object) -> None:
        if isinstance(reply, str) and reply != "ready":
            raise RuntimeError(f"generator process {p} failed:\n{reply}")

    def _stop(self, p: int) -> None:
        try:
            self.conns[p].send(None)
        except (BrokenPipeError, OSError):
            pass  # already gone
        self.procs[p].join(timeout=10)
        if self.procs[p].exitcode is None:
            self.procs[p].kill()
        self.conns[p].close()


def default_num_procs(rate_rps: float | None, num_cpus: int) -> int:
    """One process per RATE_PER_PROC_RPS offered (rate None: unknown, as many as allowed),
    at most the host's cores less two (the server's proxy and ingress share the host), at
    least one."""
    most = max(1, num_cpus - 2)
    if rate_rps is None:
        return most
    return min(most, max(1, math.ceil(rate_rps / RATE_PER_PROC_RPS)))
