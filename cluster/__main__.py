"""CLI: `python -m cluster serve ...` runs an app; `python -m cluster demo` shows one working.

The only place here that reads the environment is Ray itself (RAY_ADDRESS for serve);
serve writes Serve's HAProxy variables into it before it starts a local Ray
(cluster.app.set_ray_env), and reads KVFLEET_API_KEY, the api_key when --api-key is not
given (a key on the command line shows in `ps`).

serve fails at once, with the message and exit status 2, on a bad flag value and on
replicas the Ray cluster cannot hold (cluster.resources.check_fits), instead of
deploying an app that would never become healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

from cluster.app import build_app, check_http_proxy, cluster_runs_haproxy, set_ray_env, use_haproxy
from cluster.client import Client
from cluster.config import ROUTERS, ClusterConfig
from cluster.resources import check_fits, ray_node_resources
from replica.config_flags import add_config_flags, config_from_args
from replica.sampling_params import SamplingParams

# ClusterConfig fields `serve` has no flag for: the cluster names each replica's engine
# itself, and router names the routing policy (it also names Serve's own routers).
SERVE_EXCLUDED = ("replica_id", "policy")
# --engine, the older spelling of --engine-process / --no-engine-process.
ENGINE_MODES = {"auto": None, "process": True, "thread": False}


class _EngineMode(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        setattr(namespace, self.dest, ENGINE_MODES[values])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser(
        "serve",
        help="run a kvfleet app on the Ray cluster",
        description="Run a kvfleet app on the Ray cluster (RAY_ADDRESS, else a local one). "
        "Every ClusterConfig field is a flag; engine and router fields included.",
    )
    add_config_flags(
        serve_p,
        ClusterConfig,
        exclude=SERVE_EXCLUDED,
        aliases={"num_replicas": ["--replicas"]},
        grouped=True,
    )
    serve_p.set_defaults(http=True)  # a served app is for HTTP clients unless --no-http
    serve_p.add_argument(
        "--engine", dest="engine_process", choices=tuple(ENGINE_MODES), action=_EngineMode,
        default=argparse.SUPPRESS,
        help="engine_process as a word: process (true), thread (false) or auto (none)",
    )  # fmt: skip
    serve_p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    serve_p.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP address to bind: this machine only unless you say otherwise, e.g. 0.0.0.0 "
        "with --api-key (default: 127.0.0.1)",
    )
    serve_p.add_argument(
        "--blocking", action="store_true", help="stay in the foreground until interrupted"
    )
    demo = sub.add_parser("demo", help="2 local replicas, a burst of streams, a table")
    demo.add_argument("--model", default="gpt2-tiny", help="preset or checkpoint directory")
    demo.add_argument("--replicas", type=int, default=2, help="replicas on a local Ray")
    demo.add_argument("--requests", type=int, default=32, help="streaming requests at once")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens each request makes")
    demo.add_argument("--router", choices=ROUTERS, default="kv", help="routing policy")
    return parser


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    if args.api_key is None and os.environ.get("KVFLEET_API_KEY"):
        return config_from_args(ClusterConfig, args, api_key=os.environ["KVFLEET_API_KEY"])
    return config_from_args(ClusterConfig, args)


def prepare_serve(args: argparse.Namespace) -> ClusterConfig:
    """The app's config, on a Ray that is up (RAY_ADDRESS's, else a local one started
    here); ValueError naming the field or flag, before anything is deployed, when a value
    is bad or the replicas do not fit the Ray cluster."""
    import ray

    config = serve_config(args)
    # Read by the Ray this starts; a cluster it attaches to (RAY_ADDRESS) keeps its own,
    # which check_http_proxy holds http_proxy against.
    set_ray_env(config)
    ray.init(ignore_reinit_error=True)
    check_fits(config, ray_node_resources())
    if use_haproxy(config):
        check_http_proxy(config, cluster_runs_haproxy())
    return config


def serve_main(args: argparse.Namespace) -> None:
    from ray import serve

    try:
        config = prepare_serve(args)
    except ValueError as error:
        print(f"python -m cluster serve: error: {error}", file=sys.stderr)
        sys.exit(2)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=args.blocking)
    if not args.blocking:
        where = f"http://localhost:{args.port}" if config.http else f"Client({config.app_name!r})"
        print(f"kvfleet app {config.app_name!r} is running: {where}")


async def _burst(client: Client, num_requests: int, max_tokens: int) -> list[tuple[str, int]]:
    rng = random.Random(0)

    async def one() -> tuple[str, int]:
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(4, 64))]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        num_tokens, replica_id = 0, ""
        async for chunk in client.stream(prompt, params):
            num_tokens += len(chunk.token_ids)
            replica_id = chunk.replica_id
        return replica_id, num_tokens

    return await asyncio.gather(*(one() for _ in range(num_requests)))


async def _burst_with_peak_kv(
    client: Client, num_requests: int, max_tokens: int
) -> tuple[list[tuple[str, int]], dict[str, float]]:
    peak_kv: dict[str, float] = {}

    async def sample() -> None:
        while True:
            for s in await client.stats_async():
                peak_kv[s.replica_id] = max(peak_kv.get(s.replica_id, 0.0), s.kv_usage)
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    try:
        return await _burst(client, num_requests, max_tokens), peak_kv
    finally:
        sampler.cancel()


def demo_main(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    ray.init(
        address="local",
        num_cpus=max(4, args.replicas + 2),
        include_dashboard=False,
        log_to_driver=False,
    )
    config = ClusterConfig(
        model=args.model,
        num_replicas=args.replicas,
        router=args.router,
        num_blocks=512,
        max_num_seqs=64,
        device="cpu",
    )
    print(f"starting {args.replicas} replicas of {args.model} ({args.router} router) on local Ray")
    try:
        serve.run(build_app(config), name=config.app_name, route_prefix=None)
        client = Client(config.app_name)
        start_s = time.perf_counter()
        results, peak_kv = asyncio.run(_burst_with_peak_kv(client, args.requests, args.max_tokens))
        elapsed_s = time.perf_counter() - start_s
        stats = {s.replica_id: s for s in client.stats()}
        print(f"\n{args.requests} streaming requests in {elapsed_s:.2f} s\n")
        print(f"{'replica':<12} {'requests':>8} {'tokens':>8} {'tokens/s':>9} {'peak KV':>8}")
        for replica_id in sorted(stats):
            mine = [n for r, n in results if r == replica_id]
            print(
                f"{replica_id:<12} {len(mine):>8} {sum(mine):>8} "
                f"{sum(mine) / elapsed_s:>9.1f} {peak_kv.get(replica_id, 0.0):>8.1%}"
            )
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    args = _parser().parse_args()
    if args.command == "serve":
        serve_main(args)
    else:
        demo_main(args)


if __name__ == "__main__":
    main()
