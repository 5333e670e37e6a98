"""Autoscaling in the cluster simulator: a fleet whose replica count a policy decides.

    python -m bench.sim --autoscale kv,serve-default,serve-default:64 --routers kv \
        --min-replicas 1 --max-replicas 8 --replica-start-s 36 \
        --rate-profile 0:20,90:700,150:700,240:20,420:20 --out r.json --plot p.png

AutoscaleFleet (an ElasticFleet for bench.sim_core.simulate) runs a control loop every
--autoscale-period-s. Each tick it records, per running replica, what the real replica
records for Serve (cluster.autoscale.ReplicaMeter): KV usage counting its queue, the
fraction of its sequence slots its running and queued requests fill, queued prompt
tokens, and the prompt tokens it admitted per second over the last 2 s; and,
for Serve's default, the ongoing requests (running and queued on the running replicas,
plus those held at the routers, as Serve counts requests queued in its handles). The
policy sees each series averaged over --look-back-s, as Serve averages what replicas
push, and decides with router.autoscale's code (KVAutoscalePolicy, ServeDefaultPolicy).

- Scale-up: a replica starts in a free slot and becomes routable --replica-start-s
  later (measured on the H200: 35.6 s and 38.1 s for one gpt2 replica including the
  Serve app's deploy), with a cold cache; until then it counts as starting.
- Scale-down: replicas still starting are cancelled first (newest first, as Serve stops
  pending replicas before running ones), then the running replica with the fewest
  requests drains: the routers forget it at once, it finishes what it runs and queues,
  then stops. Nothing is cut or handed back.
- replica_seconds: the time every replica was starting, running or draining (what it
  holds a GPU for), summed, from 0 to the last request's finish.

Policies (--autoscale, comma-separated): `kv` (KVAutoscalePolicy), `serve-default`
(ServeDefaultPolicy at --target-ongoing-requests, Ray 2.60's default 2) and
`serve-default:T` (target T). All take the same bounds and delays (--upscale-delay-s,
--downscale-delay-s), so a comparison isolates the signal; pass Serve's own delays
(30 s, 600 s, look-back 30 s) to run Serve as shipped. The KV policy's forecast assumes
--policy-replica-start-s (ClusterConfig.replica_start_s, 30 s), not the simulated
--replica-start-s, as a deployment would. Routers: kv, prefix, pow2 (the
real router/ code, told of each replica that comes and goes) and serve-pow2, random.

Without --trace, --rate-profile T:RATE,... makes a Poisson trace whose rate rises and
falls piecewise linearly through the points (requests from --dataset's lengths).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from bench.sim_core import SimConfig, simulate
from bench.sim_model import CostModel
from bench.sim_policies import REAL_POLICIES, RandomRouter, ServePow2Router, SimRouter, policy_name
from bench.sim_policies import make_sim_router as make_fixed_router
from bench.sim_replica import SimReplica
from bench.sim_workload import Workload, WorkloadConfig
from replica.validate import number_in, positive_float, positive_int
from router import RouterConfig
from router.autoscale import (
    AutoscaleConfig,
    KVAutoscalePolicy,
    ReplicaLoad,
    ScaleState,
    ServeDefaultPolicy,
)

OFF, STARTING, RUNNING, DRAINING = 0, 1, 2, 3
# cluster.autoscale.RATE_WINDOW_S: the window a replica's prompt-token rate is measured
# over (not imported: cluster pulls in Ray, ~1 s at best, for one number).
RATE_WINDOW_S = 2.0
ELASTIC_ROUTERS = (*REAL_POLICIES, "serve_pow2", "random")
SERVE_DEFAULT = "serve-default"


@dataclass(frozen=True)
class FleetConfig:
    """The autoscaling fleet's settings; the policy's own live in AutoscaleConfig."""

    replica_start_s: float = 36.0  # H200, gpt2, Serve deploy included (35.6 s, 38.1 s)
    period_s: float = 1.0  # the control loop
    look_back_s: float = 5.0  # ClusterConfig.autoscale_look_back_s's default
    initial_replicas: int | None = None  # None: min_replicas

    def __post_init__(self) -> None:
        number_in("replica_start_s", self.replica_start_s, 0.0, math.inf)
        positive_float("autoscale_period_s", self.period_s)
        positive_float("look_back_s", self.look_back_s)
        positive_int("initial_replicas", self.initial_replicas, allow_none=True)


def parse_policy(spec: str, base: AutoscaleConfig) -> tuple[str, AutoscaleConfig]:
    """`kv`, `serve-default` or `serve-default:T` as (label, its AutoscaleConfig)."""
    name, _, target = spec.strip().partition(":")
    if name == "kv" and not target:
        return "kv", base
    if name == SERVE_DEFAULT:
        if not target:
            return f"{SERVE_DEFAULT}:{base.target_ongoing_requests:g}", base
        try:
            value = float(target)
        except ValueError:
            raise ValueError(f"autoscale: target in {spec!r} is not a number") from None
        return f"{SERVE_DEFAULT}:{value:g}", replace(base, target_ongoing_requests=value)
    raise ValueError(f"autoscale: unknown policy {spec!r}; use kv, {SERVE_DEFAULT}[:TARGET]")


class ElasticServePow2(ServePow2Router):
    """Serve's pow2 over the routable replicas only (in_flight is per slot)."""

    def __init__(self, num_slots: int, seed: int) -> None:
        super().__init__(num_slots, seed)
        self.routable: list[int] = []

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        ids = self.routable
        replica = ids[0]
        if len(ids) > 1:
            first, second = self.rng.sample(ids, 2)
            replica = second if self.in_flight[second] < self.in_flight[first] else first
        self.in_flight[replica] += 1
        return replica, 0.0


