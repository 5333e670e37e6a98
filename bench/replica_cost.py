"""What kvfleet's own replica code costs per request, without Serve or Ray.

    python -m bench.replica_cost [--requests 3000] [--users 32] [--max-tokens 4]
                                 [--engine-thread] [--step-ms 1] [--callers 1]

Drives LLMServer in this process (no Serve: its submit generator is called directly,
as Serve would call it) with a FakeEngine, a closed loop of --users concurrent
requests from one caller, and prints requests/s and CPU per request of this process
(LLMServer's loop, the engine-pipe reader, and this driver's own submit/decode, which
a Serve caller would do instead) and, with the engine in a child process, of the
child. Serve's and Ray's per-request work in a real replica process comes on top:
compare with bench.load's per-replica "process CPU" over its submits/s.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time

from bench.cluster import fake_engine
from cluster.config import ClusterConfig
from cluster.deployment import LLMServer
from cluster.messages import CarrierBatch, SubmitRequest, decode_message


async def _drive(
    server: LLMServer, num_requests: int, num_users: int, max_tokens: int, num_callers: int = 1
) -> float:
    loop = asyncio.get_running_loop()
    ids = iter(range(num_requests))
    ends: dict[str, asyncio.Future] = {}
    carriers: list[asyncio.Task] = []

    async def carry(stream) -> None:  # a carrier stream: end each request it finishes
        async for data in stream:
            message = decode_message(data)
            if isinstance(message, CarrierBatch):
                for step in message.steps:
                    for delta in step.deltas():
                        if delta.finish_reason is not None:
                            ends.pop(delta.request_id).set_result(None)

    async def user(caller_id: str) -> None:
        for i in ids:
            rid = f"q{i}"
            end = ends[rid] = loop.create_future()
            params = {"max_tokens": max_tokens, "ignore_eos": True}
            stream = server.submit(SubmitRequest(rid, caller_id, [1, 2, 3], params).to_wire())
            await stream.__anext__()  # the ack; a carrier goes on streaming
            carriers.append(asyncio.ensure_future(carry(stream)))
            await end

    start = time.perf_counter()
    await asyncio.gather(*(user(f"c{u % num_callers}") for u in range(num_users)))
    elapsed = time.perf_counter() - start
    for task in carriers:
        task.cancel()
    return elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.replica_cost", description=__doc__)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--callers", type=int, default=1, help="caller ids the users are spread over "
        "(each has its own carrier, as each client process does)",
    )  # fmt: skip
    p.add_argument("--step-ms", type=float, default=1.0, help="FakeEngine step time")
    p.add_argument("--engine-thread", action="store_true", help="engine on a thread")
    args = p.parse_args(argv)
    config = ClusterConfig(
        model="fake", device="cpu", stats_period_s=0.05, engine_process=not args.engine_thread
    )
    factory = functools.partial(fake_engine, step_s=args.step_ms / 1e3)
    server = LLMServer(config, 0.0, factory, replica_id="r0")
    try:

        async def run() -> tuple[float, dict, dict]:
            before = await server.serving_counters()
            elapsed = await _drive(server, args.requests, args.users, args.max_tokens, args.callers)
            return elapsed, before, await server.serving_counters()

        elapsed, before, after = asyncio.run(run())
    finally:
        server.shutdown()
    n = args.requests
    line = (
        f"{n / elapsed:.0f} req/s; this process {1e3 * (after['cpu_s'] - before['cpu_s']) / n:.3f}"
        f" ms CPU per request"
    )
    if after["engine_cpu_s"] is not None:
        child_ms = 1e3 * (after["engine_cpu_s"] - before["engine_cpu_s"]) / n
        line += f", engine child {child_ms:.3f} ms"
    print(line + f"; {after['messages'] - before['messages']} carrier messages")


if __name__ == "__main__":
    main()
