"""Admission accounting: what a snapshot already counts is never charged again, and what
it shows queued is never admitted twice (fake stats, injected clock)."""

from __future__ import annotations

import pytest

from router import Admission, OverloadedError, RouterConfig, RouteRequest
from tests.router.router_fakes import NOW_S, make_stats

BLOCK_SIZE = 16


def prompt(request_id: str, num_blocks: int) -> RouteRequest:
    return RouteRequest(request_id, num_prompt_tokens=num_blocks * BLOCK_SIZE)


def reject_admission(**overrides: object) -> Admission:
    return Admission(RouterConfig(**({"on_overload": "reject", "high_watermark": 1.0} | overrides)))


def test_rerouting_a_request_does_not_charge_its_own_reservation() -> None:
    # Serve asks again for the same request when its first choice could not be probed;
    # the request's own blocks are reserved already and must not count against it.
    adm = reject_admission()
    stats = [make_stats("a", num_blocks_total=10)]
    request = prompt("r", 6)
    adm.reserve(request, adm.admit(stats, request, NOW_S).tiers[0][0], NOW_S)
    again = adm.admit(stats, request, NOW_S + 0.001)
    assert again.tiers == [["a"]]
    with pytest.raises(OverloadedError, match="4 blocks available < 6 needed"):
        adm.admit(stats, prompt("other", 6), NOW_S + 0.001)


def test_rerouted_request_still_counts_other_reservations() -> None:
    adm = reject_admission()
    stats = [make_stats("a", num_blocks_total=10)]
    first, second = prompt("first", 5), prompt("second", 5)
    adm.reserve(first, "a", NOW_S)
    adm.reserve(second, "a", NOW_S)
    with pytest.raises(OverloadedError, match="0 blocks available < 1 needed"):
        adm.admit(stats, prompt("third", 1), NOW_S)
    assert adm.admit(stats, second, NOW_S).tiers == [["a"]]  # room: 10 - first's 5


def test_flood_with_retried_choices_admits_the_room_there_is() -> None:
    # tests/cluster/test_routing.py's flood: 12 prompts of 13 blocks against 2 replicas
    # of 32 blocks. Serve asks again for every admitted request once (its queue-length
    # probe timed out), as its routing loop does on a loaded machine.
    adm = reject_admission(high_watermark=0.95)
    stats = [make_stats("a", num_blocks_total=32), make_stats("b", num_blocks_total=32)]
    requests = [RouteRequest(f"r{i}", num_prompt_tokens=200) for i in range(12)]
    placed: dict[str, str] = {}
    for attempt in range(2):
        for i, request in enumerate(requests):
            if attempt and request.request_id not in placed:
                continue
            now_s = NOW_S + attempt * 0.02 + i * 1e-3
            try:
                decision = adm.admit(stats, request, now_s)
            except OverloadedError:
                placed.pop(request.request_id, None)
                adm.release(request.request_id)
                continue
            adm.reserve(request, decision.tiers[0][0], now_s)
            placed[request.request_id] = decision.tiers[0][0]
    assert sorted(placed.values()) == ["a", "a", "b", "b"]
    assert adm.reservations.num_reserved_blocks("a") == 26


def test_reserved_requests_fill_sequence_slots() -> None:
    # A large cache and 8 slots: a runs 2 long sequences (more blocks), b runs 6 short
    # ones. By blocks b looks lighter for all 10 requests; by slots (the router's own
    # reservations counted as waiting sequences) a takes them until the slots even out.
    adm = reject_admission()
    stats = [
        make_stats("a", num_blocks_total=1000, num_blocks_used=50, num_running=2, max_num_seqs=8),
        make_stats("b", num_blocks_total=1000, num_blocks_used=10, num_running=6, max_num_seqs=8),
    ]
    placed = []
    for i in range(10):
        request = prompt(f"r{i}", 1)
        placed.append(adm.admit(stats, request, NOW_S).tiers[0][0])
        adm.reserve(request, placed[-1], NOW_S)
    assert placed[:4] == ["a"] * 4
    assert (placed.count("a"), placed.count("b")) == (7, 3)  # 2 + 7 == 6 + 3 sequences


def test_waiting_prompts_take_room() -> None:
    # 20 blocks free, but the replica's queue already holds 13 blocks of prompts.
    adm = reject_admission()
    stats = [make_stats("a", num_blocks_total=32, num_blocks_used=12, num_waiting_tokens=200)]
    with pytest.raises(OverloadedError, match="7 blocks available < 13 needed"):
        adm.admit(stats, prompt("r", 13), NOW_S)
    assert adm.admit(stats, prompt("small", 7), NOW_S).tiers == [["a"]]