class ElasticRandom(RandomRouter):
    def __init__(self, num_slots: int, seed: int) -> None:
        super().__init__(num_slots, seed)
        self.routable: list[int] = []

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        return self.rng.choice(self.routable), 0.0


class AutoscaleFleet:
    """See the module docstring. Invariant: state[i] is OFF exactly when slot i holds no
    GPU; the routers know exactly the RUNNING slots; min_replicas <= starting + running."""

    def __init__(self, policy_spec: str, config: AutoscaleConfig, fleet: FleetConfig) -> None:
        self.label, self.config = parse_policy(policy_spec, config)
        self.is_kv = self.label == "kv"
        self.policy = (KVAutoscalePolicy if self.is_kv else ServeDefaultPolicy)(self.config)
        self.fleet = fleet
        self.num_slots = self.config.max_replicas
        self.period_s = fleet.period_s
        initial = fleet.initial_replicas or self.config.min_replicas
        if not self.config.min_replicas <= initial <= self.config.max_replicas:
            raise ValueError(
                f"initial_replicas ({initial}) must be in [min_replicas, max_replicas]"
            )
        self.state = [RUNNING if i < initial else OFF for i in range(self.num_slots)]
        self.on_since_s = [0.0 if i < initial else math.nan for i in range(self.num_slots)]
        # A start's token is slot * 2**20 + its generation (< 2**20 starts per slot), so a
        # start cancelled and redone before the first one's ready time is told apart.
        self.generation = [0] * self.num_slots
        self.target = initial
        self.scale_state = ScaleState()
        self.replica_seconds = 0.0
        self.retired: list[SimReplica] = []
        # per slot: (t, admitted prompt tokens) for the rate; (t, ReplicaLoad) samples
        self.admitted: list[deque[tuple[float, int]]] = [deque() for _ in range(self.num_slots)]
        self.samples: list[deque[tuple[float, ReplicaLoad]]] = [
            deque() for _ in range(self.num_slots)
        ]
        self.ongoing: deque[tuple[float, int]] = deque()
        self.timeline: list[tuple[float, int, int, int, int]] = []  # t, start, run, drain, target
        self.num_started = self.num_drained = self.num_cancelled = 0
        self.events: list[tuple[float, str, int]] = []  # start, cancel, ready, drain, stop
        self.replicas: list[SimReplica] = []
        self.routers: list[SimRouter] = []
        self.new_replica: Callable[[int], SimReplica] | None = None

    # ---- ElasticFleet ----------------------------------------------------------
    def make_router(
        self,
        name: str,
        workload: Workload,
        num_slots: int,
        max_blocks: int,
        seed: int,
        router_config: RouterConfig | None,
    ) -> SimRouter:
        if name in REAL_POLICIES:
            return make_fixed_router(name, workload, num_slots, max_blocks, seed, router_config)
        if name == "serve_pow2":
            return ElasticServePow2(num_slots, seed)
        if name == "random":
            return ElasticRandom(num_slots, seed)
        names = [n.replace("_", "-") for n in ELASTIC_ROUTERS]
        raise ValueError(f"routers: {name!r} cannot follow a changing fleet; with --autoscale "
                         f"use one of {names}")  # fmt: skip

    def bind(
        self,
        replicas: list[SimReplica],
        routers: list[SimRouter],
        new_replica: Callable[[int], SimReplica],
    ) -> None:
        self.replicas, self.routers, self.new_replica = replicas, routers, new_replica
        self._tell_routers()

    def is_routable(self, index: int) -> bool:
        return self.state[index] == RUNNING

    def control(self, now_s: float, num_held: int) -> list[tuple[float, int]]:
        running = [i for i, s in enumerate(self.state) if s == RUNNING]
        self._record(now_s, running, num_held)
        if self.is_kv:
            loads = [self._mean_load(i) for i in running]
            decision = self.policy.decide(loads, len(running), self.target, now_s, self.scale_state)
        else:
            ongoing = sum(n for _, n in self.ongoing) / len(self.ongoing)
            decision = self.policy.decide(
                ongoing, len(running), self.target, now_s, self.scale_state
            )
        self.scale_state = decision.state
        self.target = decision.num_replicas
        started = self._reconcile(now_s)
        counts = [self.state.count(s) for s in (STARTING, RUNNING, DRAINING)]
        self.timeline.append((now_s, *counts, self.target))
        return started

    def ready(self, token: int, now_s: float) -> int | None:
        i, generation = divmod(token, 1 << 20)
        if self.state[i] != STARTING or self.generation[i] != generation:
            return None  # cancelled by a scale-down while it started
        if self.replicas[i].num_steps:  # a replica that ran before in this slot
            self.retired.append(self.replicas[i])
        self.replicas[i] = self.new_replica(i)
        self.state[i] = RUNNING
        self.events.append((now_s, "ready", i))
        self.admitted[i].clear()
        self.samples[i].clear()
        self._tell_routers(added=i, now_s=now_s)
        return i

    def on_idle(self, index: int, now_s: float) -> None:
        r = self.replicas[index]
        if self.state[index] == DRAINING and not r.running and not r.waiting:
            self._stop(index, now_s)

    def all_replicas(self) -> list[SimReplica]:
        """Every replica that ran: the earlier ones in each slot, then the current."""
        return self.retired + [r for r in self.replicas if r.num_steps]

    # ---- metrics the policies read -------------------------------------------------
    def _record(self, now_s: float, running: list[int], num_held: int) -> None:
        since_s = now_s - self.fleet.look_back_s
        ongoing = num_held
        for i in running:
            r = self.replicas[i]
            ongoing += len(r.running) + len(r.waiting)
            window = self.admitted[i]
            window.append((now_s, r.num_prompt_tokens))
            while len(window) > 2 and window[1][0] <= now_s - RATE_WINDOW_S:
                window.popleft()
            (first_s, first), (last_s, last) = window[0], window[-1]
            rate = (last - first) / (last_s - first_s) if last_s > first_s else 0.0
            committed = (r.num_used_blocks + r.num_waiting_blocks) / r.config.num_blocks
            seqs = (len(r.running) + len(r.waiting)) / r.config.max_num_seqs
            samples = self.samples[i]
            # The window's admitted rate is both the drain rate and the arrivals' here.
            load = ReplicaLoad(committed, r.num_waiting_tokens, rate, seqs, rate)
            samples.append((now_s, load))
            while samples[0][0] <= since_s:
                samples.popleft()
        self.ongoing.append((now_s, ongoing))
        while self.ongoing[0][0] <= since_s:
            self.ongoing.popleft()

    def _mean_load(self, i: int) -> ReplicaLoad:
        loads = [load for _, load in self.samples[i]]
        return ReplicaLoad(
            sum(x.kv_usage for x in loads) / len(loads),
            round(sum(x.num_waiting_tokens for x in loads) / len(loads)),
            sum(x.tokens_per_s for x in loads) / len(loads),
            sum(x.seq_fraction for x in loads) / len(loads),
            sum(x.admitted_tokens_per_s for x in loads) / len(loads),
        )

    # ---- starting and removing replicas -------------------------------------------
    def _reconcile(self, now_s: float) -> list[tuple[float, int]]:
        """Start or remove replicas until starting + running equals the target."""
        live = [i for i, s in enumerate(self.state) if s in (STARTING, RUNNING)]
        started = []
        if self.target > len(live):
            free = [i for i, s in enumerate(self.state) if s == OFF]
            for i in free[: self.target - len(live)]:
                self.state[i] = STARTING
                self.on_since_s[i] = now_s
                self.generation[i] += 1
                self.num_started += 1
                self.events.append((now_s, "start", i))
                token = i * (1 << 20) + self.generation[i]
                started.append((now_s + self.fleet.replica_start_s, token))
        for _ in range(len(live) - self.target):
            starting = [i for i in live if self.state[i] == STARTING]
            if starting:
                i = max(starting, key=lambda j: self.on_since_s[j])  # newest first
                self.num_cancelled += 1
                self._stop(i, now_s, "cancel")
            else:
                running = [i for i in live if self.state[i] == RUNNING]
                i = min(running, key=lambda j: (self._num_requests(j), -j))
                self._drain(i, now_s)
            live.remove(i)
        return started

    def _num_requests(self, i: int) -> int:
        r = self.replicas[i]
        return len(r.running) + len(r.waiting)

    def _drain(self, i: int, now_s: float) -> None:
        self.state[i] = DRAINING
        self.num_drained += 1
        self.events.append((now_s, "drain", i))
        self._tell_routers(removed=i)
        r = self.replicas[i]
        if not r.busy and not r.running and not r.waiting:
            self._stop(i, now_s)

    def _stop(self, i: int, now_s: float, kind: str = "stop") -> None:
        self.events.append((now_s, kind, i))
        self.replica_seconds += now_s - self.on_since_s[i]
        self.state[i] = OFF
        self.on_since_s[i] = math.nan

    def _tell_routers(
        self, added: int | None = None, removed: int | None = None, now_s: float = 0.0
    ) -> None:
        routable = [i for i, s in enumerate(self.state) if s == RUNNING]
        snapshot = None
        for router in self.routers:
            if isinstance(router, (ElasticServePow2, ElasticRandom)):
                router.routable = routable
            elif added is not None:
                if snapshot is None:  # one snapshot for all: stats() restarts its rate window
                    snapshot = self.replicas[added].stats(now_s, router.needs_hashes)
                router.observe(added, snapshot)
            elif removed is not None:
                router.admission.forget(self.replicas[removed].replica_id)

    # ---- the report ----------------------------------------------------------------
    def metrics(self, end_s: float) -> dict:
        """replica_seconds up to end_s (replicas still on are counted until then), peak
        and mean replicas, scaling counts, and the timeline of the replica count."""
        on = [end_s - t for t in self.on_since_s if not math.isnan(t)]
        replica_seconds = self.replica_seconds + sum(on)
        peak = max((s + r + d for _, s, r, d, _ in self.timeline), default=self.target)
        return {
            "autoscale": self.label,
            "autoscale_config": asdict(self.config),
            "replica_seconds": replica_seconds,
            "mean_replicas": replica_seconds / end_s if end_s > 0 else float("nan"),
            "peak_replicas": peak,
            "num_started": self.num_started,
            "num_drained": self.num_drained,
            "num_cancelled": self.num_cancelled,
            "timeline": [list(row) for row in self.timeline],
            "events": [list(e) for e in self.events],
        }


