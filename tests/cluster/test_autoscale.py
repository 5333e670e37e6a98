"""KV-occupancy autoscaling: the Serve glue (cluster.autoscale, ClusterConfig's fields,
build_app) without Ray, then a real local Ray whose app rises from 1 replica to 3 under
load and falls back to 1 once it stops, losing and cutting no stream.

The Ray test runs replicas of PacedEngine (bench.cluster: the real engine, each step
padded) so requests last long enough on a 2-core box to load KV, with delays of about
a second so the whole rise and fall takes under a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from bench.cluster import paced_engine
from cluster import Client, ClusterConfig, build_app
from cluster.autoscale import (
    ADMITTED_TOKENS_PER_S,
    KV_USAGE,
    SEQ_FRACTION,
    TOKENS_PER_S,
    WAITING_TOKENS,
    KVServePolicy,
    ReplicaMeter,
    kv_serve_policy,
)
from cluster.client import LLM_DEPLOYMENT
from replica import SamplingParams
from replica.stats import ReplicaStats
from router.errors import OverloadedError
from tests.cluster.local_ray import local_serve

APP_NAME = "kvfleet-autoscale"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def stats(**fields) -> ReplicaStats:
    base = dict(
        replica_id="r0",
        num_blocks_total=100,
        num_blocks_free=100,
        num_blocks_cached=0,
        kv_usage=0.0,
        num_running=0,
        num_waiting=0,
        num_preempted_total=0,
        max_num_seqs=8,
        tokens_per_s=0.0,
    )
    return ReplicaStats(**{**base, **fields})


# --- the glue, no Ray ------------------------------------------------------------------


def test_replica_meter_measures_the_prompt_admission_rate() -> None:
    now = [100.0]
    meter = ReplicaMeter(clock=lambda: now[0])
    first = meter.record(stats(tokens_per_s=50.0, prefix_query_tokens=0))
    assert first[TOKENS_PER_S] == 50.0  # one snapshot spans no time: the engine's rate
    assert first[ADMITTED_TOKENS_PER_S] == 0.0  # but nothing admitted is measured yet
    now[0] = 101.0
    # 40 blocks used, 10 promised to 160 queued tokens: usage counts the queue.
    m = meter.record(
        stats(
            num_blocks_free=60,
            num_waiting_tokens=160,
            num_waiting_blocks=10,
            prefix_query_tokens=800,
            tokens_per_s=50.0,
        )
    )
    assert m == {
        KV_USAGE: 0.5,
        WAITING_TOKENS: 160.0,
        TOKENS_PER_S: 800.0,
        SEQ_FRACTION: 0.0,
        ADMITTED_TOKENS_PER_S: 800.0,
    }
    now[0] = 104.5  # the first sample has left the 2-s window: 101 -> 104.5
    assert meter.record(stats(prefix_query_tokens=1500))[TOKENS_PER_S] == pytest.approx(200.0)
    # 6 running and 4 queued fill 10 of 8 sequence slots.
    slots = ReplicaMeter(clock=lambda: 0.0).record(stats(num_running=6, num_waiting=4))
    assert slots[SEQ_FRACTION] == 1.25


def test_replica_meter_takes_the_drain_rate_admission_measures() -> None:
    """With a queue the rate is prompt tokens per second of backlogged time (stamped by
    the engine), as admission's; the plain window rate would halve it here."""
    now = [0.0]
    meter = ReplicaMeter(clock=lambda: now[0])
    meter.record(stats(num_waiting=3, num_waiting_tokens=300, timestamp_s=10.0))
    now[0] = 2.0
    m = meter.record(
        stats(num_waiting=3, num_waiting_tokens=300, prefix_query_tokens=1000, timestamp_s=11.0)
    )
    assert m[TOKENS_PER_S] == pytest.approx(1000.0)  # the window's 1000 / 2 s would be 500
    assert m[ADMITTED_TOKENS_PER_S] == pytest.approx(500.0)  # the arrivals: the window's


