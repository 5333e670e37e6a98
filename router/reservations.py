"""ReservationBook: blocks this router has routed that replicas' snapshots do not show yet."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from replica.stats import ReplicaStats


@dataclass(frozen=True)
class Reservation:
    replica_id: str
    num_blocks: int
    reserved_at_s: float


class ReservationBook:
    """Blocks this router has sent to replicas that their last snapshot does not show yet.

    Algorithm: reserve() on each routing decision (keyed by request id, so
    re-routing the same request moves its reservation); a reservation is
    released by the first snapshot of its replica that counts the request itself,
    or after ttl_s, whichever comes first. When the replica's engine reported
    when it admitted the request (admitted_at: the replica's clock, from its
    ack), that is the first snapshot stamped after then; otherwise the first
    stamped more than arrival_s after the reservation (arrival_s covers the
    request's way to the engine). charge() shows a snapshot with the reserved blocks
    taken from free (then cached) blocks and counted as used, and the reserved
    requests as waiting sequences (their prompt blocks are the used ones),
    leaving out the reservation of the request being admitted (Serve re-asks
    for a request whose first choice it could not probe; that request's blocks
    are not in its own way).
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

    def __init__(
        self,
        ttl_s: float,
        arrival_s: float = 0.0,
        admitted_at: Callable[[str, str], float | None] | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.arrival_s = arrival_s  # RouterConfig.reservation_arrival_s
        # (request id, replica id) -> when that replica's engine admitted the request,
        # on the replica's clock, or None while unknown (cluster.live_stats).
        self.admitted_at = admitted_at or (lambda request_id, replica_id: None)
        self.by_request: dict[str, Reservation] = {}
        self.num_blocks_by_replica: dict[str, int] = {}
        self.num_reservations_by_replica: dict[str, int] = {}
        # Entries (reserved_at_s, sequence number, request id, reservation).
        self.heap_by_replica: dict[str, list[tuple[float, int, str, Reservation]]] = {}
        self.ttl_heap: list[tuple[float, int, str, Reservation]] = []
        self.num_pushed = 0
        # Replicas whose reserved total moved since drain_changed(): an incremental
        # caller (router.Admission's fleet columns) updates only those.
        self.changed: set[str] = set()

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
        self.changed.add(replica_id)
        entry = (now_s, self.num_pushed, request_id, reservation)
        self.num_pushed += 1
        heapq.heappush(self.heap_by_replica.setdefault(replica_id, []), entry)
        heapq.heappush(self.ttl_heap, entry)

    def release(self, request_id: str) -> None:
        reservation = self.by_request.pop(request_id, None)
        if reservation is None:
            return
        replica_id = reservation.replica_id
        self.changed.add(replica_id)
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
        """Drop replica_id's reservations covered by its snapshot at snapshot_s, or past the TTL.

        Oldest first, stopping at the first one not covered: a younger reservation
        the engine has admitted already waits behind an older one still on its way
        (counted a little longer, never released early)."""
        heap = self.heap_by_replica.get(replica_id)
        ttl_s, arrival_s = self.ttl_s, self.arrival_s
        while heap:
            entry = heap[0]
            reserved_at_s = entry[0]
            if self.is_live(entry):
                if now_s - reserved_at_s < ttl_s:
                    admitted_s = self.admitted_at(entry[2], replica_id)
                    if admitted_s is None:
                        admitted_s = reserved_at_s + arrival_s
                    if snapshot_s <= admitted_s:
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

    def drain_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed

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
        num_requests = self.num_reservations(stats.replica_id)
        own = self.by_request.get(exclude_request_id) if exclude_request_id is not None else None
        if own is not None and own.replica_id == stats.replica_id:
            num_reserved -= own.num_blocks
            num_requests -= 1
        if num_reserved == 0 and num_requests == 0:
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
            num_waiting=stats.num_waiting + num_requests,
        )