# ---- workloads -------------------------------------------------------------------------
def parse_rate_profile(text: str) -> list[tuple[float, float]]:
    """`T:RATE,T:RATE,...` (seconds from 0, requests/s) as points, times increasing."""
    points = []
    for part in text.split(","):
        t, sep, rate = part.partition(":")
        try:
            points.append((float(t), float(rate)))
        except ValueError:
            raise ValueError(f"rate_profile: {part!r} is not T:RATE") from None
        if not sep:
            raise ValueError(f"rate_profile: {part!r} is not T:RATE")
    times = [t for t, _ in points]
    if len(points) < 2 or times[0] != 0 or any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("rate_profile: needs >= 2 points, the first at 0, times increasing")
    if any(not (r >= 0 and math.isfinite(r)) for _, r in points) or not any(r for _, r in points):
        raise ValueError("rate_profile: rates must be finite, >= 0, not all 0")
    return points


def profile_arrivals(points: Sequence[tuple[float, float]], seed: int) -> np.ndarray:
    """A Poisson process whose rate is piecewise linear through points (thinning: events
    at the peak rate, each kept with probability rate(t) / peak)."""
    rng = np.random.default_rng(seed)
    end_s = points[-1][0]
    peak = max(r for _, r in points)
    n = rng.poisson(peak * end_s)
    times = np.sort(rng.uniform(0.0, end_s, n))
    rates = np.interp(times, [t for t, _ in points], [r for _, r in points])
    return times[rng.uniform(0.0, peak, n) < rates]