def test_waiting_prompts_take_the_blocks_their_replica_says_they_need() -> None:
    # The same queue of 200 prompt tokens, whose leading blocks the replica has cached:
    # it charges the queue 2 blocks (ReplicaStats.num_waiting_blocks), not 13.
    adm = reject_admission()
    stats = [
        make_stats(
            "a", num_blocks_total=32, num_blocks_used=12, num_waiting_tokens=200,
            num_waiting_blocks=2,
        )
    ]  # fmt: skip
    assert adm.admit(stats, prompt("r", 13), NOW_S).tiers == [["a"]]
    with pytest.raises(OverloadedError, match="18 blocks available < 19 needed"):
        adm.admit(stats, prompt("big", 19), NOW_S)


def test_waiting_prompts_count_toward_the_watermark() -> None:
    adm = Admission(RouterConfig(on_overload="reject", high_watermark=0.5))
    queued = make_stats("queued", num_blocks_used=30, num_waiting_tokens=20 * BLOCK_SIZE)
    idle = make_stats("idle", num_blocks_used=45)
    assert adm.admit([queued, idle], RouteRequest("r"), NOW_S).tiers == [["idle"]]


class FakeReplica:
    """Enough of a replica for snapshots: requests arrive queued, run when scheduled."""

    def __init__(self, replica_id: str, num_blocks_total: int) -> None:
        self.replica_id = replica_id
        self.num_blocks_total = num_blocks_total
        self.num_running_blocks = 0
        self.waiting: list[int] = []  # blocks per queued prompt

    def arrive(self, num_blocks: int) -> None:
        self.waiting.append(num_blocks)

    def schedule(self) -> None:
        while self.waiting and self.waiting[0] <= self.num_blocks_total - self.num_running_blocks:
            self.num_running_blocks += self.waiting.pop(0)

    def snapshot(self, now_s: float) -> object:
        return make_stats(
            self.replica_id,
            num_blocks_total=self.num_blocks_total,
            num_blocks_used=self.num_running_blocks,
            num_waiting_tokens=sum(self.waiting) * BLOCK_SIZE,
            timestamp_s=now_s,
        )


@pytest.mark.parametrize("scheduled", [False, True])
def test_several_routers_overshoot_for_one_stats_period_only(scheduled: bool) -> None:
    # router/admission.py's documented limit: k routers can each fill a replica within
    # one stats period, but the next snapshot carries their requests (used or waiting),
    # and from then on none of them admits past the replica's room.
    num_routers, period_s = 3, 0.05
    replica = FakeReplica("a", num_blocks_total=60)
    routers = [reject_admission() for _ in range(num_routers)]
    snapshot = replica.snapshot(NOW_S)
    num_admitted = 0
    for k, adm in enumerate(routers):
        for n in range(7):  # one more than fits in this router's view
            now_s = NOW_S + 0.001 * (k * 7 + n + 1)
            request = prompt(f"r{k}-{n}", 10)
            try:
                adm.admit([snapshot], request, now_s)
            except OverloadedError:
                continue
            adm.reserve(request, "a", now_s)
            replica.arrive(10)
            num_admitted += 1
    assert num_admitted == num_routers * 6  # each saw 60 free blocks: bounded overshoot
    if scheduled:
        replica.schedule()
    later = replica.snapshot(NOW_S + period_s)
    for k, adm in enumerate(routers):
        with pytest.raises(OverloadedError):
            adm.admit([later], prompt(f"late-{k}", 1), NOW_S + period_s + 0.01)


def test_refusal_reasons_name_snapshot_age_and_reserved_blocks() -> None:
    # A refusal from an old snapshot, or one made of this router's own reservations,
    # must be told apart from a replica that is full now (the flood test's CI failure).
    adm = reject_admission()
    stats = [
        make_stats("old", num_blocks_total=32, num_blocks_used=20, timestamp_s=NOW_S - 0.3),
        make_stats("mine", num_blocks_total=32, num_blocks_used=8, timestamp_s=NOW_S),
    ]
    adm.reserve(prompt("earlier", 13), "mine", NOW_S)
    with pytest.raises(OverloadedError) as info:
        adm.admit(stats, prompt("r", 13), NOW_S + 0.01)
    reason = info.value.reason
    assert "old: 12 blocks available < 13 needed (snapshot 310 ms old, 0 blocks reserved" in reason
    assert "mine: 11 blocks available < 13 needed (snapshot 10 ms old, 13 blocks reserved" in reason


def test_refusal_reasons_are_capped() -> None:
    adm = reject_admission()
    stats = [make_stats(f"r{i}", num_blocks_used=100) for i in range(10)]
    with pytest.raises(OverloadedError, match="6 more replicas refuse") as info:
        adm.admit(stats, prompt("r", 1), NOW_S)
    assert info.value.reason.count("blocks available") == 4
