"""Routing decision time: Admission.admit + reserve, as the Serve adapter calls them, per policy.

    python -m bench.router --replicas 16 100 1000

Each replica publishes a ReplicaStats snapshot every --stats-period-ms (phases
staggered, a new object each time, as the adapter's decode cache hands them
over) carrying --num-hashes cached prefix hashes, some of them chains of shared
prompt prefixes so prefix matching finds hits. Requests arrive at
--rate-per-replica x replicas per second; the reservation book starts full with
one stats period of requests in flight, so expiry and charging do steady-state
work. A decision is timed from admit() to the end of reserve(), prompt hashing
included (the adapter builds a fresh RouteRequest per call). The setup's objects
are gc.freeze()d before timing, as the engine does after start-up. CPU only.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass, replace

from bench.common import markdown_table, percentile, write_json
from replica.hashing import prefix_block_hashes
from replica.stats import ReplicaStats
from router import Admission, RouterConfig, RouteRequest

POLICIES = ("kv", "prefix", "pow2")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Scenario:
    num_replicas: int
    num_hashes: int = 2048
    num_blocks_total: int = 8192
    rate_per_replica: float = 50.0
    stats_period_s: float = 0.1
    num_prefixes: int = 16
    prefix_len: int = 512
    suffix_len: int = 256
    seed: int = 0

    @property
    def rate(self) -> float:
        return self.rate_per_replica * self.num_replicas


class Fleet:
    """Snapshots of every replica at a simulated time, new objects only when a period turns."""

    def __init__(self, scenario: Scenario, rng: random.Random) -> None:
        self.scenario = scenario
        self.prefixes = [
            [rng.randrange(50_000) for _ in range(scenario.prefix_len)]
            for _ in range(scenario.num_prefixes)
        ]
        chains = [prefix_block_hashes(p, BLOCK_SIZE) for p in self.prefixes]
        self.phases_s = [
            rng.random() * scenario.stats_period_s for _ in range(scenario.num_replicas)
        ]
        self.snapshots: list[ReplicaStats] = []
        total = scenario.num_blocks_total
        for i in range(scenario.num_replicas):
            hashes: list[int] = []
            for chain in rng.sample(chains, 2):
                hashes += chain[: rng.randrange(1, len(chain) + 1)]
            hashes += [rng.getrandbits(64) for _ in range(scenario.num_hashes - len(hashes))]
            # Loads within the prefix policy's balance band, so it ranks by cache affinity.
            used = rng.randrange(total * 40 // 100, total * 46 // 100)
            cached = rng.randrange(0, (total - used) // 2)
            self.snapshots.append(
                ReplicaStats(
                    replica_id=f"replica-{i}",
                    num_blocks_total=total,
                    num_blocks_free=total - used - cached,
                    num_blocks_cached=cached,
                    kv_usage=used / total,
                    num_running=64,
                    num_waiting=2,
                    num_preempted_total=0,
                    max_num_seqs=256,
                    tokens_per_s=5000.0,
                    block_size=BLOCK_SIZE,
                    num_waiting_tokens=rng.randrange(0, 4096),
                    cached_prefix_hashes=tuple(hashes),
                    timestamp_s=-1.0,
                )
            )

    def stats_at(self, now_s: float) -> list[ReplicaStats]:
        period_s = self.scenario.stats_period_s
        for i, s in enumerate(self.snapshots):
            phase_s = self.phases_s[i]
            stamp_s = phase_s + ((now_s - phase_s) // period_s) * period_s
            if stamp_s != s.timestamp_s:
                # A new tuple object, as a fresh msgpack decode gives the adapter.
                hashes = tuple(list(s.cached_prefix_hashes))
                self.snapshots[i] = replace(s, timestamp_s=stamp_s, cached_prefix_hashes=hashes)
        return list(self.snapshots)


def measure(
    policy: str, scenario: Scenario, num_decisions: int, max_s: float, warmup: int = 20
) -> dict:
    rng = random.Random(scenario.seed)
    fleet = Fleet(scenario, rng)
    admission = Admission(RouterConfig(policy=policy, seed=scenario.seed))
    interval_s = 1.0 / scenario.rate
    now_s = 10.0
    # One stats period of requests in flight, spread over replicas and over the period.
    num_in_flight = int(scenario.rate * scenario.stats_period_s)
    for n in range(num_in_flight):
        request = RouteRequest(f"old-{n}", num_prompt_tokens=scenario.prefix_len)
        replica_id = f"replica-{rng.randrange(scenario.num_replicas)}"
        admission.reserve(request, replica_id, now_s - scenario.stats_period_s * n / num_in_flight)
    # The fleet's snapshots are the bulk of this heap and live long, as in a router
    # process; frozen, so the collector's full passes do not scan them during timing
    # (unfrozen they cost ~200 us per decision at 1,000 replicas of 2,048 hashes).
    gc.collect()
    gc.freeze()
    times_ns: list[int] = []
    deadline = time.perf_counter() + max_s
    for n in range(warmup + num_decisions):
        now_s += interval_s
        stats = fleet.stats_at(now_s)
        prompt = fleet.prefixes[rng.randrange(len(fleet.prefixes))] + [
            rng.randrange(50_000) for _ in range(scenario.suffix_len)
        ]
        request = RouteRequest(f"q{n}", tuple(prompt), max_tokens=128)
        start_ns = time.perf_counter_ns()
        decision = admission.admit(stats, request, now_s)
        if decision.admitted:
            admission.reserve(request, decision.tiers[0][0], now_s)
        elapsed_ns = time.perf_counter_ns() - start_ns
        if n >= warmup:
            times_ns.append(elapsed_ns)
            if time.perf_counter() > deadline:
                break
    gc.unfreeze()
    us = [t / 1e3 for t in times_ns]
    p50 = percentile(us, 50)
    return {
        "policy": policy,
        "replicas": scenario.num_replicas,
        "decisions": len(us),
        "p50_us": p50,
        "p99_us": percentile(us, 99),
        "p50_us_per_replica": p50 / scenario.num_replicas,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 100, 1000])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--decisions", type=int, default=1000)
    p.add_argument("--max-s", type=float, default=20.0, help="time cap per (policy, replicas)")
    p.add_argument("--num-hashes", type=int, default=2048)
    p.add_argument("--rate-per-replica", type=float, default=50.0)
    p.add_argument("--stats-period-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args()

    rows = []
    for num_replicas in args.replicas:
        scenario = Scenario(
            num_replicas=num_replicas,
            num_hashes=args.num_hashes,
            rate_per_replica=args.rate_per_replica,
            stats_period_s=args.stats_period_ms / 1e3,
            seed=args.seed,
        )
        for policy in args.policies:
            rows.append(measure(policy, scenario, args.decisions, args.max_s))
            print(markdown_table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    print()
    print(markdown_table(rows, list(rows[0])))
    write_json(args.out, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
