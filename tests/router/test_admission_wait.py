"""Expected-wait admission: drain rates, the wait estimate, and the refusal it drives."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import numpy as np
import pytest

from replica.stats import ReplicaStats
from router import Admission, OverloadedError, RouterConfig, RouteRequest
from router.queue_wait import MIN_BACKLOG_S, DrainRates, expected_wait_s, slot_wait_s
from tests.router.router_fakes import make_stats
from tests.router.test_request_router import fake_replica, make_router, pending


def snap(
    replica_id: str, t_s: float, admitted: int, waiting_tokens: int, num_waiting: int | None = None
) -> ReplicaStats:
    """A 1,000-block replica at t_s that has admitted `admitted` prompt tokens so far and
    queues waiting_tokens (in num_waiting requests: one per 100 tokens by default)."""
    stats = make_stats(
        replica_id, num_blocks_total=1000, num_waiting_tokens=waiting_tokens, timestamp_s=t_s
    )
    if num_waiting is None:
        num_waiting = -(-waiting_tokens // 100)
    return dataclasses.replace(stats, prefix_query_tokens=admitted, num_waiting=num_waiting)


def feed(adm_or_rates, replica_id: str, tokens_per_s: float, waiting_tokens: int, end_s: float):
    """Snapshots every 50 ms over the second before end_s of a replica that drains its
    (never empty) queue at tokens_per_s."""
    for i in range(21):
        t_s = end_s - 1.0 + 0.05 * i
        adm_or_rates.observe(snap(replica_id, t_s, int(tokens_per_s * 0.05 * i), waiting_tokens))


def test_drain_rate_counts_only_backlogged_time() -> None:
    rates = DrainRates()
    # Idle, then arrivals admitted at once (no queue): arrivals are not capacity.
    rates.observe(snap("a", 10.0, 0, 0))
    rates.observe(snap("a", 10.5, 400, 0))
    assert rates.rate("a") is None
    # Queued from 10.5: 1,000 tokens admitted in the next 0.3 s, then 300 in 0.4 s.
    rates.observe(snap("a", 10.6, 400, 800))  # previous snapshot had no queue: not counted
    assert rates.rate("a") is None
    rates.observe(snap("a", 10.9, 1400, 500))
    assert rates.rate("a") is None  # 0.3 s backlogged < MIN_BACKLOG_S
    rates.observe(snap("a", 11.3, 1700, 0))
    assert rates.rate("a") == pytest.approx(1300 / 0.7)
    # The queue emptied: later intervals add nothing, and old ones leave the window.
    rates.observe(snap("a", 12.5, 1700, 0))
    assert rates.rate("a") == pytest.approx(1300 / 0.7)
    rates.observe(snap("a", 13.5, 1700, 0))
    assert rates.rate("a") is None


def test_drain_rate_of_a_stuck_queue_is_zero_and_a_restart_starts_over() -> None:
    rates = DrainRates()
    for i in range(12):  # 0.55 s queued, nothing admitted
        rates.observe(snap("a", 20.0 + 0.05 * i, 5000, 200))
    assert 0.55 >= MIN_BACKLOG_S
    assert rates.rate("a") == 0.0
    rates.observe(snap("a", 20.7, 10, 200))  # the counter went back: a new engine
    assert rates.rate("a") is None


def test_expected_wait_in_numbers() -> None:
    queued = np.array([2000, 500, 0, 100])
    rates = np.array([1000.0, np.nan, 500.0, 0.0])
    # held: 300 tokens over the known rates' sum (1,500 tokens/s) = 0.2 s for everyone.
    wait_s = expected_wait_s(queued, rates, num_held_tokens=300)
    assert wait_s[:3] == pytest.approx([2.2, 0.2, 0.2])
    assert math.isinf(wait_s[3])  # a queue nothing drains
    assert expected_wait_s(queued[:3], rates[:3]) == pytest.approx([2.0, 0.0, 0.0])
    no_rates = expected_wait_s(np.array([500]), np.array([np.nan]), num_held_tokens=300)
    assert no_rates == pytest.approx([0.0])


def test_a_replica_past_the_wait_bound_is_left_out(now_s: float) -> None:
    adm = Admission(RouterConfig(max_queue_wait_s=2.0))
    feed(adm, "slow", 1000.0, 3000, now_s)  # 3 s of queue
    feed(adm, "quick", 1000.0, 1000, now_s)  # 1 s
    stats = [adm.fleet.stats[adm.fleet.slot_of[r]] for r in ("slow", "quick")]
    decision = adm.admit(stats, RouteRequest("q", num_prompt_tokens=50), now_s)
    assert decision.tiers == [["quick"]]
    assert adm.queue_wait_s() == pytest.approx([3.0, 1.0])


@pytest.mark.parametrize("on_overload", ["hold", "reject"])
def test_every_replica_past_the_bound_rejects_at_once(now_s: float, on_overload: str) -> None:
    adm = Admission(RouterConfig(max_queue_wait_s=2.0, on_overload=on_overload))
    feed(adm, "a", 1000.0, 3000, now_s)
    feed(adm, "b", 500.0, 2000, now_s)  # 4 s
    request = RouteRequest("q", num_prompt_tokens=50)
    with pytest.raises(OverloadedError) as info:
        adm.decide(request, now_s)
    # Retry after the least backlogged replica's drain time, not the backoff.
    assert info.value.retry_after_s == pytest.approx(3.0)
    assert "max_queue_wait_s" in info.value.reason
    # This router's reservations are queued work too: 1,000 more tokens on "a" ...
    adm2 = Admission(RouterConfig(max_queue_wait_s=2.0))
    feed(adm2, "a", 1000.0, 1500, now_s)
    assert adm2.decide(request, now_s).tiers == [["a"]]
    adm2.reserve(RouteRequest("r", num_prompt_tokens=1000), "a", now_s)
    with pytest.raises(OverloadedError) as info:
        adm2.decide(request, now_s)
    assert info.value.retry_after_s == pytest.approx(2.508)  # 63 whole 16-token blocks
    # ... and so are the requests this router holds (their prompt tokens).
    adm3 = Admission(RouterConfig(max_queue_wait_s=2.0))
    feed(adm3, "a", 1000.0, 1500, now_s)
    assert adm3.decide(request, now_s, num_held_tokens=400).tiers == [["a"]]
    with pytest.raises(OverloadedError):
        adm3.decide(request, now_s, num_held_tokens=600)


def test_slot_wait_in_numbers() -> None:
    # Seconds after each snapshot at which its slots free, the last repeated.
    slot_free_s = np.array([[0.5, 0.5, 0.8, 0.8], [0.1, 0.2, 0.2, 0.2], [0.4] * 4])
    ahead = np.array([2, 0, -1])  # replica 2 has a free slot
    age_s = np.array([0.1, 0.15, 0.0])
    queued = np.array([0, 0, 500])
    no_rates = np.zeros(3)
    wait_s = slot_wait_s(ahead, slot_free_s, age_s, queued, no_rates)
    assert wait_s == pytest.approx([0.7, 0.0, 0.0])  # the 2nd replica's slot is overdue
    past_the_end = slot_wait_s(
        np.array([9]), slot_free_s[:1], np.zeros(1), queued[:1], no_rates[:1]
    )
    assert past_the_end == pytest.approx([0.8])
    # 1,000 prompt tokens ahead at 2,000 a second add 0.5 s where a slot is needed.
    rates = np.array([2000.0, 0.0, 2000.0])
    wait_s = slot_wait_s(ahead, slot_free_s, age_s, np.array([1000, 1000, 1000]), rates)
    assert wait_s == pytest.approx([1.2, 0.0, 0.0])


def full(replica_id: str, t_s: float, ends: tuple[int, ...], **fields) -> ReplicaStats:
    """A replica whose len(ends) slots all run, ending in `ends` steps of 10 ms."""
    stats = make_stats(
        replica_id, num_blocks_total=1000, num_running=len(ends), max_num_seqs=len(ends),
        timestamp_s=t_s,
    )  # fmt: skip
    return dataclasses.replace(stats, slot_free_steps=ends, step_s=0.01, **fields)


def test_a_full_replica_admits_only_requests_its_next_slots_will_take(now_s: float) -> None:
    adm = Admission(RouterConfig(max_queue_wait_s=0.3))
    request = RouteRequest("q", num_prompt_tokens=50)
    # Its four sequences end together in 0.5 s; the queue's mean rate knows nothing yet.
    adm.observe(full("a", now_s, (50, 50, 50, 50)))
    with pytest.raises(OverloadedError) as info:
        adm.decide(request, now_s)
    assert info.value.retry_after_s == pytest.approx(0.5)  # when the slot frees
    assert "max_queue_wait_s" in info.value.reason
    # 0.25 s later, by the same snapshot: the slots free in 0.25 s, within the bound.
    later_s = now_s + 0.25
    assert adm.decide(request, later_s).tiers == [["a"]]
    # Two ends are near, two far: this router's two requests take the near ones, so a
    # third waits for a far one.
    adm = Admission(RouterConfig(max_queue_wait_s=0.3))
    adm.observe(full("a", now_s, (10, 20, 90, 90)))
    for rid in ("r1", "r2"):
        assert adm.decide(RouteRequest(rid, num_prompt_tokens=50), now_s).tiers == [["a"]]
        adm.reserve(RouteRequest(rid, num_prompt_tokens=50), "a", now_s)
    with pytest.raises(OverloadedError) as info:
        adm.decide(request, now_s)
    assert info.value.retry_after_s == pytest.approx(0.9)


def test_prompts_ahead_of_a_freed_slot_add_their_prefill(now_s: float) -> None:
    """At 1,000 prompt tokens a second, 200 queued tokens ahead add 0.2 s to the slot's
    0.2 s; without a forecast the prefill rate is not used."""
    adm = Admission(RouterConfig(max_queue_wait_s=0.3))
    adm.observe(full("a", now_s, (20, 20), prefill_tokens_per_s=1000.0))
    request = RouteRequest("q", num_prompt_tokens=50)
    assert adm.queue_wait_s(now_s=now_s) == pytest.approx([0.2])
    assert adm.decide(request, now_s).tiers == [["a"]]
    queued = full("a", now_s, (20, 20), prefill_tokens_per_s=1000.0, num_waiting_tokens=200)
    adm.observe(dataclasses.replace(queued, num_running=1, num_waiting=1))
    assert adm.queue_wait_s(now_s=now_s) == pytest.approx([0.4])
    with pytest.raises(OverloadedError):
        adm.decide(request, now_s)
    adm.observe(dataclasses.replace(queued, slot_free_steps=(), timestamp_s=now_s + 0.01))
    assert adm.queue_wait_s(now_s=now_s) == pytest.approx([0.0])  # mean rate unknown yet


def test_no_bound_and_unknown_rates_admit(now_s: float) -> None:
    adm = Admission(RouterConfig(max_queue_wait_s=None))
    feed(adm, "a", 10.0, 3000, now_s)  # 300 s of queue, but no bound
    assert adm.decide(RouteRequest("q", num_prompt_tokens=50), now_s).tiers == [["a"]]
    fresh = Admission(RouterConfig(max_queue_wait_s=0.5))
    fresh.observe(snap("a", now_s, 0, 3000))  # one snapshot: rate unknown
    assert fresh.decide(RouteRequest("q", num_prompt_tokens=50), now_s).tiers == [["a"]]


def test_max_queue_wait_s_is_validated() -> None:
    for bad in (0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match="max_queue_wait_s"):
            RouterConfig(max_queue_wait_s=bad)
    assert RouterConfig(max_queue_wait_s=None).max_queue_wait_s is None


def test_held_requests_are_work_ahead_until_they_leave() -> None:
    """The Serve adapter counts held prompts as queued work, and forgets a held request
    whose caller went away (its future done) without it reaching a replica."""

    async def never_sleep(delay_s: float) -> None:
        return None

    async def scenario() -> None:
        router = make_router(RouterConfig())
        router.sleep = never_sleep
        replicas = [fake_replica("a", num_blocks_used=100)]  # full: requests are held
        first = pending("h1", {"prompt_token_ids": list(range(40))})
        second = pending("h2", {"prompt_token_ids": list(range(24))})
        assert await router.choose_replicas(replicas, first) == []
        assert await router.choose_replicas(replicas, second) == []
        assert router.num_held_tokens == 64
        first.future.cancel()  # its caller disconnected while it was held
        assert await router.choose_replicas(replicas, first) == [replicas]
        assert router.num_held_tokens == 24 and "h1" not in router.holds

    asyncio.run(scenario())
