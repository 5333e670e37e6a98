"""Room: what one request would find on every replica of a Fleet, reservations charged.

The column form of router.load's per-snapshot measures and of
ReservationBook.charge(): the same integers, so the same floats, for all
replicas at once (tests/router check them against the scalar functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from router.fleet import Fleet
from router.request import RouteRequest


@dataclass(frozen=True)
class Room:
    """Per fleet slot: [num_replicas] arrays."""

    needed: np.ndarray  # int64: prompt blocks at the replica's block size, less cached ones
    available: np.ndarray  # int64: free + cached + allowance - waiting, charged, at least 0
    committed: np.ndarray  # float64: (used + waiting) / total, after charging
    load: np.ndarray  # float64: max(KV, slot) fraction with the request (load_fraction)
    queue_fraction: float = 0.0  # RouterConfig.queue_fraction: in available, and below
    shared: np.ndarray | None = None  # int64: prompt blocks cached there (None: unknown)

    def refused(self, high_watermark: float) -> np.ndarray:
        """bool: the replica has no room for the prompt, or is at the high watermark
        (raised by queue_fraction, as the room is) and holds less than half the prompt.

        Why the exception: the watermark keeps new sequences off a replica whose blocks
        are nearly all committed, so that a request waits at the router for whichever
        replica frees room first rather than in one replica's queue. A request whose
        prefix that replica has cached is better off waiting there, for the few blocks
        it needs: anywhere else it recomputes the prefix and evicts other prefixes for
        it. Refusing it there spread each shared prefix over every replica once the
        fleet ran near its watermark, and kept it spread: on 4 H200s (32 shared
        4K-token prefixes, 240 req/s offered) the prefix policy's goodput went from
        161-183 to 229 req/s with this exception, and the decisions that held the
        request at the router from 24% to 9% (docs/design.md, "Room and watermark").
        """
        watermark = high_watermark + self.queue_fraction
        over = self.committed >= watermark
        if self.shared is not None:
            over &= self.shared < self.needed
        return (self.available < self.needed) | over


def room_for(
    fleet: Fleet,
    request: RouteRequest,
    own_slot: int | None = None,
    own_blocks: int = 0,
    matched: np.ndarray | None = None,
    queue_fraction: float = 0.0,
) -> Room:
    """Room with fleet's reserved columns charged, less own_blocks (and its one request) at
    own_slot (the request's own reservation, which is not in its own way); queue_fraction:
    RouterConfig's.

    matched (int64 per fleet slot, optional): leading prompt blocks each replica has
    cached (Candidates.matched_blocks); the request needs only the rest there, and at
    least one block (its last token is always computed). Without it, the whole prompt.
    """
    total, free, cached = fleet.column("total"), fleet.column("free"), fleet.column("cached")
    reserved, reserved_seqs = fleet.column("reserved"), fleet.column("reserved_seqs")
    if own_slot is not None and own_blocks:
        reserved, reserved_seqs = reserved.copy(), reserved_seqs.copy()
        reserved[own_slot] -= own_blocks
        reserved_seqs[own_slot] -= 1
    # As ReservationBook.charge: reserved blocks come out of free, then cached ones.
    from_free = np.minimum(reserved, free)
    from_cached = np.minimum(reserved - from_free, cached)
    used = total - (free - from_free) - (cached - from_cached)
    queued = used + fleet.column("waiting")
    needed = request.num_prompt_blocks(fleet.column("block_size"))
    if matched is not None:
        needed = np.maximum(needed - matched, 1)
    allowance = (total * queue_fraction).astype(np.int64)  # as int(): floor, >= 0
    # As router.load.seq_fraction of the charged snapshot (reserved requests wait there).
    max_seqs = fleet.column("max_seqs")
    seqs = fleet.column("seqs") + reserved_seqs + 1
    slots = np.divide(seqs, max_seqs, out=np.zeros(len(seqs)), where=max_seqs > 0)
    return Room(
        needed=needed,
        available=np.maximum(total + allowance - queued, 0),
        committed=queued / total,
        load=np.maximum((queued + needed) / total, slots),
        queue_fraction=queue_fraction,
        shared=matched,
    )
