from __future__ import annotations

from collections import Counter

import pytest

from router import Admission, OverloadedError, ReservationBook, RouterConfig, RouteRequest
from tests.router.router_fakes import NOW_S, make_stats


def admission(**overrides: object) -> Admission:
    return Admission(RouterConfig(**overrides))


def test_refuses_replica_without_room_for_the_prompt(now_s: float) -> None:
    stats = [
        make_stats("tight", num_blocks_used=50, num_blocks_total=52),  # 2 blocks left
        make_stats("roomy", num_blocks_used=60),
    ]
    request = RouteRequest("r", num_prompt_tokens=3 * 16)
    decision = admission(high_watermark=1.0).admit(stats, request, now_s)
    assert decision.tiers == [["roomy"]]


def test_cached_blocks_count_as_room(now_s: float) -> None:
    stats = [make_stats("a", num_blocks_total=10, num_blocks_used=5, num_blocks_cached=5)]
    decision = admission().admit(stats, RouteRequest("r", num_prompt_tokens=5 * 16), now_s)
    assert decision.tiers == [["a"]]


def test_refuses_replica_at_or_above_high_watermark(now_s: float) -> None:
    stats = [make_stats("hot", num_blocks_used=96), make_stats("warm", num_blocks_used=94)]
    decision = admission(high_watermark=0.95).admit(stats, RouteRequest("r"), now_s)
    assert decision.tiers == [["warm"]]


@pytest.mark.parametrize("band", [0.0, 0.1])
def test_burst_spreads_over_two_idle_replicas_between_snapshots(now_s: float, band: float) -> None:
    adm = admission(policy="kv", balance_band=band)
    stats = [make_stats("a"), make_stats("b")]
    placed = Counter()
    for n in range(10):
        request = RouteRequest(f"r{n}", num_prompt_tokens=64)  # 4 of 100 blocks each
        decision = adm.admit(stats, request, now_s + n * 1e-3)
        adm.reserve(request, decision.tiers[0][0], now_s + n * 1e-3)
        placed[decision.tiers[0][0]] += 1
    if band == 0:
        assert placed == {"a": 5, "b": 5}  # strict order alternates
    else:  # reservations keep the two within the band: 0.1 / 0.04 blocks per request
        assert abs(placed["a"] - placed["b"]) <= 3 and sum(placed.values()) == 10


def test_reservations_fill_a_replica_up_to_its_room(now_s: float) -> None:
    adm = admission(policy="kv", high_watermark=1.0, on_overload="reject")
    stats = [make_stats("only", num_blocks_total=10)]
    for n in range(5):
        request = RouteRequest(f"r{n}", num_prompt_tokens=32)  # 2 blocks each
        adm.reserve(request, adm.admit(stats, request, now_s).tiers[0][0], now_s)
    with pytest.raises(OverloadedError, match="0 blocks available < 2 needed"):
        adm.admit(stats, RouteRequest("r5", num_prompt_tokens=32), now_s)


def test_newer_snapshot_releases_reservations(now_s: float) -> None:
    adm = admission()
    stats = [make_stats("a", timestamp_s=now_s - 0.05)]
    request = RouteRequest("r", num_prompt_tokens=16 * 10)
    adm.reserve(request, "a", now_s)
    adm.admit(stats, RouteRequest("x"), now_s + 0.01)
    assert adm.reservations.num_reserved_blocks("a") == 10
    # Stamped after the reservation but within reservation_arrival_s: the request may
    # not have reached the engine yet, so the snapshot does not release it.
    arriving = [make_stats("a", timestamp_s=now_s + 0.02)]
    adm.admit(arriving, RouteRequest("y"), now_s + 0.03)
    assert adm.reservations.num_reserved_blocks("a") == 10
    newer = [make_stats("a", num_blocks_used=10, timestamp_s=now_s + 0.06)]
    adm.admit(newer, RouteRequest("z"), now_s + 0.07)
    assert adm.reservations.num_reserved_blocks("a") == 0