def profile_workload(args: argparse.Namespace) -> Workload:
    """--dataset's requests arriving along --rate-profile."""
    points = parse_rate_profile(args.rate_profile)
    arrival_s = profile_arrivals(points, args.seed)
    if len(arrival_s) == 0:
        raise ValueError("rate_profile: no request arrives; raise the rates")
    workload = Workload(WorkloadConfig(
        dataset=args.dataset, num_requests=len(arrival_s), rate=len(arrival_s) / points[-1][0],
        max_model_len=args.max_model_len, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, output_min=args.output_min, output_max=args.output_max,
        seed=args.seed,
    ))  # fmt: skip
    workload.arrival_s = arrival_s
    return workload


# ---- the command line ------------------------------------------------------------------
def add_autoscale_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("autoscaling (bench/sim_autoscale.py)")
    a.add_argument(
        "--autoscale", default=None,
        help=f"comma-separated policies, each a run: kv, {SERVE_DEFAULT}, {SERVE_DEFAULT}:TARGET",
    )  # fmt: skip
    a.add_argument("--min-replicas", type=int, default=1)
    a.add_argument("--max-replicas", type=int, default=8)
    a.add_argument(
        "--replica-start-s", type=float, default=FleetConfig.replica_start_s,
        help="from a scale-up to the replica taking requests (H200 gpt2: 36)",
    )  # fmt: skip
    a.add_argument("--autoscale-period-s", type=float, default=FleetConfig.period_s)
    a.add_argument("--look-back-s", type=float, default=FleetConfig.look_back_s,
                   help="the policies see each metric averaged over this window")  # fmt: skip
    # ClusterConfig's defaults (cluster.config), not imported: cluster pulls in Ray.
    a.add_argument("--upscale-delay-s", type=float, default=10.0)
    a.add_argument("--downscale-delay-s", type=float, default=120.0)
    a.add_argument("--upscale-wait-fraction", type=float, default=0.25)
    a.add_argument("--upscale-kv-usage", type=float, default=0.85)
    a.add_argument("--downscale-kv-usage", type=float, default=0.3)
    a.add_argument(
        "--policy-replica-start-s", type=float, default=30.0,
        help="kv: the start-up time the policy assumes (ClusterConfig.replica_start_s), its "
        "forecast horizon with --upscale-delay-s; --replica-start-s is the simulated one",
    )  # fmt: skip
    a.add_argument("--upscale-trend-window-s", type=float, default=10.0,
                   help="kv: the demand's slope is taken over this much history")  # fmt: skip
    a.add_argument(
        "--headroom-rise-per-s", type=float, default=AutoscaleConfig.headroom_rise_per_s,
        help="kv: the rise (replicas' worth a second) a fleet with load keeps spare capacity "
        "for over one trend horizon (0: no headroom)",
    )  # fmt: skip
    a.add_argument(
        "--surge-z", type=float, default=AutoscaleConfig.surge_z,
        help="kv: a rise past the watermark plus the headroom at this z's lower bound of "
        "its slope skips the upscale delay (0: off)",
    )  # fmt: skip
    a.add_argument("--target-ongoing-requests", type=float, default=2.0,
                   help=f"{SERVE_DEFAULT} without :TARGET (Ray 2.60's default: 2)")  # fmt: skip
    a.add_argument(
        "--rate-profile", default=None,
        help="without --trace: T:RATE,... a Poisson rate piecewise linear through the points",
    )  # fmt: skip
    a.add_argument(
        "--output-min", type=int, default=WorkloadConfig.output_min,
        help="with --rate-profile: output tokens ~ U[min, max] (random dataset)",
    )  # fmt: skip
    a.add_argument("--output-max", type=int, default=WorkloadConfig.output_max)


