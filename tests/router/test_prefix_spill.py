"""The prefix policy's balance rule per replica: a hot prefix spills from its overloaded home
to one second replica, and the other prefixes keep their homes meanwhile; a home spills only
once it nears the watermark (balance_min_load), not on a load gap alone."""

from __future__ import annotations

import pytest

from replica.hashing import prefix_block_hashes
from router import PrefixPolicy, RouterConfig, RouteRequest
from router.factory import make_policy
from router.load import watermark_imbalanced
from tests.router.router_fakes import make_stats

NUM_REPLICAS = 6


def policy(balance_min_load: float = 0.8) -> PrefixPolicy:
    return PrefixPolicy(
        0.3, 1.5, seed=1, balance_band=0.1, affinity_tokens=64, balance_min_load=balance_min_load
    )


def prefix(p: int) -> list[int]:
    return [p, *range(1000, 1063)]  # 64 tokens: 4 blocks of 16


def first(
    stats: list, tokens: list[int], request_id: str, chooser: PrefixPolicy | None = None
) -> str:
    request = RouteRequest.from_tokens(request_id, tokens)
    return (chooser or policy()).choose_replicas(stats, request, 0.0)[0][0]


def fleet(used: dict[str, int], cached: dict[str, list[int]] | None = None) -> list:
    cached = cached or {}
    return [
        make_stats(
            f"r{i}",
            num_blocks_used=used.get(f"r{i}", 10),
            cached_prefix_hashes=tuple(
                h for p in cached.get(f"r{i}", []) for h in prefix_block_hashes(prefix(p), 16)
            ),
        )
        for i in range(NUM_REPLICAS)
    ]


def own(q: int) -> list[int]:
    """A request's own 80 tokens after its prefix: more than the prefix's 4 blocks."""
    return [5000 + q, *range(2000, 2079)]


def homes(stats: list) -> dict[int, str]:
    return {p: first(stats, prefix(p) + [7, p], f"home-{p}") for p in range(40)}


def test_affinity_holds_while_no_replica_is_overloaded():
    idle = homes(fleet({}))
    assert len(set(idle.values())) >= 4
    hot, home = 0, idle[0]
    # The home is busier than the rest, under the threshold: its prefix stays.
    busier = fleet({home: 30}, {home: [hot]})
    for q in range(20):
        assert first(busier, prefix(hot) + [q], f"q{q}") == home


def test_a_hot_prefix_spills_to_one_second_replica_and_the_others_keep_their_homes():
    idle = homes(fleet({}))
    hot, home = 0, idle[0]
    others = {p: r for p, r in idle.items() if r != home}
    assert len(set(others.values())) >= 3
    # The hot home at 0.8 against 0.1: overloaded (gap 0.7 > 0.3 and over 1.5x).
    stats = fleet({home: 80}, {home: [hot], **{r: [p] for p, r in others.items()}})
    spills = {first(stats, prefix(hot) + own(q), f"s{q}") for q in range(30)}
    assert len(spills) == 1 and home not in spills  # one second home, for every request
    # Every other prefix stays at its own home (the fleet-wide rule sent them by load).
    for p, r in others.items():
        assert first(stats, prefix(p) + [9], f"o{p}") == r
    # Once the spill replica has cached the prefix, its requests stay there.
    second = spills.pop()
    stats = fleet({home: 80, second: 20}, {home: [hot], second: [hot]})
    assert {first(stats, prefix(hot) + own(q), f"t{q}") for q in range(20)} == {second}


def test_an_overloaded_home_keeps_a_request_it_caches_most_of():
    # A later turn of a conversation: the home caches 4 of its 5 blocks, so moving it
    # would recompute more than it saves; a new conversation of the prefix moves.
    home = homes(fleet({}))[0]
    stats = fleet({home: 80}, {home: [0]})
    assert first(stats, prefix(0) + [7], "turn") == home
    assert first(stats, prefix(0) + own(1), "new") != home


def test_a_spilled_prefix_goes_home_once_the_home_is_not_overloaded():
    idle = homes(fleet({}))
    home = idle[0]
    elsewhere = next(r for r in (f"r{i}" for i in range(NUM_REPLICAS)) if r != home)
    stats = fleet({home: 35, elsewhere: 20}, {home: [0], elsewhere: [0]})
    # Both cache the prefix; neither is overloaded (0.35 against 0.1): the rendezvous home.
    assert first(stats, prefix(0) + [5], "back") == home


@pytest.mark.parametrize("used", [50, 60, 70])
def test_a_home_under_balance_min_load_keeps_new_requests_whatever_the_gap(used: int):
    # The home at 0.55-0.75 with its new request (5 blocks uncached), the others at 0.19
    # (with its 9): over the gap rule (0.3 and 1.5x), so the gap alone moved these
    # requests, each recomputing the prefix elsewhere; nothing waits at that load: they stay.
    home = homes(fleet({}))[0]
    stats = fleet({home: used}, {home: [0]})
    gap_only = policy(balance_min_load=0.0)
    assert all(first(stats, prefix(0) + own(q), f"g{q}", gap_only) != home for q in range(10))
    assert all(first(stats, prefix(0) + own(q), f"n{q}") == home for q in range(10))


def test_a_home_at_balance_min_load_spills_only_while_the_gap_holds():
    home = homes(fleet({}))[0]
    # 0.8 used + 5 uncached blocks: at the floor, and 0.75 over the others' 0.1.
    stats = fleet({home: 80}, {home: [0]})
    assert first(stats, prefix(0) + own(1), "over") != home
    # As loaded, but so are the others (0.6): no gap over 0.3, so no replica sits at the
    # watermark while another is under half full, and the prefix stays home.
    busy = fleet({home: 80, **{f"r{i}": 60 for i in range(NUM_REPLICAS) if f"r{i}" != home}},
                 {home: [0]})  # fmt: skip
    assert first(busy, prefix(0) + own(1), "even") == home


def test_router_config_sets_balance_min_load():
    config = RouterConfig(policy="prefix", balance_abs_threshold=0.3)
    assert make_policy(config).balance_min_load == config.balance_min_load == 0.8
    home = homes(fleet({}))[0]
    stats = fleet({home: 60}, {home: [0]})
    request = RouteRequest.from_tokens("cfg", prefix(0) + own(1))
    assert make_policy(config).choose_replicas(stats, request, 0.0)[0] == [home]
    with pytest.raises(ValueError, match="balance_min_load"):
        RouterConfig(balance_min_load=-0.1)


def test_watermark_imbalanced_is_per_replica_not_a_load_gap():
    # What bench.sim's watermark_imbalance_frac samples and cluster.routing_trace reports.
    def replica(name: str, used: int, waiting: int = 0):
        return make_stats(name, num_blocks_used=used, num_waiting_blocks=waiting)

    assert not watermark_imbalanced([replica("a", 70), replica("b", 10)], 0.95)  # a gap only
    assert watermark_imbalanced([replica("a", 90, waiting=5), replica("b", 49)], 0.95)
    assert not watermark_imbalanced([replica("a", 90, waiting=5), replica("b", 50)], 0.95)
    assert not watermark_imbalanced([replica("a", 99)], 0.95)  # one replica: nothing to balance
