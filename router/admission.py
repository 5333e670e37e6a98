"""Admission control: which replicas may take a request now, and what to do when none may.

What the limit means with several routers. Every Serve handle and proxy runs
its own router with its own ReservationBook, and the only shared truth is the
stats snapshot each replica publishes. So the admission limit (room for the
prompt, usage under high_watermark) is per-router and approximate: within one
stats period each router only knows its own reservations, and k routers can
each admit a burst onto the same replica. Overshoot is bounded by
num_routers x (requests each routes in one stats period), and it lasts one
period, because the next snapshot carries those requests as used or waiting
blocks, and both count against room and watermark (router.load). The hard
backstop is the replica itself: its scheduler queues what does not fit and
preempts on block exhaustion; admission only keeps the queues short.

Each request is charged once: by this router's reservation until a snapshot
stamped after it was made, by the snapshot from then on, and never against
itself when Serve asks for the same request again.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from replica.stats import ReplicaStats
from router.base import RoutingPolicy
from router.config import RouterConfig
from router.errors import OverloadedError
from router.factory import make_policy
from router.load import committed_fraction, num_available_blocks, tiebreak
from router.request import RouteRequest

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Reservation:
    replica_id: str
    num_blocks: int
    reserved_at_s: float


class ReservationBook:
    """Blocks this router has sent to replicas that their last snapshot does not show yet.

    Algorithm: reserve() on each routing decision (keyed by request id, so
    re-routing the same request moves its reservation); a reservation is
    released by the first snapshot of its replica stamped after it was made
    (the snapshot then counts the request itself), or after ttl_s, whichever
    comes first. charge() shows a snapshot with the reserved blocks taken from
    free (then cached) blocks and counted as used, leaving out the reservation
    of the request being admitted (Serve re-asks for a request whose first
    choice it could not probe; that request's blocks are not in its own way).
    Cost: queries are O(1) from per-replica running totals; expiry pops from
    min-heaps on reserved_at_s (one per replica for snapshots, one global for
    the TTL), since both release rules release the oldest reservations first.
    Heap entries of released or moved reservations are skipped when popped.
    Invariant: a charged snapshot keeps free + cached + used == total, none
    negative; the totals equal sums over by_request (check_invariants()).
    Failure: snapshot timestamps and now_s must be on one clock (wall clock,
    time.time()); skew between router and replica hosts releases reservations
    early or late, the TTL bounds the late side.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.by_request: dict[str, Reservation] = {}
        self.num_blocks_by_replica: dict[str, int] = {}
        self.num_reservations_by_replica: dict[str, int] = {}
        # Entries (reserved_at_s, sequence number, request id, reservation).
        self.heap_by_replica: dict[str, list[tuple[float, int, str, Reservation]]] = {}
        self.ttl_heap: list[tuple[float, int, str, Reservation]] = []
        self.num_pushed = 0

    def reserve(self, request_id: str, replica_id: str, num_blocks: int, now_s: float) -> None:
        self.release(request_id)
        reservation = Reservation(replica_id, num_blocks, now_s)
        self.by_request[request_id] = reservation
        self.num_blocks_by_replica[replica_id] = (
            self.num_blocks_by_replica.get(replica_id, 0) + num_blocks
        )
        self.num_reservations_by_replica[replica_id] = (
            self.num_reservations_by_replica.get(replica_id, 0) + 1
        )
        entry = (now_s, self.num_pushed, request_id, reservation)
        self.num_pushed += 1
        heapq.heappush(self.heap_by_replica.setdefault(replica_id, []), entry)
        heapq.heappush(self.ttl_heap, entry)

    def release(self, request_id: str) -> None:
        reservation = self.by_request.pop(request_id, None)
        if reservation is None:
            return
        replica_id = reservation.replica_id
        num_left = self.num_reservations_by_replica[replica_id] - 1
        if num_left:
            self.num_reservations_by_replica[replica_id] = num_left
            self.num_blocks_by_replica[replica_id] -= reservation.num_blocks
        else:  # every entry left in its heap is stale
            del self.num_reservations_by_replica[replica_id]
            del self.num_blocks_by_replica[replica_id]
            del self.heap_by_replica[replica_id]

    def is_live(self, entry: tuple[float, int, str, Reservation]) -> bool:
        return self.by_request.get(entry[2]) is entry[3]

    def expire_replica(self, replica_id: str, snapshot_s: float, now_s: float) -> None:
        """Drop replica_id's reservations covered by its snapshot at snapshot_s, or past the TTL."""
        heap = self.heap_by_replica.get(replica_id)
        ttl_s = self.ttl_s
        while heap:
            entry = heap[0]
            reserved_at_s = entry[0]
            if self.is_live(entry):
                if now_s - reserved_at_s < ttl_s and snapshot_s <= reserved_at_s:
                    return
                self.release(entry[2])
                if replica_id not in self.heap_by_replica:  # that was its last one
                    return
            heapq.heappop(heap)

    def expire_ttl(self, now_s: float) -> None:
        """Drop every reservation, of any replica, that outlived the TTL."""
        heap, ttl_s = self.ttl_heap, self.ttl_s
        while heap and (not self.is_live(heap[0]) or now_s - heap[0][0] >= ttl_s):
            entry = heapq.heappop(heap)
            if self.is_live(entry):
                self.release(entry[2])

    def expire(self, stats: Sequence[ReplicaStats], now_s: float) -> None:
        """Drop reservations that a newer snapshot covers or that outlived the TTL."""
        self.expire_ttl(now_s)
        for s in stats:
            self.expire_replica(s.replica_id, s.timestamp_s, now_s)

    def num_reserved_blocks(self, replica_id: str) -> int:
        return self.num_blocks_by_replica.get(replica_id, 0)

    def num_reservations(self, replica_id: str) -> int:
        return self.num_reservations_by_replica.get(replica_id, 0)

    def check_invariants(self) -> None:
        blocks: dict[str, int] = {}
        counts: dict[str, int] = {}
        for r in self.by_request.values():
            blocks[r.replica_id] = blocks.get(r.replica_id, 0) + r.num_blocks
            counts[r.replica_id] = counts.get(r.replica_id, 0) + 1
        assert blocks == self.num_blocks_by_replica, (blocks, self.num_blocks_by_replica)
        assert counts == self.num_reservations_by_replica, (
            counts,
            self.num_reservations_by_replica,
        )
        assert set(self.heap_by_replica) == set(counts)
        live = {e[2] for e in self.ttl_heap if self.is_live(e)}
        assert live == set(self.by_request)

    def charge(self, stats: ReplicaStats, exclude_request_id: str | None = None) -> ReplicaStats:
        num_reserved = self.num_reserved_blocks(stats.replica_id)
        own = self.by_request.get(exclude_request_id) if exclude_request_id is not None else None
        if own is not None and own.replica_id == stats.replica_id:
            num_reserved -= own.num_blocks
        if num_reserved == 0:
            return stats
        from_free = min(num_reserved, stats.num_blocks_free)
        from_cached = min(num_reserved - from_free, stats.num_blocks_cached)
        num_free = stats.num_blocks_free - from_free
        num_cached = stats.num_blocks_cached - from_cached
        num_used = stats.num_blocks_total - num_free - num_cached
        return replace(
            stats,
            num_blocks_free=num_free,
            num_blocks_cached=num_cached,
            kv_usage=num_used / stats.num_blocks_total,
        )


def refusal(stats: ReplicaStats, request: RouteRequest, high_watermark: float) -> str | None:
    """Why a (charged) replica cannot admit the request now, or None if it can.

    Queued prompts count as taken blocks in both tests (router.load), so a request
    is held back by the same blocks whether it is still this router's reservation,
    waiting on the replica, or running there.
    """
    num_needed = request.num_prompt_blocks(stats.block_size)
    num_available = num_available_blocks(stats)
    if num_available < num_needed:
        return f"{stats.replica_id}: {num_available} blocks available < {num_needed} needed"
    usage = committed_fraction(stats)
    if usage >= high_watermark:
        return (
            f"{stats.replica_id}: kv usage with queue {usage:.3f} >= "
            f"high_watermark {high_watermark}"
        )
    return None


@dataclass(frozen=True)
class Decision:
    """Admitted (tiers non-empty, best first) or held (tiers empty: retry after retry_after_s)."""

    tiers: list[list[str]] = field(default_factory=list)
    retry_after_s: float = 0.0
    reason: str = ""

    @property
    def admitted(self) -> bool:
        return bool(self.tiers)


class Admission:
    """Filters replicas by room and watermark, ranks the rest with the policy, handles overload.

    Algorithm, per call of admit():
      1. expire reservations covered by newer snapshots or past the TTL;
      2. fresh replicas (snapshot no older than stats_max_age_s), charged with
         this router's reservations, that pass refusal() are ranked by the policy;
      3. stale replicas whose last snapshot (charged) would still admit, and
         replicas with no snapshot at all, follow as last-resort tiers (fewest
         reservations first): unknown is not trusted, but is not proof of overload;
      4. nothing admissible: "reject" raises OverloadedError(retry_after_s =
         backoff_max_s); "hold" returns a Decision with the backoff delay for
         this attempt, and raises OverloadedError once max_hold_s is spent.
    Invariant: a replica whose fresh snapshot refuses the request is never in
    the tiers; a held request waits at most max_hold_s in total.
    Failure: a prompt larger than every replica's whole cache raises at once.
    """

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config)
        self.reservations = ReservationBook(config.reservation_ttl_s)
        self.block_size_by_replica: dict[str, int] = {}

    def is_fresh(self, stats: ReplicaStats, now_s: float) -> bool:
        return now_s - stats.timestamp_s <= self.config.stats_max_age_s

    def admit(
        self,
        stats: Sequence[ReplicaStats],
        request: RouteRequest,
        now_s: float,
        *,
        unknown_replica_ids: Sequence[str] = (),
        attempt: int = 0,
        held_since_s: float | None = None,
    ) -> Decision:
        config = self.config
        stats = [s for s in stats if s.num_blocks_total > 0 and s.block_size > 0]
        self.reservations.expire(stats, now_s)
        for s in stats:
            self.block_size_by_replica[s.replica_id] = s.block_size

        admissible, last_resort, refusals = [], list(unknown_replica_ids), []
        for s in stats:
            charged = self.reservations.charge(s, request.request_id)
            why = refusal(charged, request, config.high_watermark)
            if why is not None:
                refusals.append(why)
            elif self.is_fresh(s, now_s):
                admissible.append(charged)
            else:
                last_resort.append(s.replica_id)
        tiers = self.policy.choose_replicas(admissible, request, now_s) if admissible else []
        last_resort.sort(
            key=lambda r: (
                self.reservations.num_reservations(r),
                tiebreak(config.seed, request.request_id, r),
            )
        )
        tiers += [[r] for r in last_resort]
        if tiers:
            return Decision(tiers)

        reason = "; ".join(refusals) if refusals else "no replicas"
        if (
            stats
            and not last_resort
            and all(request.num_prompt_blocks(s.block_size) > s.num_blocks_total for s in stats)
        ):
            raise OverloadedError(config.backoff_max_s, f"prompt larger than any replica: {reason}")
        if config.on_overload == "reject":
            raise OverloadedError(config.backoff_max_s, f"overloaded: {reason}")
        held_since_s = now_s if held_since_s is None else held_since_s
        remaining_s = config.max_hold_s - (now_s - held_since_s)
        if remaining_s <= 0:
            raise OverloadedError(
                config.backoff_max_s, f"held {config.max_hold_s}s, still overloaded: {reason}"
            )
        return Decision([], min(config.backoff_s(attempt), remaining_s), reason)

    def reserve(self, request: RouteRequest, replica_id: str, now_s: float) -> None:
        """Record that the request was routed to replica_id (moves an earlier reservation)."""
        block_size = self.block_size_by_replica.get(replica_id, DEFAULT_BLOCK_SIZE)
        num_blocks = max(1, request.num_prompt_blocks(block_size))
        self.reservations.reserve(request.request_id, replica_id, num_blocks, now_s)

    def confirm(self, request: RouteRequest, replica_id: str) -> None:
        """The request was handed to replica_id (Serve may have fallen to a lower tier).

        The reservation moves there if it is elsewhere, keeping the time it was
        made: the request cannot be in a snapshot stamped before that, and may be
        in any stamped after, so a later time would keep charging blocks the
        replica already reports. For the same reason a reservation already
        released (by such a snapshot, or the TTL) is not made again.
        """
        reservation = self.reservations.by_request.get(request.request_id)
        if reservation is None or reservation.replica_id == replica_id:
            return
        block_size = self.block_size_by_replica.get(replica_id, DEFAULT_BLOCK_SIZE)
        num_blocks = max(1, request.num_prompt_blocks(block_size))
        self.reservations.reserve(
            request.request_id, replica_id, num_blocks, reservation.reserved_at_s
        )

    def release(self, request_id: str) -> None:
        self.reservations.release(request_id)