def autoscale_config(args: argparse.Namespace, router: RouterConfig | None) -> AutoscaleConfig:
    max_wait_s = router.max_queue_wait_s if router and router.max_queue_wait_s else 2.0
    return AutoscaleConfig(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
        max_queue_wait_s=max_wait_s, upscale_wait_fraction=args.upscale_wait_fraction,
        kv_high_watermark=args.upscale_kv_usage, kv_low_threshold=args.downscale_kv_usage,
        replica_start_s=args.policy_replica_start_s,
        trend_window_s=args.upscale_trend_window_s,
        headroom_rise_per_s=args.headroom_rise_per_s, surge_z=args.surge_z,
        target_ongoing_requests=args.target_ongoing_requests,
    )  # fmt: skip


def run_autoscaled(
    router: str,
    policy_spec: str,
    workload: Workload,
    sim_config: SimConfig,
    cost: CostModel,
    config: AutoscaleConfig,
    fleet_config: FleetConfig,
) -> dict:
    """One run: `router` over an AutoscaleFleet deciding with `policy_spec`."""
    if sim_config.serve_request_s:
        raise ValueError("serve_request_ms: not modeled with --autoscale (drain ignores it)")
    fleet = AutoscaleFleet(policy_spec, config, fleet_config)
    initial = fleet.state.count(RUNNING)
    result = simulate(
        policy_name(router), workload, replace(sim_config, num_replicas=initial), cost,
        fleet=fleet,
    )  # fmt: skip
    end_s = float(workload.arrival_s[0]) + result["sim_s"]
    # Sampled over every slot, idle ones included: meaningless for a changing fleet.
    for key in ("max_kv_usage_spread", "watermark_imbalance_frac", "replica_busy_frac"):
        result.pop(key, None)
    result["num_replicas"] = initial + fleet.num_started - fleet.num_cancelled  # that ran
    return result | fleet.metrics(end_s) | {"router": router}


