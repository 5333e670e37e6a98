"""ClusterConfig: the one frozen config of the Ray wiring, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from replica.config import EngineConfig
from replica.config_flags import flat_names, from_mapping, get_flat, resolve
from replica.validate import (
    is_bool,
    non_empty_str,
    non_negative_float,
    one_of,
    positive_float,
    positive_int,
)
from router.autoscale import AutoscaleConfig
from router.config import POLICIES, RouterConfig

# Ray Serve's own request routers, run as peers of the kvfleet policies (no admission).
SERVE_ROUTERS = ("serve-pow2", "serve-round-robin", "serve-consistent-hash")
ROUTERS = (*POLICIES, *SERVE_ROUTERS)
HTTP_PROXIES = ("haproxy", "serve")
_ROUTER_DEFAULTS = RouterConfig()
# RouterConfig fields that only kvfleet's routers (their admission control, their
# ranking) read: Serve's routers refuse them away from their defaults. policy is
# ClusterConfig.router's, and seed and prefix_salt are shared with the engine.
ADMISSION_FIELDS = tuple(
    f.name for f in fields(RouterConfig) if f.name not in ("policy", "seed", "prefix_salt")
)


@dataclass(frozen=True, init=False)
class ClusterConfig:
    """A kvfleet Serve application: which model, how many replicas, how requests route.

    It holds the EngineConfig every replica runs (`engine`) and the RouterConfig of
    kvfleet's request router (`routing`), plus its own fields (replicas, resources,
    transport, HTTP); each field documents itself (metadata["help"]).

    Flat form: the constructor takes, besides its own fields and `engine` / `routing`,
    any field of the configs it holds by name (replica.config_flags' flat names):
    `ClusterConfig(model="gpt2", block_size=32, high_watermark=0.9)` puts model and
    block_size into `engine` and high_watermark into `routing`, over the `engine` /
    `routing` given (or their defaults); `seed` sets both the engine's and the
    router's. Reading works the same way: `config.block_size` is
    `config.engine.block_size` (__getattr__ reads through; `seed` reads the engine's).
    So dataclasses.replace(config, block_size=32) works too. The same flat names are
    the YAML keys of from_dict (which also takes `engine:` / `routing:` mappings) and
    the flags of `python -m cluster serve`.

    `router` names the policy, Serve's own routers included, so `routing.policy` is
    not set directly: it follows `router` (RouterConfig's default for Serve's routers,
    which have no RouterConfig), and a flat `policy` is refused. Serve's routers have no
    admission control either, so a RouterConfig field away from its default raises with
    them.
    """

    engine: EngineConfig = field(
        default_factory=EngineConfig,
        metadata={"help": "the engine every replica runs (its replica_id and device are set "
                  "per replica: engine_config)"},
    )  # fmt: skip
    routing: RouterConfig = field(
        default_factory=RouterConfig,
        metadata={"help": "kvfleet's request router: ranking and admission (router.RouterConfig)"},
    )
    num_replicas: int = field(default=1, metadata={"help": "replicas (Serve deployment replicas)"})
    router: str = field(
        default="kv",
        metadata={
            "help": "a kvfleet policy (kv, prefix, pow2: router/ behind admission control) "
            "or one of Ray Serve's own routers as a peer, without admission: serve-pow2 "
            "(Serve's default, power of two choices over queue lengths), "
            "serve-round-robin, or serve-consistent-hash (a hash ring keyed by the "
            "prompt's first tokens, cluster.request_router.PromptHashRouter)",
            "choices": ROUTERS,
        },
    )
    stats_period_s: float = field(
        default=0.05,
        metadata={"help": "how often each replica publishes ReplicaStats to the router (<= 1)"},
    )
    carrier_messages_per_step: int = field(
        default=4,
        metadata={
            "help": "bounds what streaming costs a replica with many callers (processes "
            "with a Client): each caller's tokens go out every engine step while the "
            "replica has at most this many callers, and every ceil(callers / this) steps "
            "beyond (at most CARRIER_MAX_HOLD_S later); a request's first token and its "
            "end are always sent at once. Each message costs the replica's process a Serve "
            "streaming yield (~0.3 ms of CPU) taken from the engine thread's GIL time"
        },
    )
    num_gpus_per_replica: float | None = field(
        default=None,
        metadata={
            "help": "Ray GPUs per replica (fractions share one); none: 1 when the Ray "
            "cluster has GPUs and device is not cpu, else 0 (resolve_num_gpus)"
        },
    )
    num_cpus_per_replica: float | None = field(
        default=None,
        metadata={
            "help": "Ray CPUs per replica; none: 1 without a GPU, 0 with one "
            "(resolve_num_cpus). Ray sets OMP_NUM_THREADS to it, so it is also the number "
            "of threads torch runs a CPU replica's ops on (at least 1)"
        },
    )
    replica_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": 'custom Ray resources each replica actor needs, e.g. {"kvfleet_slot": '
            "1} with one slot per node to place one replica per node"
        },
    )
    max_ongoing_requests: int = field(
        default=4096, metadata={"help": "Serve's bound on one replica's requests in flight"}
    )
    max_queued_requests: int = field(
        default=1024,
        metadata={
            "help": "Serve's bound on the requests one caller process (an ingress replica, a "
            "Client) has waiting to be routed to the LLM deployment, held ones included: "
            "past it a submit fails at once with OverloadedError (HTTP 503 with "
            "Retry-After: backpressure_retry_after_s) rather than queue where admission "
            "does not look; -1: unbounded"
        },
    )
    ingress_max_ongoing_requests: int = field(
        default=1024,
        metadata={
            "help": "requests one HTTP ingress replica serves at once (a stream counts until "
            "it ends); more wait in its queue (ingress_max_queued_requests)"
        },
    )
    ingress_max_queued_requests: int = field(
        default=256,
        metadata={
            "help": "requests waiting for one HTTP ingress replica to take them; past it Serve "
            "answers 503 with Retry-After (backpressure_retry_after_s) before any handler "
            "runs; -1: unbounded"
        },
    )
    ingress_max_loop_lag_s: float | None = field(
        default=0.1,
        metadata={
            "help": "with http, each ingress replica measures how late its event loop runs "
            "(cluster.ingress_load) and, while that is past this many seconds, answers new "
            "completion and chat requests 503 with Retry-After before reading their bodies "
            "(streams already admitted go on; /health, /metrics, /stats always answer): a "
            "request waits about one loop lag at each of its passes through the ingress "
            "before its first token (handler, submit, first chunk, SSE write), so 0.1 s "
            "holds the front door's share of TTFT to ~0.4 s; none or 0: never shed here"
        },
    )
    backpressure_retry_after_s: float = field(
        default=1.0,
        metadata={
            "help": "the Retry-After of a request refused by a full Serve queue "
            "(max_queued_requests, ingress_max_queued_requests), in seconds; admission's "
            "own refusals compute theirs from the backlog (RouterConfig.max_queue_wait_s)"
        },
    )
    http: bool = field(
        default=False,
        metadata={"help": "an OpenAI-compatible HTTP ingress in front (else Python Client only)"},
    )
    ingress_replicas: int = field(
        default=2,
        metadata={
            "help": "replicas of the HTTP ingress (with http): each writes the SSE events "
            "of its share of the streams on a core of its own (one ingress for 256 streams "
            "was the HTTP path's bottleneck, docs/design.md), and one can die without "
            "closing the front door. Size for the peak offered rate, refusals included: "
            "about one per 150 requests/s (a 503 of a 1,024-token prompt cost an H200 "
            "host's ingress ~2.3 ms of CPU; past half a core its loop answers late). Each "
            "asks Ray for no CPU (cluster.app.INGRESS_NUM_CPUS)"
        },
    )
    submit_group_size: int = field(
        default=1,
        metadata={
            "help": "the most requests a caller (the HTTP ingress, bench.load's generators) "
            "sends to the LLM deployment in one Serve call: those made in one event-loop "
            "pass, placed by the router as one request, on one replica. A call costs the "
            "replica ~1.4 ms of CPU, so groups serve more requests a second (a gpt2 replica: "
            "0.43x -> 0.61x the bare engine at 256 users); 1 places each request on its own"
        },
    )
    http_proxy: str = field(
        default="haproxy",
        metadata={
            "help": "what fronts the ingress replicas on the HTTP port: haproxy (Ray Serve's "
            "HAProxy: each ingress replica serves HTTP on a port of its own and HAProxy "
            "balances the HTTP port over them; the Ray cluster must run with "
            "RAY_SERVE_ENABLE_HA_PROXY=1, which `python -m cluster serve` and bench.load "
            "set, with RAY_SERVE_THROUGHPUT_OPTIMIZED=1, when they start a local Ray) or "
            "serve (Serve's Python HTTP proxy, which forwards every SSE event as a message "
            "of its own)",
            "choices": HTTP_PROXIES,
        },
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "with http, every route but /health requires `Authorization: Bearer "
            "KEY` (401 otherwise); `python -m cluster serve` also reads KVFLEET_API_KEY. "
            "none: no key (the server binds 127.0.0.1 unless --host says otherwise)"
        },
    )
    http_body_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "with http, a request body not fully received this long after the "
            "handler starts reading it is answered 408 and its connection closed, so a "
            "client that declares 1,000 bytes and sends 10 holds nothing for long (a 1 MB "
            "body, the largest taken, needs 100 KB/s at the default). Behind HAProxy, which "
            "holds the client's connection while its body is due, `python -m cluster serve` "
            "sets HAProxy's client timeout to this + 1 s (cluster.app.set_ray_env), so the "
            "close follows the 408 that much later"
        },
    )
    access_log: bool = field(
        default=False,
        metadata={
            "help": "Serve's access log: one INFO line per request in each replica's and the "
            "ingress's log. Off as vLLM's --disable-log-requests: at ~330 requests/s on one "
            "replica, Serve's logging held 16% of the replica loop's GIL time with it and "
            "6% without (py-spy, CPU box)"
        },
    )
    engine_process: bool | None = field(
        default=None,
        metadata={
            "help": "run each replica's engine in a child process (cluster.engine_process), "
            "so Serve's per-request work and the engine's host work stop sharing one GIL; "
            "false: on a thread of the replica process; none: a child process when the "
            "replica has a GPU. On H200s a gpt2 replica served 1.56x the tokens/s in a "
            "child (55.3K -> 86.1K; 176K -> 243K on 4 replicas) at the same TTFT at "
            "concurrency 1; on a 2-core CPU box the child competes with the replica for the "
            "cores and served less"
        },
    )
    autoscale: bool = field(
        default=False,
        metadata={
            "help": "scale the LLM deployment between min_replicas and max_replicas on KV "
            "occupancy and the predicted queue wait (cluster.autoscale, router.autoscale), "
            "starting from num_replicas; off: num_replicas, fixed"
        },
    )
    min_replicas: int = field(default=1, metadata={"help": "with autoscale, the fewest replicas"})
    max_replicas: int = field(default=4, metadata={"help": "with autoscale, the most replicas"})
    upscale_delay_s: float = field(
        default=10.0,
        metadata={
            "help": "with autoscale, how long a scale-up must be wanted without a break "
            "before replicas are added (a replica takes seconds to start: its engine, "
            "weights and warm-up, so a shorter burst is better held by admission)"
        },
    )
    downscale_delay_s: float = field(
        default=120.0,
        metadata={
            "help": "with autoscale, how long occupancy must stay under downscale_kv_usage "
            "before replicas are removed (each removal drains the replica first)"
        },
    )
    upscale_wait_fraction: float = field(
        default=0.25,
        metadata={
            "help": "with autoscale, add replicas once the predicted queue wait (queued "
            "prompt tokens over the rate replicas admit them, fleet-wide) passes this "
            "fraction of max_queue_wait_s, the admission bound, so that capacity arrives "
            "before admission starts refusing (0.25: 0.5 s at the 2-s bound; the wait is "
            "part of every queued request's TTFT)"
        },
    )
    upscale_kv_usage: float = field(
        default=0.85,
        metadata={
            "help": "with autoscale, add replicas once the mean occupancy reaches this "
            "fraction: per replica KV usage (blocks held and promised to queued prompts) or "
            "sequence slots filled (running + waiting over max_num_seqs), whichever is "
            "fuller, as the kv router counts load"
        },
    )
    downscale_kv_usage: float = field(
        default=0.3,
        metadata={
            "help": "with autoscale, the low end of the occupancy band whose middle (with "
            "upscale_kv_usage) scaling aims at: replicas are removed once fewer would keep "
            "the occupancy under that middle (and the queue wait under its threshold) for "
            "downscale_delay_s, down to the fewest that do"
        },
    )
    replica_start_s: float = field(
        default=30.0,
        metadata={
            "help": "with autoscale, how long a new replica takes to take requests (Serve's "
            "deploy, engine, weights, warm-up: 36 s for one gpt2 replica on the H200): "
            "capacity asked for now arrives upscale_delay_s + this later, so the policy "
            "extrapolates the demand's rise (read from the admitted prompt-token rate's "
            "median slope over autoscale_trend_window_s) that far and scales up once the "
            "forecast passes upscale_kv_usage, sized for the demand three such horizons "
            "later. In the simulator it started the scale-up of a 5 -> 120 req/s ramp at "
            "11 s instead of 22 s"
        },
    )
    autoscale_headroom_rise_per_s: float = field(
        default=0.025,
        metadata={
            "help": "with autoscale, the rise (replicas' worth of demand a second) a fleet "
            "with load keeps spare capacity for over upscale_delay_s + replica_start_s: "
            "a rise that starts at rest runs on the replicas it has while the scale-up is "
            "seen, waited for and started (0.025: one replica's worth at the default 40 s; "
            "0: none)"
        },
    )
    autoscale_surge_z: float = field(
        default=1.64,
        metadata={
            "help": "with autoscale, a rise whose slope, at the lower end of its one-sided "
            "confidence interval at this z, alone passes the watermark plus the headroom "
            "within the horizon scales up without waiting upscale_delay_s (0: every rise "
            "waits)"
        },
    )
    autoscale_trend_window_s: float = field(
        default=10.0,
        metadata={
            "help": "with autoscale, the history the demand's slope is taken over (the "
            "admitted prompt-token rate's; no trend until a tenth of it has passed)"
        },
    )
    autoscale_look_back_s: float = field(
        default=5.0,
        metadata={
            "help": "with autoscale, the window Serve averages each replica's metrics over; "
            "replicas push them every fifth of it"
        },
    )
    graceful_shutdown_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "a replica being removed (scale-down, redeploy) gets no new requests "
            "and finishes those it has, its carrier streams ending with them; Serve kills "
            "it after this many seconds regardless, cutting what still runs, so keep it "
            "above the longest request (max_model_len tokens at the slowest decode rate)"
        },
    )
    app_name: str = field(default="kvfleet", metadata={"help": "the Serve application's name"})
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model's id in the HTTP API (/v1/models, each response's model; a "
            "request's model must be it or the model path); none: the model directory's "
            "basename, or the preset name"
        },
    )

    def __init__(self, **kwargs: Any) -> None:
        if "policy" in kwargs:
            raise ValueError(_POLICY_IS_ROUTER)
        values = resolve(ClusterConfig, kwargs)
        for f in fields(ClusterConfig):
            if f.name in values:
                value = values[f.name]
            else:
                value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: a nested config's field, read through.
        # An own field lands here only while unpickling (no __dict__ yet): refuse it,
        # or it would recurse.
        if name in ClusterConfig.__dataclass_fields__ or name not in flat_names(ClusterConfig):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return get_flat(self, name)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {self.engine!r}")
        if not isinstance(self.routing, RouterConfig):
            raise ValueError(f"routing must be a RouterConfig, got {self.routing!r}")
        positive_int("num_replicas", self.num_replicas)
        one_of("router", self.router, ROUTERS)
        policy = self.router if self.router in POLICIES else _ROUTER_DEFAULTS.policy
        if self.routing.policy != policy:
            object.__setattr__(self, "routing", dataclasses.replace(self.routing, policy=policy))
        if self.is_serve_router:
            for name in ADMISSION_FIELDS:
                if getattr(self.routing, name) != getattr(_ROUTER_DEFAULTS, name):
                    raise ValueError(
                        f"{name} is for kvfleet's routers and {self.router!r} is Ray Serve's; "
                        f"use a kvfleet router {POLICIES} or leave {name} at its default"
                    )
        positive_float("stats_period_s", self.stats_period_s)
        if self.stats_period_s > 1.0:
            raise ValueError(f"stats_period_s must be <= 1.0, got {self.stats_period_s!r}")
        positive_int("carrier_messages_per_step", self.carrier_messages_per_step)
        non_negative_float("num_gpus_per_replica", self.num_gpus_per_replica, allow_none=True)
        non_negative_float("num_cpus_per_replica", self.num_cpus_per_replica, allow_none=True)
        if self.engine.device == "cuda" and self.num_gpus_per_replica == 0:
            raise ValueError("num_gpus_per_replica must be > 0 when device is 'cuda'")
        if not isinstance(self.replica_resources, dict) or not all(
            isinstance(k, str)
            and k
            and not isinstance(v, bool)
            and isinstance(v, int | float)
            and math.isfinite(v)
            and v >= 0
            for k, v in self.replica_resources.items()
        ):
            raise ValueError(
                "replica_resources must map resource names to numbers >= 0, "
                f"got {self.replica_resources!r}"
            )
        if {"CPU", "GPU"} & set(self.replica_resources):
            raise ValueError(
                "replica_resources is for custom resources; CPUs and GPUs are "
                "num_cpus_per_replica and num_gpus_per_replica"
            )
        positive_int("max_ongoing_requests", self.max_ongoing_requests)
        positive_int("ingress_max_ongoing_requests", self.ingress_max_ongoing_requests)
        for name in ("max_queued_requests", "ingress_max_queued_requests"):
            value = getattr(self, name)
            if not (type(value) is int and value == -1):  # -1: Serve's unbounded
                positive_int(name, value)
        positive_float("backpressure_retry_after_s", self.backpressure_retry_after_s)
        non_negative_float("ingress_max_loop_lag_s", self.ingress_max_loop_lag_s, allow_none=True)
        is_bool("http", self.http)
        positive_int("ingress_replicas", self.ingress_replicas)
        if not isinstance(self.submit_group_size, int) or not 1 <= self.submit_group_size <= 256:
            raise ValueError(
                f"submit_group_size must be an integer in [1, 256], got {self.submit_group_size!r}"
            )
        one_of("http_proxy", self.http_proxy, HTTP_PROXIES)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")  # never echo it
        positive_float("http_body_timeout_s", self.http_body_timeout_s)
        is_bool("access_log", self.access_log)
        is_bool("engine_process", self.engine_process, allow_none=True)
        is_bool("autoscale", self.autoscale)
        positive_float("graceful_shutdown_timeout_s", self.graceful_shutdown_timeout_s)
        positive_float("autoscale_look_back_s", self.autoscale_look_back_s)
        self.autoscale_config()  # validates the policy's fields, naming them
        if self.autoscale and not self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ValueError(
                f"num_replicas ({self.num_replicas}) must be in [min_replicas, max_replicas] "
                f"([{self.min_replicas}, {self.max_replicas}]) with autoscale: replicas start "
                "from it"
            )
        non_empty_str("app_name", self.app_name)
        if self.served_model_name is not None:
            non_empty_str("served_model_name", self.served_model_name)

    @property
    def model_name(self) -> str:
        """The served model's id: served_model_name, else the model's basename."""
        if self.served_model_name is not None:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.engine.model))

    def autoscale_config(self) -> AutoscaleConfig:
        """The replica-count policy's config (router.autoscale). Its admission bound is
        the router's max_queue_wait_s; Serve's routers, or a router without that bound,
        leave AutoscaleConfig's default."""
        bound = None if self.is_serve_router else self.routing.max_queue_wait_s
        extra = {} if bound is None else {"max_queue_wait_s": bound}
        try:
            return AutoscaleConfig(
                min_replicas=self.min_replicas,
                max_replicas=self.max_replicas,
                upscale_delay_s=self.upscale_delay_s,
                downscale_delay_s=self.downscale_delay_s,
                upscale_wait_fraction=self.upscale_wait_fraction,
                kv_high_watermark=self.upscale_kv_usage,
                kv_low_threshold=self.downscale_kv_usage,
                replica_start_s=self.replica_start_s,
                trend_window_s=self.autoscale_trend_window_s,
                headroom_rise_per_s=self.autoscale_headroom_rise_per_s,
                surge_z=self.autoscale_surge_z,
                **extra,
            )
        except ValueError as exc:  # name ClusterConfig's fields, not the policy's
            message = str(exc)
            for ours, theirs in _AUTOSCALE_NAMES.items():
                message = message.replace(theirs, ours)
            raise ValueError(message) from None

    @property
    def is_serve_router(self) -> bool:
        """True when router is one of Ray Serve's own routers (no kvfleet admission)."""
        return self.router in SERVE_ROUTERS

    def resolve_num_gpus(self, cluster_gpus: float) -> float:
        """GPUs per replica actor, given how many GPUs the Ray cluster has in all."""
        if self.num_gpus_per_replica is not None:
            return float(self.num_gpus_per_replica)
        if self.engine.device == "cpu":
            return 0.0
        if cluster_gpus > 0:
            return 1.0
        if self.engine.device == "cuda":
            raise ValueError("device is 'cuda' but the Ray cluster has no GPUs")
        return 0.0

    def resolve_num_cpus(self, num_gpus: float) -> float:
        """CPUs per replica actor, given its GPUs (resolve_num_gpus)."""
        if self.num_cpus_per_replica is not None:
            return float(self.num_cpus_per_replica)
        return 0.0 if num_gpus else 1.0

    def engine_config(self, replica_id: str, num_gpus: float) -> EngineConfig:
        """The EngineConfig one replica builds its engine from: `engine` with its
        replica_id, and device "auto" resolved by whether the replica has a GPU."""
        device = self.engine.device
        if device == "auto":
            device = "cuda" if num_gpus > 0 else "cpu"
        return dataclasses.replace(self.engine, device=device, replica_id=replica_id)

    def router_config(self) -> RouterConfig:
        """The kvfleet RouterConfig; ValueError for Serve's routers, which take none."""
        if self.is_serve_router:
            raise ValueError(f"router {self.router!r} is Ray Serve's, it has no RouterConfig")
        return self.routing

    @classmethod
    def from_dict(cls, data: Mapping) -> ClusterConfig:
        """Build from a YAML/JSON-like mapping of flat names, where `engine:` and
        `routing:` (and `options:` inside engine) may also be mappings of their own; an
        unknown key raises ValueError naming it."""
        routing = data.get("routing") if isinstance(data, Mapping) else None
        if isinstance(data, Mapping) and ("policy" in data or (
            isinstance(routing, Mapping) and "policy" in routing
        )):  # fmt: skip
            raise ValueError(_POLICY_IS_ROUTER)
        return from_mapping(cls, data)


# ClusterConfig's name for each AutoscaleConfig field it sets under another name.
_AUTOSCALE_NAMES = {
    "upscale_kv_usage": "kv_high_watermark",
    "downscale_kv_usage": "kv_low_threshold",
    "autoscale_trend_window_s": "trend_window_s",
    "autoscale_headroom_rise_per_s": "headroom_rise_per_s",
    "autoscale_surge_z": "surge_z",
}

_POLICY_IS_ROUTER = (
    "policy: a ClusterConfig's routing policy is its router field (which also names Ray "
    "Serve's routers); set router instead"
)