def test_a_known_admission_releases_at_the_first_snapshot_after_it(now_s: float) -> None:
    # The replica's ack said when its engine took each request: a snapshot stamped
    # after that counts the request, however soon after the decision.
    admitted = {("r1", "a"): now_s + 0.004}
    book = ReservationBook(ttl_s=2.0, arrival_s=0.05, admitted_at=lambda r, x: admitted.get((r, x)))
    book.reserve("r1", "a", 4, now_s)
    book.reserve("r2", "a", 2, now_s + 0.001)  # no ack yet
    book.expire([make_stats("a", timestamp_s=now_s + 0.003)], now_s + 0.01)
    assert book.num_reserved_blocks("a") == 6  # stamped before the engine took r1
    book.expire([make_stats("a", timestamp_s=now_s + 0.005)], now_s + 0.01)
    assert book.num_reserved_blocks("a") == 2  # r1 released, r2 waits for the margin
    book.expire([make_stats("a", timestamp_s=now_s + 0.052)], now_s + 0.06)
    assert book.num_reserved_blocks("a") == 0
    # An ack from another replica (the request moved) says nothing about this one.
    book.reserve("r3", "b", 4, now_s)
    admitted[("r3", "a")] = now_s + 0.001
    book.expire([make_stats("b", timestamp_s=now_s + 0.01)], now_s + 0.02)
    assert book.num_reserved_blocks("b") == 4
    book.check_invariants()


def test_reservations_expire_after_ttl(now_s: float) -> None:
    book = ReservationBook(ttl_s=0.5)
    book.reserve("r", "a", 4, now_s)
    book.expire([], now_s + 0.4)
    assert book.num_reserved_blocks("a") == 4
    book.expire([], now_s + 0.5)
    assert book.num_reserved_blocks("a") == 0


def test_reserving_the_same_request_again_moves_it(now_s: float) -> None:
    book = ReservationBook(ttl_s=1.0)
    book.reserve("r", "a", 4, now_s)
    book.reserve("r", "b", 4, now_s)
    assert (book.num_reserved_blocks("a"), book.num_reserved_blocks("b")) == (0, 4)


def test_charge_keeps_block_accounting(now_s: float) -> None:
    book = ReservationBook(ttl_s=1.0)
    book.reserve("r", "a", 7, now_s)
    charged = book.charge(
        make_stats("a", num_blocks_total=20, num_blocks_used=10, num_blocks_cached=5)
    )
    assert (charged.num_blocks_free, charged.num_blocks_cached) == (0, 3)
    assert charged.num_blocks_used == 17
    assert charged.kv_usage == pytest.approx(0.85)


def test_hold_returns_bounded_growing_backoff_then_raises(now_s: float) -> None:
    adm = admission(on_overload="hold", backoff_initial_s=0.1, backoff_max_s=0.4, max_hold_s=1.0)
    full = [make_stats("a", num_blocks_used=100)]
    request = RouteRequest("r")
    delays, t, attempt = [], now_s, 0
    while True:
        try:
            decision = adm.admit(full, request, t, attempt=attempt, held_since_s=now_s)
        except OverloadedError as error:
            assert error.retry_after_s > 0
            assert "held" in error.reason
            break
        assert not decision.admitted
        assert "high_watermark" in decision.reason
        delays.append(decision.retry_after_s)
        t += decision.retry_after_s
        attempt += 1
    assert delays[:3] == pytest.approx([0.1, 0.2, 0.4])
    assert max(delays) <= 0.4
    assert sum(delays) == pytest.approx(1.0)  # the last delay is cut to the hold budget


def test_reject_raises_overloaded_with_retry_after(now_s: float) -> None:
    adm = admission(on_overload="reject", backoff_max_s=0.75)
    with pytest.raises(OverloadedError) as info:
        adm.admit([make_stats("a", num_blocks_used=99)], RouteRequest("r"), now_s)
    assert info.value.retry_after_s == 0.75
    assert "a:" in info.value.reason


