"""Soak test: minutes of random load on a local kvfleet app, with aborts, bad requests and a
replica killed midway. Exits non-zero on any lost request or leaked KV block.

    python -m bench.soak --duration-s 300
    python -m bench.soak --duration-s 45 --concurrency 6 --json-out soak.json

Each worker loops until the deadline, picking per request: a good request (random prompt
and length, greedy from a fixed pool, or sampled with random temperature/top_k/top_p/
seed), a request it abandons after a few chunks (break or task cancel), or a bad request
(it must fail with ValueError). Every request is classified by how it ended:

    completed      finished with "length" or "stop", tokens consistent with it
    typed_error    ReplicaError / ReplicaDiedError / OverloadedError
    rejected       a bad request refused with ValueError (as it must be)
    aborted        abandoned by the worker
    lost           anything else: no end within --request-timeout-s, an untyped
                   exception, a bad request accepted, a good one refused, wrong tokens

Greedy requests are checked against an offline engine, so a request generated twice or
mixing two attempts' tokens is lost too. At the end every replica (the killed one's
replacement included) must report num_running == num_waiting == 0 and
num_blocks_free + num_blocks_cached == num_blocks_total.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from replica.config_flags import add_config_flags, config_from_args

APP_NAME = "kvfleet-soak"
DEPLOYMENT = "LLMServer"
GREEDY_POOL = 6
GREEDY_MAX_TOKENS = 24


@dataclass
class Tally:
    submitted: int = 0
    completed: int = 0
    typed_error: int = 0
    rejected: int = 0
    aborted: int = 0
    lost: int = 0
    tokens: int = 0
    retries: int = 0
    errors_by_type: dict[str, int] = field(default_factory=dict)
    lost_reasons: list[str] = field(default_factory=list)

    def lose(self, reason: str) -> None:
        self.lost += 1
        if len(self.lost_reasons) < 20:
            self.lost_reasons.append(reason)


@dataclass
class Soak:
    client: Any
    rng: random.Random
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    greedy_prompts: list[list[int]]
    greedy_expected: list[list[int]]
    request_timeout_s: float
    tally: Tally = field(default_factory=Tally)


def _random_params(soak: Soak, prompt_len: int) -> Any:
    from replica import SamplingParams

    rng = soak.rng
    room = soak.max_model_len - prompt_len
    return SamplingParams(
        max_tokens=rng.randint(1, min(96, room)),
        temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 5, 50]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        seed=rng.choice([None, rng.randrange(2**31)]),
        ignore_eos=rng.random() < 0.5,
    )


def _bad_request(soak: Soak) -> tuple[Any, Any]:
    from replica import SamplingParams

    rng = soak.rng
    return rng.choice(
        [
            ([], SamplingParams(max_tokens=4)),
            ([1, soak.vocab_size], SamplingParams(max_tokens=4)),
            ([1, -1], SamplingParams(max_tokens=4)),
            ([1, 2.5], SamplingParams(max_tokens=4)),
            ([1, True], SamplingParams(max_tokens=4)),
            ([1] * soak.max_model_len, SamplingParams(max_tokens=4)),
            ([1, 2], SamplingParams(max_tokens=soak.max_model_len)),
            ("text without a tokenizer", SamplingParams(max_tokens=4)),
            ([1, 2], {"max_tokens": 4}),
        ]
    )


async def _consume(soak: Soak, prompt: Any, params: Any, abandon_after: int | None) -> tuple:
    """(token_ids, finish_reason) of one request; abandon_after chunks then break."""
    token_ids: list[int] = []
    finish_reason = None
    num_chunks = 0
    async for chunk in soak.client.stream(prompt, params):
        token_ids += chunk.token_ids
        finish_reason = chunk.finish_reason
        num_chunks += 1
        if abandon_after is not None and num_chunks >= abandon_after:
            break
    return token_ids, finish_reason


def _check_completion(soak: Soak, prompt: list[int], params: Any, tokens: list, reason: Any) -> str:
    """'' when the completion is consistent with its params, else why not."""
    if reason == "length":
        expected_len = min(params.max_tokens, soak.max_model_len - len(prompt))
        if len(tokens) != expected_len:
            return f"length with {len(tokens)} tokens, max_tokens {params.max_tokens}"
    elif reason == "stop":
        stops = set(params.stop_token_ids)
        if soak.eos_token_id is not None and not params.ignore_eos:
            stops.add(soak.eos_token_id)
        if not tokens or tokens[-1] not in stops:
            return f"stop without a stop token: {tokens[-3:]}"
    else:
        return f"finish_reason {reason!r}"
    if not all(isinstance(t, int) and 0 <= t < soak.vocab_size for t in tokens):
        return "a token outside the vocabulary"
    return ""


async def _one_request(soak: Soak) -> None:
    from cluster.errors import ReplicaError
    from replica import SamplingParams
    from router.errors import OverloadedError

    rng, tally = soak.rng, soak.tally
    roll = rng.random()
    tally.submitted += 1
    expected: list[int] | None = None
    abandon_after: int | None = None
    cancel = False
    if roll < 0.10:
        prompt, params = _bad_request(soak)
        try:
            await asyncio.wait_for(_consume(soak, prompt, params, None), soak.request_timeout_s)
        except ValueError:
            tally.rejected += 1
        except BaseException as exc:  # classified as lost
            tally.lose(f"bad request {prompt!r:.40} ended with {exc!r}")
        else:
            tally.lose(f"bad request {prompt!r:.40} was accepted")
        return
    if roll < 0.35:
        i = rng.randrange(GREEDY_POOL)
        prompt, expected = soak.greedy_prompts[i], soak.greedy_expected[i]
        params = SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    else:
        prompt = [rng.randrange(soak.vocab_size) for _ in range(rng.randint(1, 96))]
        params = _random_params(soak, len(prompt))
    if rng.random() < 0.15:
        abandon_after = rng.randint(1, 3)
        cancel = rng.random() < 0.5
    job = asyncio.ensure_future(_consume(soak, prompt, params, None if cancel else abandon_after))
    try:
        if cancel:  # cancel the consuming task itself once it is under way
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            job.cancel()
            try:
                await job
            except asyncio.CancelledError:
                tally.aborted += 1
                return
        tokens, reason = await asyncio.wait_for(asyncio.shield(job), soak.request_timeout_s)
    except (ReplicaError, OverloadedError) as exc:
        tally.typed_error += 1
        name = type(exc).__name__
        tally.errors_by_type[name] = tally.errors_by_type.get(name, 0) + 1
        partial = getattr(exc, "token_ids", [])
        if expected is not None and partial != expected[: len(partial)]:
            tally.lose(f"partial greedy output differs: {partial} vs {expected}")
        return
    except TimeoutError:
        job.cancel()
        tally.lose(f"no end within {soak.request_timeout_s}s (prompt of {len(prompt)})")
        return
    except BaseException as exc:  # classified as lost
        tally.lose(f"untyped {exc!r}")
        return
    if abandon_after is not None and reason is None:
        tally.aborted += 1
        return
    why = _check_completion(soak, prompt, params, tokens, reason)
    if expected is not None and tokens != expected:
        why = why or f"greedy output differs: {tokens} vs {expected}"
    if why:
        tally.lose(why)
        return
    tally.completed += 1
    tally.tokens += len(tokens)


async def _worker(soak: Soak, deadline_s: float) -> None:
    while time.monotonic() < deadline_s:
        await _one_request(soak)


def _kill_busiest_replica(client: Any) -> str:
    import ray

    stats = client.stats()
    victim = max(stats, key=lambda s: (s.num_running, s.kv_usage)).replica_id
    name = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{victim}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return victim


async def _drive(soak: Soak, duration_s: float, concurrency: int, kill_at_s: float) -> str:
    deadline_s = time.monotonic() + duration_s
    workers = [asyncio.ensure_future(_worker(soak, deadline_s)) for _ in range(concurrency)]
    await asyncio.sleep(kill_at_s)
    victim = await asyncio.to_thread(_kill_busiest_replica, soak.client)
    print(f"[soak] killed replica {victim} at {kill_at_s:.0f}s", flush=True)
    await asyncio.gather(*workers)
    return victim


def _leaks(client: Any, num_replicas: int, victim: str, timeout_s: float) -> list[str]:
    """Why replicas are not clean; waits for the victim's replacement and for idleness."""
    from bench.load_target import is_drained

    deadline_s = time.monotonic() + timeout_s
    problems = ["no stats"]
    while time.monotonic() < deadline_s:
        try:
            stats = client.stats()
        except TimeoutError:
            stats = []
        problems = []
        if len(stats) != num_replicas or any(s.replica_id == victim for s in stats):
            problems.append(f"{len(stats)} replicas report stats, {num_replicas} expected")
        problems += [
            f"{s.replica_id}: {s.num_running} running, {s.num_waiting} waiting, free "
            f"{s.num_blocks_free} + cached {s.num_blocks_cached} of {s.num_blocks_total}"
            for s in stats
            if not is_drained(s)
        ]
        if not problems:
            return []
        time.sleep(0.5)
    return problems