def context(metrics: dict, running: list, target: int, now_s: float, state: dict):
    dep = DeploymentID(name=LLM_DEPLOYMENT, app_name="a")
    ids = {r: ReplicaID(unique_id=r, deployment_id=dep) for r in running}
    aggregated = {
        name: {ids[r]: value for r, value in column.items() if r in ids}
        for name, column in metrics.items()
    }
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name=LLM_DEPLOYMENT,
        app_name="a",
        current_num_replicas=len(running),
        target_num_replicas=target,
        running_replicas=list(ids.values()),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=aggregated,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now_s,
        config=None,
    )


def test_kv_serve_policy_decides_on_the_recorded_metrics() -> None:
    config = ClusterConfig(
        autoscale=True, max_replicas=3, upscale_delay_s=2.0, downscale_delay_s=5.0
    )
    policy = KVServePolicy(**dataclasses.asdict(config.autoscale_config()))
    hot = {
        KV_USAGE: {"a": 0.9, "b": 0.95},
        WAITING_TOKENS: {"a": 0.0, "b": 0.0},
        TOKENS_PER_S: {"a": 100.0, "b": 100.0},
    }
    n, state = policy(context(hot, ["a", "b"], 2, 10.0, {}))
    assert n == 2 and state["kvfleet_reason"] == "kv"
    n, state = policy(context(hot, ["a", "b"], 2, 12.0, state))
    assert n == 3
    # A replica with no metrics yet counts as running but not in the averages: "c" just
    # started, and the two that report are idle.
    idle = {name: {"a": 0.0, "b": 0.0} for name in hot}
    n, state = policy(context(idle, ["a", "b", "c"], 3, 13.0, {}))
    assert n == 3 and state["kvfleet_reason"] == "low"
    n, state = policy(context(idle, ["a", "b", "c"], 3, 18.0, state))
    assert n == 1
    # Sequence slots full at low KV usage: the slots decide, as the kv router counts them.
    slots = {**idle, TOKENS_PER_S: {"a": 100.0, "b": 100.0}, SEQ_FRACTION: {"a": 1.0, "b": 1.0}}
    n, state = policy(context(slots, ["a", "b"], 2, 30.0, {}))
    assert n == 2 and state["kvfleet_reason"] == "kv"
    # No metrics at all: the target stands.
    assert policy(context({}, ["a"], 2, 20.0, {}))[0] == 2


def test_kv_serve_policy_keeps_the_demand_trend_in_policy_state() -> None:
    # Serve calls the policy every 0.1 s and hands back the state it returned: the demand
    # history rides in it, so a rise is seen before the occupancy reaches the watermark.
    config = ClusterConfig(autoscale=True, max_replicas=4, upscale_delay_s=1.0)
    policy = KVServePolicy(**dataclasses.asdict(config.autoscale_config()))
    state: dict = {}
    for step in range(21):  # 2 s, one replica filling 5% a second from 0.2
        now_s = 100.0 + step * 0.1
        kv = 0.2 + 0.05 * (now_s - 100.0)
        metrics = {
            KV_USAGE: {"a": kv},
            WAITING_TOKENS: {"a": 0.0},
            TOKENS_PER_S: {"a": 100.0},
            # admitted as fast as it fills: the occupancy follows the arrivals
            ADMITTED_TOKENS_PER_S: {"a": 1000.0 * kv},
        }
        n, state = policy(context(metrics, ["a"], 1, now_s, state))
    # 1 s in (a tenth of the trend window) the slope puts 31 s ahead (the 1-s delay + the
    # 30-s start) far past the watermark; 1 s later, at 0.3 occupancy, the scale-up lands
    # (to max_replicas: sized for 0.3 + 62 * 0.05 at the band's middle, 6).
    assert state["kvfleet_reason"] == "trend" and n == 4
    # Of 21 calls, the points kept a tenth of the 10-s window apart: the state stays small.
    assert [t for t, _ in state["kvfleet_demand"]] == pytest.approx([100.0, 101.0, 102.0])