def test_prompt_larger_than_every_replica_raises_at_once(now_s: float) -> None:
    adm = admission(on_overload="hold")
    with pytest.raises(OverloadedError, match="prompt larger"):
        adm.admit(
            [make_stats("a", num_blocks_total=4)], RouteRequest("r", num_prompt_tokens=80), now_s
        )


def test_stale_stats_rank_after_fresh_ones(now_s: float) -> None:
    adm = admission(stats_max_age_s=1.0)
    stats = [
        make_stats("stale_idle", timestamp_s=now_s - 5.0),
        make_stats("fresh_busy", num_blocks_used=80),
    ]
    assert adm.admit(stats, RouteRequest("r"), now_s).tiers == [["fresh_busy"], ["stale_idle"]]


def test_stale_refusal_still_holds_and_unknown_is_last_resort(now_s: float) -> None:
    adm = admission(stats_max_age_s=1.0, on_overload="reject")
    stale_full = [make_stats("stale_full", num_blocks_used=100, timestamp_s=now_s - 5.0)]
    with pytest.raises(OverloadedError):
        adm.admit(stale_full, RouteRequest("r"), now_s)
    decision = adm.admit(stale_full, RouteRequest("r"), now_s, unknown_replica_ids=["new"])
    assert decision.tiers == [["new"]]


def test_unknown_replicas_are_ordered_by_reservations(now_s: float) -> None:
    adm = admission()
    adm.reserve(RouteRequest("old"), "u1", now_s)
    decision = adm.admit([], RouteRequest("r"), now_s, unknown_replica_ids=["u1", "u2"])
    assert decision.tiers == [["u2"], ["u1"]]


def test_no_replicas_holds(now_s: float) -> None:
    decision = admission(backoff_initial_s=0.05).admit([], RouteRequest("r"), NOW_S)
    assert not decision.admitted
    assert decision.retry_after_s == pytest.approx(0.05)


def test_a_cached_prefix_counts_toward_room_and_reservations(now_s: float) -> None:
    """Prefix policy: a replica that caches the prompt's first 3 of 4 blocks needs one more
    block for it (not 4): it is admitted with 2 blocks left, and reserves only 1."""
    from replica.hashing import prefix_block_hashes

    tokens = list(range(64))  # 4 blocks of 16
    hashes = tuple(prefix_block_hashes(tokens, 16))
    stats = [
        make_stats(
            "warm", num_blocks_total=52, num_blocks_used=50, cached_prefix_hashes=hashes[:3]
        ),
        make_stats("cold", num_blocks_total=52, num_blocks_used=50),
    ]
    request = RouteRequest.from_tokens("r", tokens)
    adm = admission(policy="prefix", high_watermark=1.0)
    decision = adm.admit(stats, request, now_s)
    assert decision.tiers == [["warm"]]  # cold has 2 blocks for a 4-block prompt
    adm.reserve(request, "warm", now_s)
    assert adm.reservations.num_blocks_by_replica["warm"] == 1
    # The kv policy keeps no prefix index: the whole prompt must fit.
    with pytest.raises(OverloadedError):
        admission(policy="kv", high_watermark=1.0, on_overload="reject").admit(
            stats, request, now_s
        )


