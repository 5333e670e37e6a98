"""Admission over the Fleet's columns decides as the per-replica loop it replaced.

reference_tiers is Admission.admit of commit 16f599a written over scalar
functions (ReservationBook.charge, refusal, a freshness test per snapshot, a
ReservationBook.expire over every snapshot), with only the policy call shared.
Random fleets evolve over time (new snapshots, stale ones, replicas leaving),
reservations are made, moved and released, and both must agree on every
decision, through admit(stats) and through the incremental observe()/decide().
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from replica.stats import ReplicaStats
from router import Admission, OverloadedError, ReservationBook, RouterConfig, RouteRequest
from router.admission import refusal
from router.fleet import Fleet
from router.load import committed_fraction, load_fraction, num_available_blocks
from router.room import room_for
from router.tiebreak import request_key, tiebreak, tiebreak_keys
from tests.router.router_fakes import make_stats


def reference_tiers(
    adm: Admission,
    book: ReservationBook,
    stats: Sequence[ReplicaStats],
    request: RouteRequest,
    now_s: float,
    unknown: Sequence[str],
) -> list[list[str]] | None:
    """The tiers, or None where admission holds or raises."""
    config = adm.config
    stats = [s for s in stats if s.num_blocks_total > 0 and s.block_size > 0]
    book.expire(stats, now_s)
    admissible, last_resort = [], list(unknown)
    for s in stats:
        charged = book.charge(s, request.request_id)
        if refusal(charged, request, config.high_watermark) is not None:
            continue
        if now_s - s.timestamp_s <= config.stats_max_age_s:
            admissible.append(charged)
        else:
            last_resort.append(s.replica_id)
    tiers = adm.policy.choose_replicas(admissible, request, now_s) if admissible else []
    last_resort.sort(
        key=lambda r: (book.num_reservations(r), tiebreak(config.seed, request.request_id, r))
    )
    tiers += [[r] for r in last_resort]
    return tiers or None


def snapshot(rng: random.Random, replica_id: str, now_s: float) -> ReplicaStats:
    total = rng.choice([0, 32, 100, 100, 100, 256]) if rng.random() < 0.05 else 100
    block_size = rng.choice([8, 16, 16, 16])
    used = rng.randrange(0, total + 1) if total else 0
    cached = rng.randrange(0, total - used + 1) if total else 0
    return make_stats(
        replica_id,
        num_blocks_total=total,
        num_blocks_used=used,
        num_blocks_cached=cached,
        num_waiting_tokens=rng.choice([0, 0, rng.randrange(0, 40 * block_size)]),
        num_waiting_blocks=rng.choice([None, None, rng.randrange(0, 40)]),
        block_size=block_size,
        cached_prefix_hashes=tuple(rng.sample(range(40), rng.randrange(0, 10))),
        timestamp_s=now_s - rng.choice([0.0, 0.01, 0.05, 0.3, 3.0]),
    )


def decide_or_none(decide, *args, **kwargs) -> list[list[str]] | None:
    try:
        decision = decide(*args, **kwargs)
    except OverloadedError:
        return None
    return decision.tiers or None


@pytest.mark.parametrize("policy", ["kv", "prefix"])
@pytest.mark.parametrize("seed", range(40))
def test_fleet_admission_matches_the_per_replica_loop(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    config = RouterConfig(
        policy=policy,
        on_overload=rng.choice(["hold", "reject"]),
        high_watermark=rng.choice([0.5, 0.9, 1.0]),
        stats_max_age_s=1.0,
        reservation_ttl_s=0.5,
        seed=seed,
        max_queue_wait_s=None,  # the reference predates the wait bound
    )
    synced, incremental = Admission(config), Admission(config)
    reference_book = ReservationBook(config.reservation_ttl_s, config.reservation_arrival_s)
    names = [f"r{i}" for i in range(rng.randrange(1, 12))]
    now_s = 100.0
    current = {r: snapshot(rng, r, now_s) for r in names}
    for r in current.values():
        incremental.observe(r)
    for step in range(120):
        now_s += rng.random() * 0.05
        event = rng.random()
        if event < 0.25:  # a replica publishes
            replica_id = rng.choice(names)
            current[replica_id] = snapshot(rng, replica_id, now_s)
            incremental.observe(current[replica_id])
        elif event < 0.3 and len(current) > 1:  # a replica leaves
            gone = rng.choice(sorted(current))
            del current[gone]
            incremental.forget(gone)
        elif event < 0.35:
            request_id = f"q{rng.randrange(step + 1)}"
            for book in (synced.reservations, incremental.reservations, reference_book):
                book.release(request_id)
        stats = list(current.values())
        unknown = [r for r in names if r not in current][:2]
        num_tokens = rng.randrange(0, 30 * 16)
        request = RouteRequest.from_tokens(
            f"q{rng.randrange(step + 1)}", [rng.randrange(40) for _ in range(num_tokens)]
        )
        expected = reference_tiers(synced, reference_book, stats, request, now_s, unknown)
        got = decide_or_none(
            synced.admit, stats, request, now_s, unknown_replica_ids=unknown, held_since_s=now_s
        )
        got_incremental = decide_or_none(
            incremental.decide, request, now_s, unknown_replica_ids=unknown, held_since_s=now_s
        )
        assert got == expected, step
        assert got_incremental == expected, step
        if expected is not None and rng.random() < 0.7:
            chosen = expected[0][0]
            for adm in (synced, incremental):
                adm.reserve(request, chosen, now_s)
            reference_book.reserve(
                request.request_id, chosen, synced.num_blocks_to_reserve(request, chosen), now_s
            )
        for adm in (synced, incremental):
            adm.reservations.check_invariants()


@pytest.mark.parametrize("seed", range(20))
def test_room_columns_equal_the_scalar_measures(seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet()
    book = ReservationBook(ttl_s=10.0)
    stats = [snapshot(rng, f"r{i}", 50.0) for i in range(rng.randrange(1, 30))]
    for s in stats:
        fleet.observe(s)
    for n in range(rng.randrange(0, 40)):
        replica_id = rng.choice(stats).replica_id
        book.reserve(f"q{n}", replica_id, rng.randrange(1, 60), 50.0)
    for replica_id in fleet.ids:
        fleet.set_reserved(
            replica_id, book.num_reserved_blocks(replica_id), book.num_reservations(replica_id)
        )
    request = RouteRequest("q3", num_prompt_tokens=rng.randrange(0, 900))
    own = book.by_request.get("q3")
    own_slot = fleet.slot_of.get(own.replica_id) if own else None
    room = room_for(fleet, request, own_slot, own.num_blocks if own else 0)
    lax = room_for(fleet, request, own_slot, own.num_blocks if own else 0, queue_fraction=0.25)
    for slot, replica_id in enumerate(fleet.ids):
        charged = book.charge(fleet.stats[slot], "q3")
        assert room.available[slot] == num_available_blocks(charged)
        assert room.committed[slot] == committed_fraction(charged)
        assert room.load[slot] == load_fraction(charged, request)
        refused = room.refused(0.9)[slot]
        assert refused == (refusal(charged, request, 0.9) is not None), replica_id
        refused = lax.refused(0.9)[slot]
        assert lax.available[slot] == num_available_blocks(charged, 0.25)
        assert refused == (refusal(charged, request, 0.9, 0.25) is not None), replica_id


def test_tiebreak_columns_equal_the_scalar_tiebreak() -> None:
    fleet = Fleet()
    for i in range(50):
        fleet.observe(make_stats(f"replica-{i}"))
    for request_id in ("a", "b", "q17"):
        for seed in (0, 5):
            keys = tiebreak_keys(fleet.column("replica_key"), request_key(seed, request_id))
            assert keys.dtype == np.uint64
            assert keys.tolist() == [tiebreak(seed, request_id, r) for r in fleet.ids]