def test_build_app_puts_the_kv_policy_on_the_llm_deployment() -> None:
    config = ClusterConfig(
        autoscale=True,
        num_replicas=2,
        min_replicas=1,
        max_replicas=3,
        autoscale_look_back_s=2.0,
        graceful_shutdown_timeout_s=90.0,
    )
    llm = build_app(config, num_gpus_in_cluster=0)._bound_deployment
    deployment_config = llm._deployment_config
    auto = deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 3, 2)
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (0.0, 0.0)  # the policy's own
    assert auto.look_back_period_s == 2.0 and auto.metrics_interval_s == pytest.approx(0.4)
    assert auto.policy.policy_function == "cluster.autoscale:KVServePolicy"
    assert auto.policy.policy_kwargs["max_replicas"] == 3
    assert deployment_config.graceful_shutdown_timeout_s == 90.0
    fixed = build_app(ClusterConfig(num_replicas=2), num_gpus_in_cluster=0)._bound_deployment
    assert fixed._deployment_config.autoscaling_config is None
    assert fixed._deployment_config.num_replicas == 2


# An AutoscalingContext as plain values (replica ids as strings: the policy only keys by them).
CONTEXT_FIELDS = dict(
    deployment_id=None,
    deployment_name=LLM_DEPLOYMENT,
    app_name="a",
    current_num_replicas=1,
    target_num_replicas=1,
    running_replicas=["r0"],
    total_num_requests=0.0,
    total_queued_requests=0.0,
    aggregated_metrics={
        KV_USAGE: {"r0": 0.95},
        WAITING_TOKENS: {"r0": 0.0},
        TOKENS_PER_S: {"r0": 9.0},
    },
    raw_metrics={},
    capacity_adjusted_min_replicas=1,
    capacity_adjusted_max_replicas=3,
    policy_state={},
    last_scale_up_time=None,
    last_scale_down_time=None,
    current_time=5.0,
    config=None,
)


