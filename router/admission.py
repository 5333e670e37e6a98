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

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from replica.stats import ReplicaStats
from router.base import RoutingPolicy
from router.candidates import Candidates
from router.config import RouterConfig
from router.errors import OverloadedError
from router.factory import make_policy
from router.fleet import Fleet
from router.load import committed_fraction, num_available_blocks
from router.queue_wait import DrainRates, expected_wait_s, slot_wait_s
from router.request import RouteRequest
from router.reservations import Reservation, ReservationBook
from router.room import Room, room_for
from router.tiebreak import tiebreak

__all__ = ["Admission", "Decision", "DecisionView", "Reservation", "ReservationBook", "refusal"]

DEFAULT_BLOCK_SIZE = 16
# Refusals named in a held or rejected decision's reason; the rest are counted.
MAX_REFUSALS_NAMED = 4
# The longest Retry-After given for a backlog that does not drain (a replica whose engine
# took nothing from its queue for router.queue_wait.MIN_BACKLOG_S: rate 0, wait inf).
MAX_RETRY_AFTER_S = 60.0


def refusal(
    stats: ReplicaStats,
    request: RouteRequest,
    high_watermark: float,
    queue_fraction: float = 0.0,
    num_needed: int | None = None,
    num_shared: int = 0,
) -> str | None:
    """Why a (charged) replica cannot admit the request now, or None if it can.

    Queued prompts count as taken blocks in both tests (router.load), so a request
    is held back by the same blocks whether it is still this router's reservation,
    waiting on the replica, or running there. queue_fraction: see RouterConfig.
    num_needed: the blocks the request needs there (default: its whole prompt);
    num_shared: its prompt blocks cached there. A replica holding at least as many
    of them as the request needs anew takes it past the watermark (Room.refused).
    """
    if num_needed is None:
        num_needed = request.num_prompt_blocks(stats.block_size)
    num_available = num_available_blocks(stats, queue_fraction)
    if num_available < num_needed:
        return f"{stats.replica_id}: {num_available} blocks available < {num_needed} needed"
    usage = committed_fraction(stats)
    if usage >= high_watermark + queue_fraction and num_shared < max(num_needed, 1):
        return (
            f"{stats.replica_id}: kv usage with queue {usage:.3f} >= "
            f"high_watermark {high_watermark} + queue_fraction {queue_fraction}"
        )
    return None


@dataclass(frozen=True)
class DecisionView:
    """What one decision read, by fleet slot: for explaining it (cluster.routing_trace),
    never for routing. References to the decision's own arrays and the fleet's ids, so
    building it costs nothing; valid until the fleet next changes."""

    replica_ids: Sequence[str]  # by fleet slot
    loads: np.ndarray  # float64: load_fraction with the request (Room.load)
    admissible: np.ndarray  # int64: fresh slots with room, those the policy ranked
    matched: np.ndarray | None  # int64: leading prompt blocks cached; None: no prefix index
    timestamps_s: np.ndarray  # float64: each slot's snapshot stamp


@dataclass(frozen=True)
class Decision:
    """Admitted (tiers non-empty, best first) or held (tiers empty: retry after retry_after_s)."""

    tiers: list[list[str]] = field(default_factory=list)
    retry_after_s: float = 0.0
    reason: str = ""
    view: DecisionView | None = field(default=None, compare=False, repr=False)

    @property
    def admitted(self) -> bool:
        return bool(self.tiers)


