"""Replica load snapshots that ride on carrier messages, for the routers of this process.

Serve hands every router the replicas' record_routing_stats snapshots through its
controller: a poll every stats period, then a broadcast to every handle and proxy. Under
load those snapshots reached routers ~0.25 s old (median; 0.4 s p90, with a 50 ms
period), about half the life of a 128-token request, long enough for every router to
send a wave of requests to the one replica its snapshot shows idle (in the simulator,
16 routers on 250 ms-old snapshots lost 21% of one router's tokens/s and quadrupled TTFT
p99; docs/design.md, "Carrier-borne load snapshots"). A replica also puts its latest
load snapshot on every carrier message it sends (CarrierBatch.stats, without the prefix
hashes; refreshed on the engine thread at most every
cluster.engine_loop.LOAD_STATS_PERIOD_S and on every step that ends a request), so a
process that has requests on a replica holds a snapshot of it a few ms plus one message
old; KVFleetRequestRouter takes whichever of the two is newer.
Acks also say when the engine admitted each request (note_admitted), so a router
releases its reservation for the request at the first snapshot that counts it.

Process-wide on purpose: the transports that receive the messages and the routers that
read them are different objects (one per handle) in the same caller process. Written on
the transports' loop, read on the routers' (a dict lookup and a dict store, each atomic).
"""

from __future__ import annotations

import collections

from replica.stats import ReplicaStats

MAX_REPLICAS = 4096  # replicas remembered per process; the oldest seen go first
# Admissions remembered per process, the oldest first out: far more than the requests
# of one reservation TTL (2 s) at any rate one process sends.
MAX_ADMISSIONS = 1 << 16

_latest: dict[str, tuple[bytes, ReplicaStats]] = {}
# request id -> (replica id, when its engine admitted it, on the replica's clock)
_admitted: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()


def note(replica_id: str, data: bytes) -> None:
    """A replica's snapshot (ReplicaStats.to_msgpack) from one of its carrier messages.

    Decoded only when it differs from the last one (messages sent between two refreshes
    of the replica's snapshot carry the same bytes). An unreadable snapshot is ignored:
    Serve's own stats still reach the routers.
    """
    known = _latest.get(replica_id)
    if known is not None and known[0] == data:
        return
    try:
        stats = ReplicaStats.from_msgpack(data)
    except Exception:  # noqa: BLE001 - whatever a foreign payload raises, routing goes on
        return
    if known is not None and stats.timestamp_s <= known[1].timestamp_s:
        return  # an older carrier message overtaken by a newer one
    if known is None and len(_latest) >= MAX_REPLICAS:
        _latest.pop(next(iter(_latest)))
    _latest[replica_id] = (data, stats)


def latest(replica_id: str) -> ReplicaStats | None:
    """The newest snapshot of replica_id seen on this process's carriers, if any."""
    known = _latest.get(replica_id)
    return None if known is None else known[1]


def note_admitted(request_id: str, replica_id: str, admitted_s: float) -> None:
    """A replica's ack: its engine admitted request_id at admitted_s (SubmitAck)."""
    _admitted[request_id] = (replica_id, admitted_s)
    _admitted.move_to_end(request_id)
    while len(_admitted) > MAX_ADMISSIONS:
        _admitted.popitem(last=False)


def admitted_at(request_id: str, replica_id: str) -> float | None:
    """When replica_id's engine admitted request_id, if its ack reached this process
    (router.ReservationBook: the first snapshot stamped later counts the request)."""
    known = _admitted.get(request_id)
    return known[1] if known is not None and known[0] == replica_id else None


def forget_all() -> None:
    """Tests: start from nothing."""
    _latest.clear()
    _admitted.clear()