def test_the_controller_runs_the_policy_without_importing_kvfleet(tmp_path: Path) -> None:
    """Serve's controller unpickles the policy and calls it: nothing of router/ or
    replica/ (whose __init__ imports torch) may be imported there."""
    policy = kv_serve_policy(ClusterConfig(autoscale=True, max_replicas=3).autoscale_config())
    (tmp_path / "policy.bin").write_bytes(policy.get_serialized_policy_def())
    script = (
        "import sys; from ray import cloudpickle\n"
        "cls = cloudpickle.loads(open('policy.bin', 'rb').read())\n"
        "policy = cls(min_replicas=1, max_replicas=3, upscale_delay_s=0.0)\n"
        "from ray.serve.config import AutoscalingContext\n"
        f"n, _ = policy(AutoscalingContext(**{CONTEXT_FIELDS!r}))\n"
        "loaded = [m for m in ('torch', 'router', 'replica', 'cluster') if m in sys.modules]\n"
        "print(n, loaded)\n"
    )
    # A fresh interpreter: any kvfleet module the policy reaches by reference shows in
    # sys.modules (pickled by reference it was: ['torch', 'router', 'replica']).
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2 []"  # KV usage 0.95 on the one replica: one more


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"min_replicas": 0}, "min_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"upscale_kv_usage": 1.5}, "upscale_kv_usage"),
        ({"downscale_kv_usage": 0.9, "upscale_kv_usage": 0.8}, "downscale_kv_usage"),
        ({"upscale_delay_s": -1.0}, "upscale_delay_s"),
        ({"autoscale": True, "num_replicas": 5, "max_replicas": 4}, "num_replicas"),
        ({"graceful_shutdown_timeout_s": 0}, "graceful_shutdown_timeout_s"),
        ({"autoscale": 1}, "autoscale"),
        ({"replica_start_s": -1.0}, "replica_start_s"),
        ({"autoscale_trend_window_s": 0.0}, "autoscale_trend_window_s"),
        ({"autoscale_headroom_rise_per_s": -0.1}, "autoscale_headroom_rise_per_s"),
        ({"autoscale_surge_z": float("nan")}, "autoscale_surge_z"),
    ],
)
def test_autoscale_fields_are_validated_by_name(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ClusterConfig(**fields)


def test_cli_flag_and_yaml_turn_autoscale_on() -> None:
    from cluster.__main__ import _parser, serve_config

    argv = ["serve", "--model", "gpt2-tiny", "--autoscale", "--max-replicas", "3"]
    argv += ["--upscale-delay-s", "2", "--downscale-kv-usage", "0.2"]
    argv += ["--autoscale-headroom-rise-per-s", "0", "--autoscale-surge-z", "2.33"]
    config = serve_config(_parser().parse_args(argv))
    assert config.autoscale
    policy = config.autoscale_config()
    assert (policy.max_replicas, policy.upscale_delay_s, policy.kv_low_threshold) == (3, 2.0, 0.2)
    assert (policy.headroom_rise_per_s, policy.surge_z) == (0.0, 2.33)
    assert not serve_config(_parser().parse_args(["serve"])).autoscale

    document = yaml.safe_load((DEPLOY / "serve-autoscale.yaml").read_text())
    (app,) = document["applications"]
    config = ClusterConfig.from_dict(app["args"])
    assert config.autoscale and (config.min_replicas, config.max_replicas) == (1, 4)
    assert config.autoscale_config().max_queue_wait_s == config.routing.max_queue_wait_s
    # The YAML spells out the policy's defaults: kept in step with ClusterConfig's.
    for name in ("upscale_delay_s", "downscale_delay_s", "upscale_wait_fraction",
                 "upscale_kv_usage", "downscale_kv_usage", "replica_start_s",
                 "autoscale_trend_window_s", "autoscale_look_back_s",
                 "autoscale_headroom_rise_per_s", "autoscale_surge_z"):  # fmt: skip
        assert app["args"][name] == getattr(ClusterConfig(), name), name
    llm = build_app(dataclasses.replace(config, http=False), num_gpus_in_cluster=0)
    assert llm._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4


# --- a real local Ray -----------------------------------------------------------------

MAX_TOKENS = 48
PROMPT_TOKENS = 48
STEP_S = 0.02  # each engine step lasts at least this: a request runs ~1 s


def autoscale_config() -> ClusterConfig:
    return ClusterConfig(
        model="gpt2-tiny",
        device="cpu",
        num_blocks=64,  # 1,024 tokens: 8 requests of 96 tokens hold 3/4 of it
        max_num_seqs=8,
        num_cpus_per_replica=0.5,
        router="kv",
        max_hold_s=60.0,
        app_name=APP_NAME,
        autoscale=True,
        num_replicas=1,
        min_replicas=1,
        max_replicas=3,
        upscale_delay_s=1.0,
        downscale_delay_s=3.0,
        upscale_kv_usage=0.5,
        downscale_kv_usage=0.15,
        autoscale_look_back_s=1.0,
        graceful_shutdown_timeout_s=60.0,
    )


@dataclass
class Tally:
    """Every request of a load run: completed in full, or not (with why)."""

    completed: int = 0
    in_flight: int = 0  # submitted, not yet ended
    refused: int = 0  # OverloadedError before any token: retried, not lost
    failures: list[str] = field(default_factory=list)
    replica_ids: set[str] = field(default_factory=set)


async def one_request(client: Client, prompt: list[int], max_tokens: int, tally: Tally) -> None:
    """One request to completion: every token, finish "length"; an admission refusal is
    retried after a pause (it streamed nothing), anything else is a failure."""
    tally.in_flight += 1
    try:
        await _one_request(client, prompt, max_tokens, tally)
    finally:
        tally.in_flight -= 1


async def _one_request(client: Client, prompt: list[int], max_tokens: int, tally: Tally) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    while True:
        tokens: list[int] = []
        finish = None
        try:
            async for chunk in client.stream(prompt, params):
                tokens += chunk.token_ids
                finish = chunk.finish_reason
                tally.replica_ids.add(chunk.replica_id)
        except OverloadedError:
            assert not tokens
            tally.refused += 1
            await asyncio.sleep(0.2)
            continue
        except Exception as exc:  # a lost or cut stream: what the test counts
            tally.failures.append(f"{type(exc).__name__}: {exc} after {len(tokens)} tokens")
            return
        if len(tokens) == max_tokens and finish == "length":
            tally.completed += 1
        else:
            tally.failures.append(f"cut: {len(tokens)} of {max_tokens} tokens, finish {finish}")
        return


async def users(client: Client, num_users: int, stop: asyncio.Event, tally: Tally) -> None:
    """num_users closed-loop users sending requests back to back until stop is set."""
    rng = random.Random(0)

    async def user() -> None:
        while not stop.is_set():
            prompt = [rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)]
            await one_request(client, prompt, MAX_TOKENS, tally)

    await asyncio.gather(*(user() for _ in range(num_users)))


