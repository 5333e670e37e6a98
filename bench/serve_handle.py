"""What one Serve handle call costs, caller and replica: where the router runs, how calls travel.

    python -m bench.serve_handle [--callers 1 8]   # CPU is enough: no model, an echo deployment

A bare echo deployment (no kvfleet code on the replica), called through four handles
in the same run: the router on a loop thread of its own (Serve's default) or on the
calling loop (what Client(route_on_caller_loop=True) uses), each reaching the replica
by Ray actor calls (Serve's default) or through the replica's gRPC server
(`_by_reference=False`, what Client uses unless serve_grpc=False). Per kind: latency
p50/p90 at concurrency 1 of a unary call, of a streaming call's first item and of a
whole one-item stream; then calls/s, and the caller's and the replica process's CPU
per call, at concurrency 200. The replica runs with kvfleet's replica env vars
(cluster.app.REPLICA_ENV_VARS: its methods on the replica's main loop), so its CPU per
call is the floor under each Serve call a kvfleet replica takes (a submit is a
one-item stream when it attaches to a carrier). `--callers 1 8` adds the concurrent
figures from that many caller processes at once (Ray actors calling as Client does),
the same concurrency in all: whether a replica's CPU per call grows with its callers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from bench.common import machine_description, markdown_table, percentile, write_json


class Echo:
    async def unary(self, x: int) -> int:
        return x

    async def stream(self, x: int) -> Any:
        yield x

    async def cpu_s(self) -> float:
        """This replica process's CPU time so far (every thread)."""
        times = os.times()
        return times.user + times.system


async def _one(handle: Any, kind: str) -> float:
    t0 = time.perf_counter()
    if kind == "unary":
        await handle.options(method_name="unary").remote(1)
        return time.perf_counter() - t0
    gen = handle.options(method_name="stream", stream=True).remote(1)
    await gen.__anext__()
    first_s = time.perf_counter() - t0
    async for _ in gen:
        pass
    return first_s if kind == "stream first item" else time.perf_counter() - t0


async def concurrent(
    handle: Any, kind: str, num_calls: int, concurrency: int
) -> tuple[float, float]:
    """num_calls calls of kind, concurrency in flight: (wall, this process's CPU) seconds."""
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> None:
        async with gate:
            await _one(handle, kind)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(num_calls)))
    return time.perf_counter() - t0, time.process_time() - cpu0


def throughput_row(kind: str, concurrency: int, num_calls: int, wall_s: float, caller_cpu_s: float,
                   replica_cpu_s: float) -> dict:  # fmt: skip
    return {"call": kind, "concurrency": concurrency, "calls_per_s": num_calls / wall_s,
            "caller_cpu_ms_per_call": caller_cpu_s / num_calls * 1e3,
            "replica_cpu_ms_per_call": replica_cpu_s / num_calls * 1e3}  # fmt: skip


async def warm(handle: Any) -> None:
    for _ in range(20):  # the router, the replica's queue-length cache
        await _one(handle, "unary")
        await _one(handle, "stream")


async def measure(handle: Any, n: int, concurrency: int) -> list[dict]:
    await warm(handle)
    rows = []
    for kind in ("unary", "stream first item", "stream"):
        lat = [await _one(handle, kind) for _ in range(n)]
        rows.append({"call": kind, "concurrency": 1, "p50_ms": percentile(lat, 50) * 1e3,
                     "p90_ms": percentile(lat, 90) * 1e3})  # fmt: skip
    for kind in ("unary", "stream"):
        num_calls = 10 * n
        replica0 = await handle.options(method_name="cpu_s").remote()
        wall_s, cpu_s = await concurrent(handle, kind, num_calls, concurrency)
        replica_s = await handle.options(method_name="cpu_s").remote() - replica0
        rows.append(throughput_row(kind, concurrency, num_calls, wall_s, cpu_s, replica_s))
    return rows


class Caller:
    """A caller process (a Ray actor) calling the echo replica as Client does: Serve's
    router on its thread, gRPC."""

    async def start(self) -> None:
        from ray.serve.handle import DeploymentHandle

        self.handle = DeploymentHandle("Echo", "echo").options(_by_reference=False)
        await warm(self.handle)

    async def run(self, kind: str, num_calls: int, concurrency: int) -> tuple[float, float]:
        return await concurrent(self.handle, kind, num_calls, concurrency)


def many_callers(num_callers: int, n: int, concurrency: int) -> list[dict]:
    """The concurrent figures from num_callers processes at once (concurrency in all)."""
    import ray
    from ray.serve.handle import DeploymentHandle

    cpu = DeploymentHandle("Echo", "echo").options(method_name="cpu_s")
    callers = [ray.remote(num_cpus=0)(Caller).remote() for _ in range(num_callers)]
    ray.get([c.start.remote() for c in callers])
    rows = []
    for kind in ("unary", "stream"):
        per_caller = 10 * n // num_callers
        replica0 = cpu.remote().result()
        t0 = time.perf_counter()
        runs = [c.run.remote(kind, per_caller, max(1, concurrency // num_callers)) for c in callers]
        results = ray.get(runs)
        wall_s = time.perf_counter() - t0
        replica_s = cpu.remote().result() - replica0
        caller_s = sum(r[1] for r in results)
        num_calls = num_callers * per_caller
        rows.append(throughput_row(kind, concurrency, num_calls, wall_s, caller_s, replica_s))
    for c in callers:
        ray.kill(c)
    return rows


KINDS = (
    "router thread, actor calls (Serve's default)",
    "router on caller loop, actor calls",
    "router thread, gRPC",
    "router on caller loop, gRPC",
)


def main() -> None:
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    from cluster.app import REPLICA_ENV_VARS
    from cluster.client import current_loop_handle

    parser = argparse.ArgumentParser(prog="python -m bench.serve_handle", description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="calls per latency figure")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument(
        "--callers", type=int, nargs="*", default=[],
        help="also the concurrent figures from this many caller processes (Ray actors; gRPC)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        actor_options = {"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV_VARS}}
        deployment = serve.deployment(
            Echo, max_ongoing_requests=1 << 16, ray_actor_options=actor_options
        )
        serve.run(deployment.bind(), name="echo", route_prefix=None)
        rows = []
        for kind in KINDS:

            async def run(kind: str = kind) -> list[dict]:
                if kind.startswith("router on caller loop"):
                    handle = current_loop_handle("echo", "Echo")
                else:
                    handle = DeploymentHandle("Echo", "echo")
                if kind.endswith("gRPC"):
                    handle = handle.options(_by_reference=False)
                result = await measure(handle, args.calls, args.concurrency)
                await handle.shutdown_async()
                return result

            rows += [{"handle": kind, **row} for row in asyncio.run(run())]
        for num_callers in args.callers:
            label = f"{num_callers} caller processes, router thread, gRPC"
            caller_rows = many_callers(num_callers, args.calls, args.concurrency)
            rows += [{"handle": label, **row} for row in caller_rows]
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\n{machine_description()}, {time.strftime('%Y-%m-%d')}\n")
    columns = ["handle", "call", "concurrency", "p50_ms", "p90_ms", "calls_per_s",
               "caller_cpu_ms_per_call", "replica_cpu_ms_per_call"]  # fmt: skip
    print(markdown_table(rows, columns))
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