def test_past_the_watermark_a_replica_takes_only_requests_it_holds_half_the_prompt_of(
    now_s: float,
) -> None:
    """A replica at 97% of its blocks (watermark 0.95) with 3 blocks free: a prompt of 8
    blocks whose first 6 it caches needs 2 there and is admitted; one whose first 3 it
    caches needs 5 (more than it shares, and more than the room) and is refused; so is an
    uncached 1-block prompt, by the watermark. The refusal names the watermark only for
    the last."""
    from replica.hashing import prefix_block_hashes

    tokens = list(range(128))  # 8 blocks of 16
    hashes = tuple(prefix_block_hashes(tokens, 16))
    other = list(range(500, 628))
    cached = hashes[:6] + tuple(prefix_block_hashes(other, 16))[:3]
    stats = [make_stats("hot", num_blocks_used=97, cached_prefix_hashes=cached)]
    adm = admission(policy="prefix", on_overload="reject")
    assert adm.admit(stats, RouteRequest.from_tokens("a", tokens), now_s).tiers == [["hot"]]
    with pytest.raises(OverloadedError, match="3 blocks available < 5 needed"):
        adm.admit(stats, RouteRequest.from_tokens("b", other), now_s)
    with pytest.raises(OverloadedError, match="high_watermark"):
        adm.admit(stats, RouteRequest.from_tokens("c", list(range(900, 916))), now_s)
    # A cached 2-block prompt: prefix admits it; kv keeps no prefix index, and it fits
    # the 3 free blocks, but the watermark refuses it.
    short = RouteRequest.from_tokens("d", tokens[:32])
    assert adm.admit(stats, short, now_s).tiers == [["hot"]]
    with pytest.raises(OverloadedError, match="high_watermark"):
        admission(policy="kv", on_overload="reject").admit(stats, short, now_s)


def test_a_reservation_reuses_its_decisions_match_only_while_the_fleet_is_unchanged(
    now_s: float,
) -> None:
    """The blocks reserved after a decision are the prompt less the prefix cached there
    now: the decision's match while no snapshot came in since, a fresh match after a new
    snapshot or a replica leaving (which moves slots)."""
    from replica.hashing import prefix_block_hashes

    tokens = list(range(64))  # 4 blocks of 16
    warm = make_stats("warm", cached_prefix_hashes=tuple(prefix_block_hashes(tokens, 16))[:3])
    stats = [make_stats("cold"), warm]

    def reserved_after(update) -> int:
        adm = admission(policy="prefix")
        request = RouteRequest.from_tokens("r", tokens)
        assert adm.admit(stats, request, now_s).tiers[0] == ["warm"]
        update(adm)
        adm.reserve(request, "warm", now_s)
        return adm.reservations.num_blocks_by_replica["warm"]

    assert reserved_after(lambda adm: None) == 1
    assert reserved_after(lambda adm: adm.observe(make_stats("warm"))) == 4  # evicted
    assert reserved_after(lambda adm: adm.forget("cold")) == 1  # warm moves to slot 0


def test_queue_fraction_lets_a_replica_queue_past_its_free_blocks(now_s: float) -> None:
    stats = [make_stats("tight", num_blocks_used=50, num_blocks_total=52)]  # 2 blocks left
    request = RouteRequest("r", num_prompt_tokens=3 * 16)
    strict = admission(high_watermark=1.0, on_overload="reject")
    with pytest.raises(OverloadedError, match="2 blocks available < 3 needed"):
        strict.admit(stats, request, now_s)
    # floor(52 * 1.1) - 50 = 7 blocks may be committed past the free ones.
    lax = admission(high_watermark=1.0, queue_fraction=0.1)
    assert lax.admit(stats, request, now_s).tiers == [["tight"]]
    too_big = RouteRequest("big", num_prompt_tokens=8 * 16)
    with pytest.raises(OverloadedError, match="7 blocks available < 8 needed"):
        admission(high_watermark=1.0, queue_fraction=0.1, on_overload="reject").admit(
            stats, too_big, now_s
        )


def test_queue_fraction_raises_the_watermark_by_as_much(now_s: float) -> None:
    stats = [make_stats("hot", num_blocks_used=96)]
    assert admission(high_watermark=0.95).admit(stats, RouteRequest("r"), now_s).tiers == []
    lax = admission(high_watermark=0.95, queue_fraction=0.05)
    assert lax.admit(stats, RouteRequest("r"), now_s).tiers == [["hot"]]