def replica_states(app_name: str) -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or LLM_DEPLOYMENT not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[LLM_DEPLOYMENT].replica_states.items()}


def num_running(app_name: str) -> int:
    return replica_states(app_name).get("RUNNING", 0)


async def wait_for_replicas(app_name: str, want: int, timeout_s: float) -> float:
    """Seconds until exactly `want` replicas run and none is starting or stopping."""
    start_s = time.monotonic()
    while True:
        states = replica_states(app_name)
        if states.get("RUNNING", 0) == want and sum(states.values()) == want:
            return time.monotonic() - start_s
        assert time.monotonic() - start_s < timeout_s, f"want {want} replicas, have {states}"
        await asyncio.sleep(0.25)


@pytest.fixture(scope="module")
def autoscaled_app() -> Iterator[Client]:
    from ray import serve

    with local_serve(num_cpus=4):
        config = autoscale_config()
        factory = functools.partial(paced_engine, min_step_s=STEP_S)
        serve.run(build_app(config, engine_factory=factory), name=APP_NAME, route_prefix=None)
        yield Client(APP_NAME, max_retries=0)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_load_scales_one_to_three_and_back_with_no_stream_lost(autoscaled_app: Client) -> None:
    """Rising load: 1 -> 3 replicas by KV usage; load gone: back to 1 after the downscale
    delay, each removed replica draining what it ran. A client without retries sees every
    request complete with all its tokens."""
    client = autoscaled_app
    assert num_running(APP_NAME) == 1
    tally = Tally()

    timeline: list[tuple[float, dict[str, int]]] = []  # (s since the load began, states)

    async def watch(start_s: float) -> None:
        while True:
            timeline.append((time.monotonic() - start_s, replica_states(APP_NAME)))
            await asyncio.sleep(0.25)

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(time.monotonic()))
        load = asyncio.create_task(users(client, 20, stop, tally))
        rise_s = await wait_for_replicas(APP_NAME, 3, timeout_s=90.0)
        await asyncio.sleep(2.0)  # the three serve together for a while
        stop.set()
        await load
        fall_s = await wait_for_replicas(APP_NAME, 1, timeout_s=60.0)
        watcher.cancel()
        return rise_s, fall_s

    rise_s, fall_s = asyncio.run(scenario())
    # When the policy first asked for 2 and for 3 (a replica appears, starting).
    asked = {n: next((t for t, st in timeline if sum(st.values()) >= n), None) for n in (2, 3)}
    print(
        f"\n1 -> 3 replicas running in {rise_s:.1f} s (2 asked for at {asked[2]:.1f} s, 3 at "
        f"{asked[3]:.1f} s); back to 1 in {fall_s:.1f} s after the load stopped; "
        f"{tally.completed} requests completed, {tally.refused} refusals retried, "
        f"{len(tally.failures)} lost or cut; replicas served: {len(tally.replica_ids)}"
    )
    assert tally.failures == []
    assert tally.completed > 0
    assert len(tally.replica_ids) == 3  # the new replicas served requests