COLUMNS = ("router", "autoscale", "slo_attainment", "goodput_rps", "ttft_p50_s", "ttft_p99_s",
           "replica_seconds", "mean_replicas", "peak_replicas", "num_rejected", "num_started",
           "num_drained", "wall_s")  # fmt: skip


def run_cli(
    args: argparse.Namespace,
    cost: CostModel,
    sim_config: SimConfig,
    routers: list[str] | None,
    workloads_of: Callable[[argparse.Namespace], list[tuple[float, Workload]]],
) -> None:
    """bench.sim --autoscale: each router (default kv) under each policy, on --rate-profile's
    trace (or bench.sim's workloads); prints a table, writes --out and --plot."""
    from bench.common import markdown_table, write_json

    config = autoscale_config(args, sim_config.router)
    fleet_config = FleetConfig(
        replica_start_s=args.replica_start_s, period_s=args.autoscale_period_s,
        look_back_s=args.look_back_s,
    )  # fmt: skip
    specs = [s for s in args.autoscale.split(",") if s.strip()]
    if not specs:
        raise ValueError("autoscale: name at least one policy")
    for spec in specs:
        parse_policy(spec, config)  # raises naming it, before any run
    routers = routers or ["kv"]
    if args.rate_profile is not None and args.trace is None:
        workloads = [(1.0, profile_workload(args))]
    else:
        workloads = workloads_of(args)
    results = []
    for load_scale, workload in workloads:
        for router in routers:
            for spec in specs:
                result = run_autoscaled(router, spec, workload, sim_config, cost, config,
                                        fleet_config) | {"load_scale": load_scale}  # fmt: skip
                results.append(result)
                print(markdown_table([result], list(COLUMNS), digits=4).splitlines()[-1],
                      flush=True)  # fmt: skip
    print(f"\nrequests={len(workload)} start={args.replica_start_s}s "
          f"slo ttft<={args.slo_ttft_ms}ms tpot<={args.slo_tpot_ms}ms")  # fmt: skip
    print(markdown_table(results, list(COLUMNS), digits=4))
    write_json(args.out, {"args": vars(args), "cost_model": cost.as_dict(),
                          "sim_config": asdict(sim_config), "fleet": asdict(fleet_config),
                          "results": results})  # fmt: skip
    if args.plot:
        plot(results, args.plot, args.rate_profile if args.trace is None else None)


def plot(results: list[dict], path: str, profile: str | None) -> None:
    """Replicas (starting + running + draining) over time per run, with the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for r in results:
        timeline = np.array(r["timeline"])
        held = timeline[:, 1] + timeline[:, 2] + timeline[:, 3]
        label = f"{r['router']} / {r['autoscale']}: {r['replica_seconds']:.0f} replica-s, " \
                f"SLO {r['slo_attainment']:.1%}"  # fmt: skip
        ax.step(timeline[:, 0], held, where="post", label=label)
    ax.set(xlabel="time (s)", ylabel="replicas (starting + running + draining)")
    if profile:
        points = parse_rate_profile(profile)
        rate_ax = ax.twinx()
        rate_ax.plot(*zip(*points), color="grey", linestyle=":", label="offered req/s")
        rate_ax.set_ylabel("offered req/s (dotted)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