class Admission:
    """Filters replicas by room and watermark, ranks the rest with the policy, handles overload.

    Algorithm, per decision:
      1. expire reservations past the TTL, and those of replicas whose snapshot
         or reservations changed that a snapshot stamped after them covers;
      2. fresh replicas (snapshot no older than stats_max_age_s), charged with
         this router's reservations (not the request's own), that have room and
         are under the watermark (router.room) are ranked by the policy;
      3. stale replicas whose last snapshot (charged) would still admit, and
         replicas with no snapshot at all, follow as last-resort tiers (fewest
         reservations first): unknown is not trusted, but is not proof of overload;
         Replicas where the request's expected queueing wait (router.queue_wait:
         prompt tokens queued there and held at this router, over the replica's
         measured drain rate; or, where a full replica forecasts its slots, the time
         until the slot it needs frees and the prompts ahead of it are prefilled)
         exceeds max_queue_wait_s are left out of both;
      4. nothing admissible because of that wait: OverloadedError at once, in either
         overload mode (holding would only lengthen the wait), its retry_after_s the
         time the least backlogged replica takes to drain its queue;
      5. nothing admissible otherwise: "reject" raises OverloadedError(retry_after_s =
         backoff_max_s); "hold" returns a Decision with the backoff delay for
         this attempt, and raises OverloadedError once max_hold_s is spent.
    Replicas live in a Fleet (numpy columns, prefix index) updated per changed
    snapshot: admit(stats, ...) syncs it with the given list (identity checks),
    or an incremental caller (the simulator) calls observe()/forget() as
    snapshots arrive and decide() per request.
    Cost: O(changed snapshots + changed reservations) of Python, then numpy over
    the replicas and the policy's own cost; no Python loop over replicas.
    Invariant: a replica whose fresh snapshot refuses the request is never in
    the tiers, nor one whose fresh snapshot gives it an expected wait past
    max_queue_wait_s; a held request waits at most max_hold_s in total.
    Failure: a prompt larger than every replica's whole cache raises at once.
    """

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config)
        self.reservations = ReservationBook(config.reservation_ttl_s, config.reservation_arrival_s)
        self.fleet = Fleet(with_prefix_index=self.policy.needs_prefix_index)
        self.drain = DrainRates()
        self.block_size_by_replica: dict[str, int] = {}
        # The last decision's request, the fleet version it read and its matched blocks
        # per slot: the reservation that follows it reuses them (num_blocks_to_reserve).
        self._decided_match: tuple[RouteRequest, int, np.ndarray] | None = None

    def observe(self, stats: ReplicaStats) -> None:
        """A replica's newer snapshot (incremental callers; admit() does this itself,
        where the drain rates see the snapshots current at each decision)."""
        self.fleet.observe(stats)
        self.drain.observe(stats)

    def forget(self, replica_id: str) -> None:
        """The replica left; its reservations stay until the TTL, as its requests may run."""
        self.fleet.forget(replica_id)
        self.drain.forget(replica_id)

    def admit(
        self,
        stats: Sequence[ReplicaStats],
        request: RouteRequest,
        now_s: float,
        *,
        unknown_replica_ids: Sequence[str] = (),
        attempt: int = 0,
        held_since_s: float | None = None,
        num_held_tokens: int = 0,
    ) -> Decision:
        """decide() over exactly the replicas in `stats` (plus unknown_replica_ids)."""
        self.fleet.sync(stats)
        return self.decide(
            request,
            now_s,
            unknown_replica_ids=unknown_replica_ids,
            attempt=attempt,
            held_since_s=held_since_s,
            num_held_tokens=num_held_tokens,
        )

    def decide(
        self,
        request: RouteRequest,
        now_s: float,
        *,
        unknown_replica_ids: Sequence[str] = (),
        attempt: int = 0,
        held_since_s: float | None = None,
        num_held_tokens: int = 0,
    ) -> Decision:
        """The decision over the replicas observed so far (plus unknown_replica_ids).

        num_held_tokens: prompt tokens of the other requests this router holds (they
        enter before this one, wherever they go: router.queue_wait)."""
        config, fleet = self.config, self.fleet
        self.settle_reservations(now_s)
        own = self.reservations.by_request.get(request.request_id)
        own_slot = fleet.slot_of.get(own.replica_id) if own is not None else None
        matched = self.matched_blocks(request, np.arange(len(fleet)))
        self._decided_match = None if matched is None else (request, fleet.version, matched)
        own_blocks = own.num_blocks if own is not None else 0
        room = room_for(fleet, request, own_slot, own_blocks, matched, config.queue_fraction)
        refused = room.refused(config.high_watermark)
        fresh = now_s - fleet.column("timestamp_s") <= config.stats_max_age_s
        wait_s = self.queue_wait_s(own_slot, own_blocks, num_held_tokens, now_s)
        too_long = np.zeros(len(fleet), dtype=bool)
        if config.max_queue_wait_s is not None:
            too_long = fresh & ~refused & (wait_s > config.max_queue_wait_s)
        admissible = np.flatnonzero(~refused & fresh & ~too_long)
        tiers = []
        if len(admissible):
            candidates = Candidates(
                fleet,
                admissible,
                room.load[admissible],
                None if matched is None else matched[admissible],
            )
            tiers = self.policy.rank(candidates, request)
        stale = np.flatnonzero(~refused & ~fresh).tolist()
        last_resort = [*unknown_replica_ids, *(fleet.ids[slot] for slot in stale)]
        last_resort.sort(
            key=lambda r: (
                self.reservations.num_reservations(r),
                tiebreak(config.seed, request.request_id, r),
            )
        )
        tiers += [[r] for r in last_resort]
        if tiers:
            view = DecisionView(
                fleet.ids, room.load, admissible, matched, fleet.column("timestamp_s")
            )
            return Decision(tiers, view=view)

        if too_long.any():
            slots = np.flatnonzero(too_long)
            best = int(slots[np.argmin(wait_s[slots])])
            raise OverloadedError(
                min(float(wait_s[best]), MAX_RETRY_AFTER_S),
                f"expected wait {wait_s[best]:.2f}s on {fleet.ids[best]} (the least "
                f"backlogged of {len(slots)}) > max_queue_wait_s {config.max_queue_wait_s}",
            )
        reason = self.refusals(np.flatnonzero(refused), request, now_s, room)
        reason = reason or "no replicas"
        if len(fleet) and not last_resort and bool(np.all(room.needed > fleet.column("total"))):
            raise OverloadedError(config.backoff_max_s, f"prompt larger than any replica: {reason}")
        if config.on_overload == "reject":
            raise OverloadedError(config.backoff_max_s, f"overloaded: {reason}")
        held_since_s = now_s if held_since_s is None else held_since_s
        # From the absolute deadline, not max_hold_s - elapsed: that can leave a positive
        # remainder under now_s's float resolution (3.6e-15 at 46 s), so a retry after it
        # lands at the same now_s forever (the simulator's clock livelocked so). Here a
        # retry at now_s + remaining_s is the deadline exactly, where nothing remains.
        remaining_s = (held_since_s + config.max_hold_s) - now_s
        if remaining_s <= 0:
            raise OverloadedError(
                config.backoff_max_s, f"held {config.max_hold_s}s, still overloaded: {reason}"
            )
        return Decision([], min(config.backoff_s(attempt), remaining_s), reason)

    def settle_reservations(self, now_s: float) -> None:
        """Expire what the TTL or newer snapshots cover; copy changed totals into the fleet.

        Only replicas whose snapshot or reservations moved since the last call can
        have a reservation that a snapshot newly covers (a reservation is never
        older than the snapshots already checked against it, unless it was made
        with an older time, which marks its replica too).
        """
        book, fleet = self.reservations, self.fleet
        book.expire_ttl(now_s)
        touched = fleet.drain_changed() | book.changed
        for replica_id in touched:
            slot = fleet.slot_of.get(replica_id)
            if slot is not None:
                stats = fleet.stats[slot]
                self.block_size_by_replica[replica_id] = stats.block_size
                book.expire_replica(replica_id, stats.timestamp_s, now_s)
                self.drain.observe(stats)
                fleet.set_drain_rate(replica_id, self.drain.rate(replica_id))
        if len(self.drain.last) > 2 * len(fleet) + 16:  # replicas left the fleet
            for replica_id in [r for r in self.drain.last if r not in fleet.slot_of]:
                self.drain.forget(replica_id)
        for replica_id in touched | book.drain_changed():
            fleet.set_reserved(
                replica_id,
                book.num_reserved_blocks(replica_id),
                book.num_reservations(replica_id),
            )

    def queue_wait_s(
        self,
        own_slot: int | None = None,
        own_blocks: int = 0,
        num_held_tokens: int = 0,
        now_s: float | None = None,
    ) -> np.ndarray:
        """Per fleet slot, the expected queueing wait of a request entering there now:
        the time its queue takes to drain (router.queue_wait.expected_wait_s: the
        replica's queued prompt tokens and this router's reservations there, blocks at
        its block size, less own_blocks at own_slot, the request's own reservation) or,
        where the replica forecasts its slots and given now_s, the time until the slot
        it needs frees and the prompts queued ahead of it are prefilled (slot_wait_s),
        whichever is longer."""
        fleet = self.fleet
        reserved = fleet.column("reserved")
        reserved_seqs = fleet.column("reserved_seqs")
        if own_slot is not None:  # its own seat too, even with every block cached
            reserved, reserved_seqs = reserved.copy(), reserved_seqs.copy()
            reserved[own_slot] -= own_blocks
            reserved_seqs[own_slot] -= 1
        queued = fleet.column("waiting_tokens") + reserved * fleet.column("block_size")
        wait_s = expected_wait_s(queued, fleet.column("drain_rate"), num_held_tokens)
        if now_s is None:
            return wait_s
        forecast_len = fleet.column("slot_forecast_len")
        if not forecast_len.any():  # no replica is full: the common case, one numpy call
            return wait_s
        slots = np.flatnonzero(forecast_len)
        slot_s = slot_wait_s(
            fleet.column("seqs")[slots] + reserved_seqs[slots] - fleet.column("max_seqs")[slots],
            fleet.column("slot_free_s")[slots],
            now_s - fleet.column("timestamp_s")[slots],
            queued[slots],
            fleet.column("prefill_rate")[slots],
        )
        wait_s[slots] = np.maximum(wait_s[slots], slot_s)
        return wait_s

    def refusals(
        self,
        slots: np.ndarray,
        request: RouteRequest,
        now_s: float,
        room: Room,
    ) -> str:
        """Why the first refused replicas refuse (router.load's wording), and how many more.

        Each names its snapshot's age and this router's reservations on it: a refusal
        read off a snapshot from before the replica drained, or one made of this
        router's own reservations, reads differently from a replica that is full now.
        room: the decision's, whose needed and shared blocks each test uses.
        """
        fleet, book = self.fleet, self.reservations
        named = []
        for slot in slots[:MAX_REFUSALS_NAMED].tolist():
            stats = fleet.stats[slot]
            why = refusal(
                book.charge(stats, request.request_id),
                request,
                self.config.high_watermark,
                self.config.queue_fraction,
                int(room.needed[slot]),
                0 if room.shared is None else int(room.shared[slot]),
            )
            age_ms = 1e3 * (now_s - stats.timestamp_s)
            num_reserved = int(fleet.column("reserved")[slot])
            named.append(
                f"{why or stats.replica_id + ': refused'} (snapshot {age_ms:.0f} ms old, "
                f"{num_reserved} blocks reserved here)"
            )
        if len(slots) > MAX_REFUSALS_NAMED:
            named.append(f"{len(slots) - MAX_REFUSALS_NAMED} more replicas refuse")
        return "; ".join(named)

    def matched_blocks(self, request: RouteRequest, slots: np.ndarray) -> np.ndarray | None:
        """Leading prompt blocks cached at each of these fleet slots; None when the fleet
        keeps no prefix index (the policy does not use one) or the prompt is unknown."""
        if self.fleet.prefix is None or not request.knows_prompt or not len(slots):
            return None
        return Candidates(self.fleet, slots, np.zeros(len(slots))).matched_blocks(request)

    def num_blocks_to_reserve(self, request: RouteRequest, replica_id: str) -> int:
        """Blocks the request will take there: its prompt, less the prefix cached there.

        Right after decide() for the same request object, with no snapshot written or
        replica forgotten since, the decision's match is reused instead of matched again.
        """
        slot = self.fleet.slot_of.get(replica_id)
        if slot is None:  # left the fleet, or never had readable stats
            block_size = self.block_size_by_replica.get(replica_id, DEFAULT_BLOCK_SIZE)
            return max(1, request.num_prompt_blocks(block_size))
        num_blocks = request.num_prompt_blocks(self.fleet.stats[slot].block_size)
        decided = self._decided_match
        if decided is not None and decided[0] is request and decided[1] == self.fleet.version:
            return max(1, num_blocks - int(decided[2][slot]))
        matched = self.matched_blocks(request, np.array([slot]))
        return max(1, num_blocks - (0 if matched is None else int(matched[0])))

    def reserve(self, request: RouteRequest, replica_id: str, now_s: float) -> None:
        """Record that the request was routed to replica_id (moves an earlier reservation)."""
        num_blocks = self.num_blocks_to_reserve(request, replica_id)
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
        num_blocks = self.num_blocks_to_reserve(request, replica_id)
        self.reservations.reserve(
            request.request_id, replica_id, num_blocks, reservation.reserved_at_s
        )

    def release(self, request_id: str) -> None:
        self.reservations.release(request_id)