def main(argv: list[str] | None = None) -> int:
    from cluster import ClusterConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="how long to run")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--kill-at-s", type=float, default=None, help="default: half-way")
    parser.add_argument(
        "--request-timeout-s", type=float, default=90.0, help="a request's deadline"
    )
    parser.add_argument("--json-out", default=None, help="write the result as JSON here")
    app = parser.add_argument_group(
        "the app under test (ClusterConfig)",
        "every field but replica_id (the cluster names replicas), policy (--router) and app_name",
    )
    add_config_flags(
        app,
        ClusterConfig,
        exclude=("replica_id", "policy", "app_name"),
        aliases={"num_replicas": ["--replicas"]},
    )
    # A small pool and few sequences, so that preemption and admission holds happen often.
    parser.set_defaults(
        num_replicas=2, num_blocks=64, max_num_seqs=8, device="cpu", max_hold_s=15.0
    )
    args = parser.parse_args(argv)

    from bench.load_target import deploy, shutdown, start_local_ray
    from cluster import Client
    from replica import LLMEngine, SamplingParams

    config = config_from_args(ClusterConfig, args, app_name=APP_NAME)
    rng = random.Random(args.seed)
    engine = LLMEngine(config.engine_config("offline", num_gpus=0))
    greedy_prompts = [
        [rng.randrange(engine.model_config.vocab_size) for _ in range(rng.randint(4, 48))]
        for _ in range(GREEDY_POOL)
    ]
    greedy = SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    greedy_expected = [o.token_ids for o in engine.generate(greedy_prompts, greedy)]
    del engine

    start_local_ray(config.num_replicas + 1)
    started_s = time.monotonic()
    try:
        deploy(config)
        client = Client(APP_NAME, carrier_timeout_s=10.0)
        info = client.model_info()
        soak = Soak(
            client,
            rng,
            info.vocab_size,
            info.max_model_len or 512,
            info.eos_token_id,
            greedy_prompts,
            greedy_expected,
            args.request_timeout_s,
        )
        kill_at_s = args.duration_s / 2 if args.kill_at_s is None else args.kill_at_s
        print(f"[soak] app up in {time.monotonic() - started_s:.0f}s; load for "
              f"{args.duration_s:.0f}s", flush=True)  # fmt: skip
        victim = asyncio.run(_drive(soak, args.duration_s, args.concurrency, kill_at_s))
        soak.tally.retries = client.num_retries
        leaks = _leaks(client, config.num_replicas, victim, timeout_s=120.0)
    finally:
        shutdown()

    tally = soak.tally
    accounted = tally.completed + tally.typed_error + tally.rejected + tally.aborted + tally.lost
    summary = asdict(tally) | {
        "accounted": accounted,
        "killed_replica": victim,
        "leaks": leaks,
        "duration_s": args.duration_s,
        "wall_s": round(time.monotonic() - started_s, 1),
    }
    print(json.dumps(summary, indent=2), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    ok = tally.lost == 0 and not leaks and accounted == tally.submitted and tally.completed > 0
    print(f"[soak] {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
