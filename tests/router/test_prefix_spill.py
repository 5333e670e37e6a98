"""The prefix policy's balance rule per replica: a hot prefix spills from its overloaded home
to one second replica, and the other prefixes keep their homes meanwhile; the gap a request
must see to leave its home grows with the share of its prompt the home caches."""

from __future__ import annotations

import numpy as np

from replica.hashing import prefix_block_hashes
from router import PrefixPolicy, RouteRequest
from router.load import watermark_imbalanced
from router.prefix import overloaded
from tests.router.router_fakes import make_stats

NUM_REPLICAS = 6


def policy() -> PrefixPolicy:
    return PrefixPolicy(0.3, 1.5, seed=1, balance_band=0.1, affinity_tokens=64)


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
    """A request's own 300 tokens after its prefix: its home caches 4 of its 23 blocks, a
    0.35 share of half the prompt, so it moves at a gap over 0.3 + 0.35 * 0.7 = 0.54."""
    return [5000 + q, *range(2000, 2299)]


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


def test_the_gap_to_leave_home_grows_with_the_share_the_home_caches():
    # 0.9 against 0.1: a gap of 0.8. balance_abs_threshold 0.5 with nothing cached, up to
    # 1.0 (a whole replica) at half the prompt cached; the relative rule is unchanged.
    loads = np.array([0.9, 0.1])
    for share, expected in ((0.0, True), (0.5, True), (0.7, False), (1.0, False)):
        assert bool(overloaded(loads, 0.5, 1.5, np.array([share, 0.0]))[0]) is expected, share
    assert not overloaded(loads, 0.5, 10.0)[0]  # 0.9 is under 10 x 0.1
    # A threshold already over a whole replica does not shrink as the share grows.
    assert not overloaded(np.array([2.4, 0.1]), 2.5, 1.5, np.array([1.0, 0.0]))[0]


def test_a_busy_home_keeps_a_request_it_caches_part_of_until_the_gap_outweighs_it():
    home = homes(fleet({}))[0]
    # The home at 0.6 used (0.79 with the request's 19 uncached blocks), the others at 0.33
    # with its 23: a gap of 0.46, over balance_abs_threshold's 0.3, which moved these
    # requests and recomputed their prefix elsewhere; under the 0.54 their 4 cached blocks
    # ask, so they stay.
    stats = fleet({home: 60}, {home: [0]})
    assert all(first(stats, prefix(0) + own(q), f"k{q}") == home for q in range(10))
    # The same load with nothing cached there: the plain threshold, and the requests move.
    assert all(first(fleet({home: 60}), prefix(0) + own(q), f"m{q}") != home for q in range(10))
    # A wider gap (0.99 against 0.33) outweighs the cached share: they move.
    stats = fleet({home: 80}, {home: [0]})
    assert all(first(stats, prefix(0) + own(q), f"w{q}") != home for q in range(10))


def test_watermark_imbalanced_is_per_replica_not_a_load_gap():
    # What bench.sim's watermark_imbalance_frac samples and cluster.routing_trace reports.
    def replica(name: str, used: int, waiting: int = 0):
        return make_stats(name, num_blocks_used=used, num_waiting_blocks=waiting)

    assert not watermark_imbalanced([replica("a", 70), replica("b", 10)], 0.95)  # a gap only
    assert watermark_imbalanced([replica("a", 90, waiting=5), replica("b", 49)], 0.95)
    assert not watermark_imbalanced([replica("a", 90, waiting=5), replica("b", 50)], 0.95)
    assert not watermark_imbalanced([replica("a", 99)], 0.95)  # one replica: nothing to balance
