"""RouterConfig: the router layer's one frozen config."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.validate import is_int, non_negative_int, number_in, one_of, positive_float

POLICIES = ("kv", "prefix", "pow2")
OVERLOAD_MODES = ("hold", "reject")


@dataclass(frozen=True)
class RouterConfig:
    """How requests are ranked over replicas and when they may enter at all.

    Loads and thresholds are fractions of a replica's KV blocks, so replicas of
    different sizes compare fairly. Every field is JSON-serialisable, so the
    config travels to Ray Serve as request_router_kwargs (dataclasses.asdict).
    Each field documents itself (metadata["help"], the flags' help of every CLI).
    """

    policy: str = field(
        default="kv",
        metadata={
            "help": "kv: least KV work first (blocks or sequence slots, whichever is "
            "fuller); prefix: the replica holding the longest cached "
            "prefix of the prompt, by load when loads are unbalanced; pow2: the less loaded "
            "of two random replicas",
            "choices": POLICIES,
        },
    )
    high_watermark: float = field(
        default=0.95,
        metadata={
            "help": "a replica whose KV usage (with its queued prompts and this router's "
            "reservations) is at or above this fraction admits nothing new"
        },
    )
    queue_fraction: float = field(
        default=0.0,
        metadata={
            "help": "how far past its blocks a replica may be committed (used + queued "
            "prompts + reservations), as a fraction of them, in [0, 4]: both the room test "
            "and the watermark allow this much more, and the replica's own queue takes what "
            "does not fit yet, scheduling it the moment blocks free (which the router would "
            "learn only a stats delay later). 0: only room a snapshot shows free. In the "
            "simulator at KV saturation, 0.1-0.5 admitted what the replicas carry where 0 "
            "held most requests"
        },
    )
    on_overload: str = field(
        default="hold",
        metadata={
            "help": "when no replica may admit a request: hold (wait with backoff up to "
            "max_hold_s, then raise OverloadedError) or reject (raise it at once)",
            "choices": OVERLOAD_MODES,
        },
    )
    max_queue_wait_s: float | None = field(
        default=2.0,
        metadata={
            "help": "a request whose expected queueing wait (the prompt tokens queued ahead "
            "of it on the best replica, and held at this router, over the rate that "
            "replica's engine drains its queue: router.queue_wait) exceeds this is refused "
            "at once, never held: OverloadedError with a Retry-After of the time that "
            "backlog takes to drain (HTTP 503). Seconds; it bounds the wait for a slot, not "
            "the TTFT, which adds the prompt's own prefill and the way in. none: no bound "
            "(admission by KV room and watermark alone)"
        },
    )
    max_hold_s: float = field(
        default=30.0, metadata={"help": "longest a held request waits before OverloadedError"}
    )
    backoff_initial_s: float = field(
        default=0.05, metadata={"help": "a held request's first wait before it retries"}
    )
    backoff_max_s: float = field(
        default=1.0, metadata={"help": "the longest wait between a held request's retries"}
    )
    backoff_multiplier: float = field(
        default=2.0, metadata={"help": "each retry waits this many times longer (>= 1)"}
    )
    stats_max_age_s: float = field(
        default=2.0,
        metadata={
            "help": "stats older than this are not trusted: such replicas form a last-resort tier"
        },
    )
    balance_abs_threshold: float = field(
        default=0.5,
        metadata={
            "help": "prefix routes by load instead of cache affinity when max_load - "
            "min_load > this and max_load > balance_rel_threshold * min_load (SGLang's "
            "cache-aware router; its absolute threshold is 64 queued requests). Loads are "
            "fractions of KV blocks and one 4K-token prompt is 0.085 of a 3072-block "
            "replica: at 0.1 the rule fired in 61% of a 4-H200 fleet's first 0.25 s of "
            "decisions, spreading every shared prefix over every replica before any was "
            "cached. This is the gap for a request the loaded replica caches none of; it "
            "grows with the share cached there, to 1.0 at half the prompt (router.prefix)"
        },
    )
    balance_rel_threshold: float = field(
        default=1.5, metadata={"help": "see balance_abs_threshold (>= 1)"}
    )
    balance_band: float = field(
        default=0.1,
        metadata={
            "help": "kv and prefix rank replicas whose load is within this of the least "
            "loaded as equals (seeded tiebreak per request): one request moves a replica's "
            "load by little against the gaps between replicas, so strict order sends runs "
            "of requests to the least loaded one until it catches up, and their prefills "
            "queue there (simulator). 0: strict load order"
        },
    )
    prefix_affinity_tokens: int = field(
        default=64,
        metadata={
            "help": "prefix orders replicas that tie on cached blocks by a hash of the "
            "prompt's first this-many tokens (whole blocks; rendezvous hashing), not by "
            "load, while loads are balanced: every router then sends one prefix to the same "
            "replica before any replica has published it, and while published summaries "
            "are stale (Serve delivers them ~0.2 s old under load). 0: by (banded) load"
        },
    )
    reservation_ttl_s: float = field(
        default=2.0,
        metadata={
            "help": "a reservation lives until a snapshot of its replica counts the "
            "request, or this long. Once the replica's ack says when its engine admitted "
            "the request, that is the first snapshot stamped after then "
            "(router.ReservationBook); until then, see reservation_arrival_s"
        },
    )
    reservation_arrival_s: float = field(
        default=0.05,
        metadata={
            "help": "before the ack, a reservation ends at the first snapshot stamped more "
            "than this after the decision: the request reaches the engine up to one call "
            "and one engine step after the router chose it"
        },
    )
    seed: int = field(default=0, metadata={"help": "seeds the per-request tiebreaks"})
    prefix_salt: str = field(
        default="",
        repr=False,
        metadata={
            "help": "the replicas' EngineConfig.prefix_salt: a prompt's block hashes are "
            "matched against the replicas' only when both hash from the same salt "
            "(replica.hashing.root_hash; a cluster sets both from one flat prefix_salt)"
        },
    )

    def __post_init__(self) -> None:
        one_of("policy", self.policy, POLICIES)
        number_in("high_watermark", self.high_watermark, 0.0, 1.0, low_open=True)
        number_in("queue_fraction", self.queue_fraction, 0.0, 4.0)
        one_of("on_overload", self.on_overload, OVERLOAD_MODES)
        if self.max_queue_wait_s is not None:
            positive_float("max_queue_wait_s", self.max_queue_wait_s)
        for name in (
            "max_hold_s",
            "backoff_initial_s",
            "backoff_max_s",
            "stats_max_age_s",
            "reservation_ttl_s",
        ):
            positive_float(name, getattr(self, name))
        number_in("reservation_arrival_s", self.reservation_arrival_s, 0.0, float("inf"))
        if not self.reservation_arrival_s < self.reservation_ttl_s:
            raise ValueError(
                f"reservation_arrival_s must be in [0, reservation_ttl_s), "
                f"got {self.reservation_arrival_s}"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= "
                f"backoff_initial_s ({self.backoff_initial_s})"
            )
        number_in("backoff_multiplier", self.backoff_multiplier, 1.0, float("inf"))
        number_in("balance_band", self.balance_band, 0.0, 1.0)
        number_in("balance_abs_threshold", self.balance_abs_threshold, 0.0, float("inf"))
        number_in("balance_rel_threshold", self.balance_rel_threshold, 1.0, float("inf"))
        non_negative_int("prefix_affinity_tokens", self.prefix_affinity_tokens)
        is_int("seed", self.seed)
        if not isinstance(self.prefix_salt, str):
            raise ValueError("prefix_salt must be a string")  # never echo a salt

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry number `attempt` (0-based): exponential, capped."""
        return min(
            self.backoff_initial_s * self.backoff_multiplier ** min(attempt, 64), self.backoff_max_s
        )
