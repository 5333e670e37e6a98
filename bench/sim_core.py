"""The cluster simulator's core: SimConfig and simulate(), the discrete-event loop that
routes a trace over SimReplicas with router/'s policies (bench.sim is its command line,
bench.sim_validate replays a bench.load run through it)."""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bench.sim_model import CostModel
from bench.sim_policies import HELD, REJECTED, SimRouter, make_sim_router
from bench.sim_replica import ReplicaSimConfig, SimReplica
from bench.sim_report import summarize
from bench.sim_workload import Workload
from replica.config_flags import config_from_args
from router import RouterConfig
from router.load import imbalanced_at_watermark

_STEP, _PUBLISH, _RETRY, _ADMIT, _SAMPLE, _CONTROL, _READY = 0, 1, 2, 3, 4, 5, 6
DEFAULT_NUM_BLOCKS = 8192


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 4
    replica: ReplicaSimConfig = field(default_factory=ReplicaSimConfig)
    stats_period_s: float = 0.05
    stats_delay_s: float = 0.1
    slo_ttft_s: float = 0.25
    slo_tpot_s: float = 0.01
    seed: int = 0
    # None: open loop at the trace's arrival times. N: closed loop, N users each
    # sending the next request of the trace when their previous one ends.
    concurrency: int | None = None
    router: RouterConfig | None = None  # the real policies' config (None: defaults, seed)
    # Independent routers, as Serve runs one per handle and proxy: request i is routed
    # by router i % num_routers, each with its own reservations (or in-flight counts),
    # all seeing the same snapshots. Many routers on stale snapshots herd.
    num_routers: int = 1
    # Each replica's request path (its Serve process: the submit call, the ack, the
    # pipe to the engine): one request at a time, this long each, before the engine
    # sees it. 0: requests reach the engine when routed (GPU-bound replicas). Measured
    # capacity of a gpt2 replica on an H200: 627-809 submits/s, ~1.2-1.6 ms each.
    serve_request_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_replicas <= 0:
            raise ValueError(f"num_replicas must be > 0, got {self.num_replicas}")
        if self.stats_period_s <= 0 or self.stats_delay_s < 0:
            raise ValueError("stats_period_s must be > 0 and stats_delay_s >= 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if not self.serve_request_s >= 0:
            raise ValueError(f"serve_request_s must be >= 0, got {self.serve_request_s}")


class ElasticFleet(Protocol):
    """A replica set that changes during a run (bench.sim_autoscale.AutoscaleFleet).

    Slots 0..num_slots-1 each hold a SimReplica; routers see only the routable ones.
    control() runs every period_s and returns (ready_s, token) for replicas it started;
    at ready_s the loop calls ready(token), which puts a fresh replica in its slot and
    tells the routers (None: that start was cancelled meanwhile). on_idle() is called
    when a replica's step ends with nothing left to run (a draining one then stops).
    """

    num_slots: int
    period_s: float

    def make_router(self, name: str, workload: Workload, num_slots: int, max_blocks: int,
                    seed: int, router_config: RouterConfig | None) -> SimRouter: ...  # fmt: skip

    def bind(self, replicas: list[SimReplica], routers: list[SimRouter],
             new_replica: Callable[[int], SimReplica]) -> None: ...  # fmt: skip

    def is_routable(self, index: int) -> bool: ...

    def control(self, now_s: float, num_held: int) -> list[tuple[float, int]]: ...

    def ready(self, token: int, now_s: float) -> int | None: ...

    def on_idle(self, index: int, now_s: float) -> None: ...

    def all_replicas(self) -> list[SimReplica]: ...


class KVBalance:
    """KV usage across the replicas, sampled every stats period: the widest spread
    (max - min used fraction) and how often one replica sat at the watermark
    (committed: used + queued prompt blocks) while another was under half full."""

    def __init__(self, replicas: list[SimReplica], high_watermark: float) -> None:
        self.replicas = replicas
        self.high_watermark = high_watermark
        self.num_samples = 0
        self.num_imbalanced = 0
        self.max_spread = 0.0

    def sample(self) -> None:
        used = [r.num_used_blocks / r.config.num_blocks for r in self.replicas]
        committed = max(
            (r.num_used_blocks + r.num_waiting_blocks) / r.config.num_blocks for r in self.replicas
        )
        self.num_samples += 1
        self.max_spread = max(self.max_spread, max(used) - min(used))
        self.num_imbalanced += imbalanced_at_watermark(committed, min(used), self.high_watermark)

    def metrics(self) -> dict:
        return {
            "max_kv_usage_spread": self.max_spread,
            "watermark_imbalance_frac": self.num_imbalanced / max(1, self.num_samples),
        }


class Arrivals:
    """When each request arrives: the trace's times (open loop), or, closed loop, as
    `concurrency` users each send the next request in trace order when one ends."""

    def __init__(self, workload: Workload, concurrency: int | None) -> None:
        n = len(workload)
        self.n = n
        self.closed = concurrency is not None
        if concurrency is None:
            self.times = workload.arrival_s.tolist()
            self.num_released = n
        else:
            self.num_released = min(concurrency, n)
            self.times = [0.0] * self.num_released + [math.inf] * (n - self.num_released)
        self.next = 0

    def peek_s(self) -> float:
        return self.times[self.next] if self.next < self.num_released else math.inf

    def pop(self) -> int:
        rid = self.next
        self.next += 1
        return rid

    def on_done(self, now_s: float, num_done: int) -> None:
        """num_done requests ended (completed or rejected) at now_s."""
        if not self.closed:
            return
        for _ in range(min(num_done, self.n - self.num_released)):
            self.times[self.num_released] = now_s
            self.num_released += 1


def simulate(
    policy: str,
    workload: Workload,
    config: SimConfig,
    cost: CostModel,
    keep_times: bool = False,
    fleet: ElasticFleet | None = None,
) -> dict:
    """Run one policy over the trace; return its metrics (see bench.sim_report.summarize),
    and with keep_times each request's arrival_s, first_token_s and finish_s (-1: none).
    With a fleet, the replica set changes as it decides (ElasticFleet); else it is
    config.num_replicas throughout.

    The cyclic garbage collector is off for the run: the loop makes no reference
    cycles, and its full passes over the millions of live objects of a large run
    (sequences, snapshots, hash summaries) cost more than the routing itself
    (measured: 300 us per decision at 1,000 replicas, against ~50 us without).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(policy, workload, config, cost, keep_times, fleet)
    finally:
        if was_enabled:
            gc.enable()


def _simulate(
    policy: str,
    workload: Workload,
    config: SimConfig,
    cost: CostModel,
    keep_times: bool,
    fleet: ElasticFleet | None,
) -> dict:
    wall_start = time.perf_counter()
    workload.set_block_size(config.replica.block_size)
    n = len(workload)
    first_token_s = [-1.0] * n
    finish_s = [-1.0] * n
    num_slots = config.num_replicas if fleet is None else fleet.num_slots

    def new_replica(i: int) -> SimReplica:
        return SimReplica(i, config.replica, cost, workload, first_token_s, finish_s)

    replicas = [new_replica(i) for i in range(num_slots)]
    make_router = make_sim_router if fleet is None else fleet.make_router
    routers = [
        make_router(
            policy,
            workload,
            num_slots,
            config.replica.num_blocks,
            config.seed + k,
            config.router or RouterConfig(seed=config.seed),
        )  # fmt: skip
        for k in range(config.num_routers)
    ]
    num_routers, router = len(routers), routers[0]  # router: what they all are
    if fleet is not None:
        fleet.bind(replicas, routers, new_replica)
    heap: list[tuple] = []
    counter = 0
    visible: deque = deque()
    publishing: set[int] = set()  # replicas whose _PUBLISH chain is on the heap
    if router.needs_stats:
        for i, r in enumerate(replicas):
            if fleet is not None and not fleet.is_routable(i):
                continue
            publishing.add(i)
            snapshot = r.stats(0.0, router.needs_hashes)
            for each in routers:
                each.observe(i, snapshot)
            offset_s = config.stats_period_s * (i + 1) / config.num_replicas
            heap.append((offset_s, counter, _PUBLISH, i))
            counter += 1
        heapq.heapify(heap)
    balance = KVBalance(replicas, (config.router or RouterConfig()).high_watermark)
    heapq.heappush(heap, (0.0, counter, _SAMPLE, None))
    counter += 1
    if fleet is not None:
        heapq.heappush(heap, (0.0, counter, _CONTROL, None))
        counter += 1
    arrivals = Arrivals(workload, config.concurrency)
    serve_request_s = config.serve_request_s
    path_free_s = [0.0] * config.num_replicas  # when each replica's request path is free

    def admit(replica: int, rid: int, now: float) -> None:
        """The replica's engine takes the request; an idle replica starts a step."""
        nonlocal counter
        r = replicas[replica]
        r.add(rid)
        if not r.busy:
            end_s = r.schedule(now)
            if end_s is not None:
                heapq.heappush(heap, (end_s, counter, _STEP, replica))
                counter += 1

    num_done, num_rejected, num_held = 0, 0, 0
    num_holding = 0  # requests held at a router now, waiting for a retry
    route_s, num_decisions = 0.0, 0
    stats_delay_s, stats_period_s = config.stats_delay_s, config.stats_period_s
    tracks = router.tracks_progress
    while num_done < n:
        t_arrival = arrivals.peek_s()
        if heap and heap[0][0] <= t_arrival:
            now, _, kind, arg = heapq.heappop(heap)
            if kind == _STEP:
                r = replicas[arg]
                r.complete_step(now)
                if tracks:
                    for rid in r.first_tokens:
                        routers[rid % num_routers].on_first_token(rid, arg)
                    for rid in r.finished:
                        routers[rid % num_routers].on_finish(rid, arg)
                if r.finished:
                    num_done += len(r.finished)
                    arrivals.on_done(now, len(r.finished))
                end_s = r.schedule(now)
                if end_s is not None:
                    heapq.heappush(heap, (end_s, counter, _STEP, arg))
                    counter += 1
                elif fleet is not None:
                    fleet.on_idle(arg, now)
                continue
            if kind == _ADMIT:
                admit(*arg, now)
                continue
            if kind == _SAMPLE:
                balance.sample()
                # Not alone on the heap: a stalled run must still reach the check below.
                if num_done < n and (heap or arrivals.peek_s() < math.inf):
                    heapq.heappush(heap, (now + stats_period_s, counter, _SAMPLE, None))
                    counter += 1
                continue
            if kind == _CONTROL:
                for ready_s, token in fleet.control(now, num_holding):
                    heapq.heappush(heap, (ready_s, counter, _READY, token))
                    counter += 1
                if num_done < n:
                    heapq.heappush(heap, (now + fleet.period_s, counter, _CONTROL, None))
                    counter += 1
                continue
            if kind == _READY:
                i = fleet.ready(arg, now)
                if i is not None and router.needs_stats and i not in publishing:
                    publishing.add(i)
                    heapq.heappush(heap, (now + stats_period_s, counter, _PUBLISH, i))
                    counter += 1
                continue
            if kind == _PUBLISH:
                if fleet is not None and not fleet.is_routable(arg):
                    publishing.discard(arg)  # drained or stopped: it publishes no more
                    continue
                visible.append(
                    (now + stats_delay_s, arg, replicas[arg].stats(now, router.needs_hashes))
                )
                heapq.heappush(heap, (now + stats_period_s, counter, _PUBLISH, arg))
                counter += 1
                continue
            rid, attempt, held_since_s = arg
        elif t_arrival == math.inf:
            raise RuntimeError(f"simulation stalled with {n - num_done} requests unfinished")
        else:
            now, rid, attempt, held_since_s = t_arrival, arrivals.pop(), 0, t_arrival
        while visible and visible[0][0] <= now:
            _, i, snapshot = visible.popleft()
            if fleet is not None and not fleet.is_routable(i):
                continue  # published before its drain began: the routers have let it go
            for each in routers:
                each.observe(i, snapshot)
        t0 = time.perf_counter()
        replica, retry_after_s = routers[rid % num_routers].route(rid, now, attempt, held_since_s)
        route_s += time.perf_counter() - t0
        num_decisions += 1
        if replica == HELD:
            num_holding += attempt == 0
        elif attempt > 0:
            num_holding -= 1
        if replica >= 0 and serve_request_s:
            admit_s = max(now, path_free_s[replica]) + serve_request_s
            path_free_s[replica] = admit_s
            routers[rid % num_routers].on_admitted(rid, replica, admit_s)
            heapq.heappush(heap, (admit_s, counter, _ADMIT, (replica, rid)))
            counter += 1
        elif replica >= 0:
            admit(replica, rid, now)
        elif replica == HELD:
            num_held += attempt == 0
            heapq.heappush(
                heap, (now + retry_after_s, counter, _RETRY, (rid, attempt + 1, held_since_s))
            )
            counter += 1
        elif replica == REJECTED:
            num_rejected += 1
            num_done += 1
            arrivals.on_done(now, 1)
    wall_s = time.perf_counter() - wall_start
    ran = replicas if fleet is None else fleet.all_replicas()
    result = summarize(workload, ran, arrivals.times, first_token_s, finish_s,
                       config.slo_ttft_s, config.slo_tpot_s)  # fmt: skip
    result |= balance.metrics() | {
        "policy": policy,
        "wall_s": wall_s,
        "num_rejected": num_rejected,
        "num_held": num_held,
        "num_route_calls": num_decisions,
        "route_us_mean": 1e6 * route_s / max(1, num_decisions),
        "route_s_total": route_s,
    }
    if keep_times:
        result |= {"arrival_s": arrivals.times, "first_token_s": first_token_s,
                   "finish_s": finish_s}  # fmt: skip
    return result


def sim_config(args: argparse.Namespace, num_replicas: int, **overrides: object) -> SimConfig:
    """The SimConfig of the command line; overrides replace fields of the replica config
    (num_blocks, block_size, max_num_seqs, ...) or of the SimConfig itself."""
    replica_fields = dict(
        num_blocks=DEFAULT_NUM_BLOCKS if args.num_blocks is None else args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_prefix_hashes_in_stats=args.max_prefix_hashes,
    )  # fmt: skip
    replica_fields |= {k: v for k, v in overrides.items() if k in replica_fields}
    fields = dict(
        num_replicas=num_replicas, replica=ReplicaSimConfig(**replica_fields),
        stats_period_s=args.stats_period_ms / 1e3, stats_delay_s=args.stats_delay_ms / 1e3,
        slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3, seed=args.seed,
        num_routers=args.num_routers,
        concurrency=args.concurrency, serve_request_s=args.serve_request_ms / 1e3,
        router=config_from_args(RouterConfig, args, seed=args.seed),
    )  # fmt: skip
    fields |= {k: v for k, v in overrides.items() if k not in replica_fields}
    return SimConfig(**fields)
