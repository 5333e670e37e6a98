"""ClusterConfig: the one frozen config of the Ray wiring, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from replica.config import KV_CACHE_DTYPES, EngineConfig
from router.config import POLICIES, RouterConfig

# Ray Serve's own request routers, run as peers of the kvfleet policies (no admission).
SERVE_ROUTERS = ("serve-pow2", "serve-round-robin", "serve-consistent-hash")
ROUTERS = (*POLICIES, *SERVE_ROUTERS)
# ClusterConfig fields that only kvfleet's routers (their admission control, their
# ranking) read.
ADMISSION_FIELDS = (
    "high_watermark",
    "queue_fraction",
    "on_overload",
    "max_hold_s",
    "balance_band",
)
ON_OVERLOAD = ("hold", "reject")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _replica_amount(name: str, value: object) -> None:
    """A replica's CPUs or GPUs: None (auto) or a finite number >= 0 (fractions share one)."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0 or None (auto), got {value!r}")


def _number_in(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """A kvfleet Serve application: which model, how many replicas, how requests route.

    Engine options (block_size .. device) are passed to every replica's EngineConfig;
    router options (high_watermark, queue_fraction, on_overload, max_hold_s,
    balance_band) to the KV request router (router.RouterConfig documents them).
    router is a kvfleet policy ("kv", "prefix", "pow2": router/ behind admission
    control) or one of Ray Serve's own routers as a peer: "serve-pow2" (Serve's
    default, power of two choices over queue lengths), "serve-round-robin", or
    "serve-consistent-hash" (a hash ring keyed by the prompt's first tokens, see
    cluster.request_router.PromptHashRouter). Serve's routers have no admission
    control, so setting an admission field away from its default raises with them.
    num_gpus_per_replica None means auto: 1 when the Ray cluster has GPUs and device
    is not "cpu", else 0 (resolved by `resolve_num_gpus`, at build time).
    num_cpus_per_replica None means 1 for a replica without a GPU and 0 for one with a
    GPU (resolve_num_cpus). Ray sets OMP_NUM_THREADS to it, so it is also the number of
    threads torch runs a CPU replica's ops on (at least 1).
    stats_period_s is how often each replica publishes ReplicaStats to the router.
    carrier_messages_per_step bounds what streaming costs a replica with many callers
    (processes with a Client): each caller's tokens go out every engine step while the
    replica has at most this many callers, and every ceil(callers / this) steps beyond
    (at most CARRIER_MAX_HOLD_S later); a request's first token and its end are always
    sent at once. Each message costs the replica's process a Serve streaming yield
    (~0.3 ms of CPU), taken from the engine thread's GIL time.
    access_log turns on Serve's access log (one INFO line per request in each replica's
    and the ingress's log). Off by default, as vLLM's --disable-log-requests: at ~330
    requests/s on one replica, Serve's logging held 16% of the replica loop's GIL time
    with it and 6% without (py-spy on the CPU box, BENCHMARKS.md "Where a replica's
    time goes"; not measured on a GPU).
    engine_process runs each replica's engine in a child process of the replica
    (cluster.engine_process), so Serve's per-request work and the engine's host work
    stop sharing one GIL; False keeps it on a thread of the replica process; None (the
    default) means a child process when the replica has a GPU, a thread otherwise. On
    H200s a gpt2 replica served 1.56x the tokens/s with the child process (55.3K ->
    86.1K, and 176K -> 243K on 4 replicas) at the same TTFT at concurrency 1; on a
    2-core CPU box the child competes with the replica for the cores and served less
    (BENCHMARKS.md, "Engine in a child process").
    """

    model: str = "gpt2-tiny"
    num_replicas: int = 1
    router: str = "kv"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    stats_period_s: float = 0.05
    carrier_messages_per_step: int = 4
    high_watermark: float = 0.95
    queue_fraction: float = 0.0
    on_overload: str = "hold"
    max_hold_s: float = 30.0
    balance_band: float = RouterConfig.balance_band
    num_gpus_per_replica: float | None = None
    num_cpus_per_replica: float | None = None
    # Custom Ray resources each replica actor needs, e.g. {"kvfleet_slot": 1} with one
    # slot per node to place one replica per node.
    replica_resources: dict[str, float] = field(default_factory=dict)
    max_ongoing_requests: int = 4096
    http: bool = False
    access_log: bool = False
    engine_process: bool | None = None
    app_name: str = "kvfleet"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        _positive_int("num_replicas", self.num_replicas)
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _positive_float("stats_period_s", self.stats_period_s)
        if self.stats_period_s > 1.0:
            raise ValueError(f"stats_period_s must be <= 1.0, got {self.stats_period_s!r}")
        _positive_int("carrier_messages_per_step", self.carrier_messages_per_step)
        _positive_float("high_watermark", self.high_watermark)
        if self.high_watermark > 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark!r}")
        _number_in("queue_fraction", self.queue_fraction, 0.0, 4.0)
        if self.on_overload not in ON_OVERLOAD:
            raise ValueError(f"on_overload must be one of {ON_OVERLOAD}, got {self.on_overload!r}")
        _positive_float("max_hold_s", self.max_hold_s)
        _number_in("balance_band", self.balance_band, 0.0, 1.0)
        if self.is_serve_router:
            defaults = {f.name: f.default for f in fields(self)}
            for name in ADMISSION_FIELDS:
                if getattr(self, name) != defaults[name]:
                    raise ValueError(
                        f"{name} is for kvfleet's routers and {self.router!r} is Ray Serve's; "
                        f"use a kvfleet router {POLICIES} or leave {name} at its default"
                    )
        _replica_amount("num_gpus_per_replica", self.num_gpus_per_replica)
        _replica_amount("num_cpus_per_replica", self.num_cpus_per_replica)
        if self.device == "cuda" and self.num_gpus_per_replica == 0:
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
        _positive_int("max_ongoing_requests", self.max_ongoing_requests)
        for name in ("http", "access_log"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be a bool or None, got {self.engine_process!r}")
        if not isinstance(self.app_name, str) or not self.app_name:
            raise ValueError(f"app_name must be a non-empty string, got {self.app_name!r}")

    @property
    def is_serve_router(self) -> bool:
        """True when router is one of Ray Serve's own routers (no kvfleet admission)."""
        return self.router in SERVE_ROUTERS

    def resolve_num_gpus(self, cluster_gpus: float) -> float:
        """GPUs per replica actor, given how many GPUs the Ray cluster has in all."""
        if self.num_gpus_per_replica is not None:
            return float(self.num_gpus_per_replica)
        if self.device == "cpu":
            return 0.0
        if cluster_gpus > 0:
            return 1.0
        if self.device == "cuda":
            raise ValueError("device is 'cuda' but the Ray cluster has no GPUs")
        return 0.0

    def resolve_num_cpus(self, num_gpus: float) -> float:
        """CPUs per replica actor, given its GPUs (resolve_num_gpus)."""
        if self.num_cpus_per_replica is not None:
            return float(self.num_cpus_per_replica)
        return 0.0 if num_gpus else 1.0

    def engine_config(self, replica_id: str, num_gpus: float) -> EngineConfig:
        """The EngineConfig one replica builds its engine from."""
        device = self.device
        if device == "auto":
            device = "cuda" if num_gpus > 0 else "cpu"
        return EngineConfig(
            model=self.model,
            device=device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            seed=self.seed,
            replica_id=replica_id,
        )

    def router_config(self) -> RouterConfig:
        """The kvfleet RouterConfig; ValueError for Serve's routers, which take none."""
        if self.is_serve_router:
            raise ValueError(f"router {self.router!r} is Ray Serve's, it has no RouterConfig")
        return RouterConfig(
            policy=self.router,
            high_watermark=self.high_watermark,
            queue_fraction=self.queue_fraction,
            on_overload=self.on_overload,
            max_hold_s=self.max_hold_s,
            balance_band=self.balance_band,
            seed=self.seed,
        )

    @classmethod
    def from_dict(cls, data: dict) -> ClusterConfig:
        """Build from a YAML/JSON-like dict; an unknown key raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"cluster config must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown cluster config field(s): {', '.join(unknown)}")
        return cls(**data)
