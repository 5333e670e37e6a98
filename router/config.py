"""RouterConfig: the router layer's one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("kv", "prefix", "pow2")
OVERLOAD_MODES = ("hold", "reject")


@dataclass(frozen=True)
class RouterConfig:
    """How requests are ranked over replicas and when they may enter at all.

    Loads and thresholds are fractions of a replica's KV blocks, so replicas of
    different sizes compare fairly. Every field is JSON-serialisable, so the
    config travels to Ray Serve as request_router_kwargs (dataclasses.asdict).
    """

    policy: str = "kv"
    # A replica whose KV usage (including its queued prompts and this router's
    # reservations) is at or above this fraction admits nothing new.
    high_watermark: float = 0.95
    # How far past its blocks a replica may be committed (used + queued prompts +
    # reservations), as a fraction of them: both the room test (blocks for the prompt)
    # and the watermark allow this much more. The replica's own queue takes what does
    # not fit yet and schedules it the moment blocks free, which the router would only
    # learn a stats delay later. 0 (the default): only room that a snapshot shows free.
    # In the simulator at KV saturation 0.1-0.5 admitted what the replicas carry where
    # 0 held most requests (BENCHMARKS.md "Simulator: shared prefixes at KV saturation").
    queue_fraction: float = 0.0
    # "hold": wait with backoff up to max_hold_s, then raise OverloadedError.
    # "reject": raise OverloadedError at once.
    on_overload: str = "hold"
    max_hold_s: float = 30.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    backoff_multiplier: float = 2.0
    # Stats older than this are not trusted: such replicas form a last-resort tier.
    stats_max_age_s: float = 2.0
    # Prefix policy routes by load instead of cache affinity when
    # max_load - min_load > balance_abs_threshold and
    # max_load > balance_rel_threshold * min_load (SGLang cache-aware router; its absolute
    # threshold is 64 queued requests). Loads are fractions of a replica's KV blocks, and
    # one 4K-token prompt is 0.085 of a 3072-block replica: at 0.1 the rule fired in 61%
    # of the decisions of a fleet's first 0.25 s on 4 H200s, spreading every shared prefix
    # over every replica before any was cached (BENCHMARKS.md).
    balance_abs_threshold: float = 0.5
    balance_rel_threshold: float = 1.5
    # kv and prefix rank replicas whose load is within balance_band of the least loaded
    # as equals (seeded tiebreak per request), not strictly by load: one request moves a
    # replica's load by little against the gaps between replicas, so strict order sends
    # runs of requests to the least loaded one until it catches up, and their prefills
    # queue there (simulator, BENCHMARKS.md "the kv balance band"). 0: strict order.
    balance_band: float = 0.1
    # prefix orders replicas that tie on cached blocks by a hash of the prompt's first
    # prefix_affinity_tokens tokens (whole blocks; rendezvous hashing), not by load, while
    # loads are balanced (the thresholds above): every router then sends one prefix to the
    # same replica, before any replica has published it and while published prefix
    # summaries are stale (Serve delivers them ~0.2 s old under load, BENCHMARKS.md),
    # instead of each copying it onto the replica that looked lightest to it. 0: by
    # (banded) load, then per request, as kv.
    prefix_affinity_tokens: int = 64
    # A reservation lives until a snapshot of its replica counts the request, or
    # reservation_ttl_s. Once the replica's ack says when its engine admitted the
    # request, that is the first snapshot stamped after then (router.ReservationBook);
    # until then, the first stamped more than reservation_arrival_s after the decision:
    # the request reaches the engine up to one call and one engine step after the
    # router chose it, and a snapshot stamped in between does not count it yet.
    reservation_ttl_s: float = 2.0
    reservation_arrival_s: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 <= self.queue_fraction <= 4.0:
            raise ValueError(f"queue_fraction must be in [0, 4], got {self.queue_fraction}")
        if self.on_overload not in OVERLOAD_MODES:
            raise ValueError(
                f"on_overload must be one of {OVERLOAD_MODES}, got {self.on_overload!r}"
            )
        for name in (
            "max_hold_s",
            "backoff_initial_s",
            "backoff_max_s",
            "stats_max_age_s",
            "reservation_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.reservation_arrival_s < self.reservation_ttl_s:
            raise ValueError(
                f"reservation_arrival_s must be in [0, reservation_ttl_s), "
                f"got {self.reservation_arrival_s}"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= "
                f"backoff_initial_s ({self.backoff_initial_s})"
            )
        if self.backoff_multiplier < 1.0:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")
        if not 0.0 <= self.balance_band <= 1.0:
            raise ValueError(f"balance_band must be in [0, 1], got {self.balance_band}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}"
            )
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}"
            )
        if (
            not isinstance(self.prefix_affinity_tokens, int)
            or isinstance(self.prefix_affinity_tokens, bool)
            or self.prefix_affinity_tokens < 0
        ):
            raise ValueError(
                f"prefix_affinity_tokens must be an int >= 0, got {self.prefix_affinity_tokens!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry number `attempt` (0-based): exponential, capped."""
        return min(
            self.backoff_initial_s * self.backoff_multiplier ** min(attempt, 64), self.backoff_max_s
        )
