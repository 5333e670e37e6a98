from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from replica.hashing import prefix_block_hashes
from router import KVPolicy, Pow2Policy, PrefixPolicy, RouterConfig, RouteRequest, make_policy
from router.load import load_fraction
from tests.router.router_fakes import make_stats


def ids(tiers: list[list[str]]) -> list[str]:
    return [replica_id for tier in tiers for replica_id in tier]


def test_make_policy_builds_each_policy() -> None:
    assert isinstance(make_policy(RouterConfig(policy="kv")), KVPolicy)
    assert isinstance(make_policy(RouterConfig(policy="prefix")), PrefixPolicy)
    assert isinstance(make_policy(RouterConfig(policy="pow2")), Pow2Policy)


def test_kv_picks_least_loaded(now_s: float) -> None:
    stats = [
        make_stats("a", num_blocks_used=60),
        make_stats("b", num_blocks_used=10),
        make_stats("c", num_blocks_used=30),
    ]
    tiers = KVPolicy().choose_replicas(stats, RouteRequest("r", num_prompt_tokens=16), now_s)
    assert tiers == [["b"], ["c"], ["a"]]


def test_kv_counts_waiting_work(now_s: float) -> None:
    # b uses fewer blocks but its queued prompts need 40 more.
    stats = [
        make_stats("a", num_blocks_used=20),
        make_stats("b", num_blocks_used=10, num_waiting_tokens=40 * 16),
    ]
    assert KVPolicy().choose_replicas(stats, RouteRequest("r"), now_s)[0] == ["a"]


def test_kv_counts_sequence_slots(now_s: float) -> None:
    # a has just taken a batch of short requests: few blocks, every slot full (the next
    # request waits for a slot there); b runs fewer, longer sequences on more blocks.
    stats = [
        make_stats("a", num_blocks_total=1000, num_blocks_used=20, num_running=64),
        make_stats("b", num_blocks_total=1000, num_blocks_used=100, num_running=10),
    ]
    request = RouteRequest("r", num_prompt_tokens=16)
    assert KVPolicy().choose_replicas(stats, request, now_s) == [["b"], ["a"]]
    assert load_fraction(stats[0], request) == 65 / 64  # slots: 64 running + this one
    assert load_fraction(stats[1], request) == 11 / 64  # slots again: over 101 / 1000 blocks


def test_kv_normalises_by_capacity(now_s: float) -> None:
    stats = [
        make_stats("small", num_blocks_total=100, num_blocks_used=50),
        make_stats("big", num_blocks_total=1000, num_blocks_used=100),
    ]
    assert KVPolicy().choose_replicas(stats, RouteRequest("r"), now_s)[0] == ["big"]


def test_kv_spreads_over_replicas_within_the_balance_band(now_s: float) -> None:
    # a, b and c are within 0.1 of the least loaded (a): equals, spread over requests;
    # d is not, and comes last for every request. Without a band, a is always first.
    stats = [make_stats(n, num_blocks_used=u) for n, u in zip("abcd", [20, 25, 29, 31])]
    banded = KVPolicy(seed=1, balance_band=0.1)
    firsts = Counter(banded.choose_replicas(stats, RouteRequest(f"q{n}"), now_s)[0][0]
                     for n in range(300))  # fmt: skip
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 60
    assert all(banded.choose_replicas(stats, RouteRequest(f"q{n}"), now_s)[-1] == ["d"]
               for n in range(50))  # fmt: skip
    strict = KVPolicy(seed=1)
    assert {strict.choose_replicas(stats, RouteRequest(f"q{n}"), now_s)[0][0]
            for n in range(50)} == {"a"}  # fmt: skip


def test_kv_ties_are_seeded_and_spread_over_requests(now_s: float) -> None:
    stats = [make_stats(f"r{i}") for i in range(4)]
    firsts = [
        KVPolicy(seed=7).choose_replicas(stats, RouteRequest(f"q{n}"), now_s)[0][0]
        for n in range(200)
    ]
    again = [
        KVPolicy(seed=7).choose_replicas(stats, RouteRequest(f"q{n}"), now_s)[0][0]
        for n in range(200)
    ]
    assert firsts == again
    assert set(Counter(firsts)) == {"r0", "r1", "r2", "r3"}


def test_prefix_picks_longest_cached_prefix(now_s: float) -> None:
    tokens = list(range(64))  # 4 blocks of 16
    hashes = prefix_block_hashes(tokens, 16)
    stats = [
        make_stats("one", cached_prefix_hashes=tuple(hashes[:1])),
        make_stats("three", num_blocks_used=5, cached_prefix_hashes=tuple(hashes[:3][::-1])),
        make_stats("none"),
    ]
    policy = PrefixPolicy(balance_abs_threshold=0.1, balance_rel_threshold=1.5)
    tiers = policy.choose_replicas(stats, RouteRequest.from_tokens("r", tokens), now_s)
    assert tiers == [["three"], ["one"], ["none"]]


def test_prefix_match_is_the_deepest_published_block(now_s: float) -> None:
    # Chained hashes: publishing block i means having computed blocks 0..i, so a summary
    # that leaves out a chain's head (capped or thinned, BlockManager.recent_hashes) still
    # matches it to its deepest published block.
    tokens = list(range(80))
    hashes = prefix_block_hashes(tokens, 16)
    stats = [
        make_stats("sampled", cached_prefix_hashes=(hashes[3], hashes[1])),
        make_stats("head", cached_prefix_hashes=(hashes[0], hashes[1])),
        make_stats("other", cached_prefix_hashes=tuple(prefix_block_hashes(tokens[1:], 16))),
    ]
    policy = PrefixPolicy(balance_abs_threshold=0.1, balance_rel_threshold=1.5, seed=3)
    tiers = policy.choose_replicas(stats, RouteRequest.from_tokens("r", tokens), now_s)
    assert tiers[:2] == [["sampled"], ["head"]]


def test_prefix_falls_back_to_load_when_imbalanced(now_s: float) -> None:
    tokens = list(range(64))
    hashes = tuple(prefix_block_hashes(tokens, 16))
    stats = [
        # One block of four cached: a replica caching at least half keeps the request.
        make_stats("hot", num_blocks_used=80, cached_prefix_hashes=hashes[:1]),
        make_stats("cold", num_blocks_used=10),
    ]
    request = RouteRequest.from_tokens("r", tokens)
    imbalanced = PrefixPolicy(balance_abs_threshold=0.2, balance_rel_threshold=1.5)
    assert imbalanced.choose_replicas(stats, request, now_s)[0] == ["cold"]
    # The same gap under a looser absolute threshold counts as balanced: affinity wins.
    tolerant = PrefixPolicy(balance_abs_threshold=0.9, balance_rel_threshold=1.5)
    assert tolerant.choose_replicas(stats, request, now_s)[0] == ["hot"]


def test_prefix_without_match_orders_like_kv(now_s: float) -> None:
    stats = [make_stats(f"r{i}", num_blocks_used=u) for i, u in enumerate([30, 10, 20, 10])]
    request = RouteRequest.from_tokens("q", list(range(50)))
    for band in (0.0, 0.1):
        prefix = PrefixPolicy(
            balance_abs_threshold=1.0, balance_rel_threshold=10.0, seed=3, balance_band=band
        )
        kv = KVPolicy(seed=3, balance_band=band)
        assert prefix.choose_replicas(stats, request, now_s) == kv.choose_replicas(
            stats, request, now_s
        )


def test_pow2_is_seeded(now_s: float) -> None:
    stats = [make_stats(f"r{i}", num_blocks_used=i * 5) for i in range(8)]
    request = RouteRequest("q")
    a, b = Pow2Policy(seed=1), Pow2Policy(seed=1)
    runs_a = [a.choose_replicas(stats, request, now_s) for _ in range(50)]
    runs_b = [b.choose_replicas(stats, request, now_s) for _ in range(50)]
    assert runs_a == runs_b
    assert len({tuple(ids(t)[:2]) for t in runs_a}) > 5


def test_pow2_routers_with_one_seed_do_not_sample_in_lockstep(now_s: float) -> None:
    # Every Serve handle and proxy has its own router, all with the config's seed.
    stats = [make_stats(f"r{i}") for i in range(8)]
    a, b = Pow2Policy(seed=0), Pow2Policy(seed=0)
    pairs_a = [ids(a.choose_replicas(stats, RouteRequest(f"a{i}"), now_s))[:2] for i in range(200)]
    pairs_b = [ids(b.choose_replicas(stats, RouteRequest(f"b{i}"), now_s))[:2] for i in range(200)]
    same = sum(pa == pb for pa, pb in zip(pairs_a, pairs_b, strict=True))
    assert same < 20  # 1 in 56 by chance, not every one
    firsts = Counter(p[0] for p in pairs_a)
    assert len(firsts) == 8 and max(firsts.values()) < 50  # about 25 each


def test_pow2_never_picks_the_worse_of_its_two(now_s: float) -> None:
    stats = [make_stats(f"r{i}", num_blocks_used=i * 10) for i in range(6)]
    by_id = {s.replica_id: s for s in stats}
    policy = Pow2Policy(seed=0)
    request = RouteRequest("q")
    chosen = Counter()
    for _ in range(300):
        tiers = policy.choose_replicas(stats, request, now_s)
        assert sorted(ids(tiers)) == sorted(by_id)
        best, other = tiers[0][0], tiers[1][0]
        assert load_fraction(by_id[best], request) <= load_fraction(by_id[other], request)
        chosen[best] += 1
    assert chosen["r5"] == 0  # the most loaded replica is always the worse of any pair
    assert chosen["r0"] > chosen["r4"]


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(st.integers(0, 100), min_size=0, max_size=6),
    policy_name=st.sampled_from(["kv", "prefix", "pow2"]),
    num_tokens=st.integers(0, 80),
)
def test_every_replica_ranked_exactly_once(used: list[int], policy_name: str, num_tokens: int):
    stats = [make_stats(f"r{i}", num_blocks_used=u) for i, u in enumerate(used)]
    policy = make_policy(RouterConfig(policy=policy_name))
    tiers = policy.choose_replicas(stats, RouteRequest.from_tokens("q", range(num_tokens)), 0.0)
    assert all(tiers)
    assert sorted(ids(tiers)) == sorted(s.replica_id for s in stats)


def _first_choice(policy: PrefixPolicy, stats: list, tokens: list[int], request_id: str) -> str:
    return policy.choose_replicas(stats, RouteRequest.from_tokens(request_id, tokens), 0.0)[0][0]


def test_prefix_sends_a_prefix_nobody_caches_yet_to_one_replica_for_every_router() -> None:
    # No replica publishes anything (a new prefix, or summaries not yet delivered): every
    # request sharing the first 64 tokens goes to the same replica, whatever its id, the
    # rest of its prompt, or which router (policy object) routes it.
    stats = [make_stats(f"r{i}", num_blocks_used=10) for i in range(8)]
    routers = [make_policy(RouterConfig(policy="prefix", seed=1)) for _ in range(3)]
    homes = []
    for p in range(40):
        prefix = [p, *range(100, 163)]  # 64 tokens
        choices = {
            _first_choice(router, stats, prefix + [q, q + 1], f"req-{p}-{q}")
            for q, router in enumerate(routers * 3)
        }
        assert len(choices) == 1, (p, choices)
        homes.append(choices.pop())
    assert len(set(homes)) >= 6  # distinct prefixes spread over the replicas


def test_prefix_affinity_yields_to_a_cached_match_load_and_short_prompts() -> None:
    prefix = list(range(64))
    policy = PrefixPolicy(0.1, 1.5, seed=1, balance_band=0.1, affinity_tokens=64)
    stats = [make_stats(f"r{i}", num_blocks_used=10) for i in range(4)]
    home = _first_choice(policy, stats, prefix + [7], "a")
    other = next(s.replica_id for s in stats if s.replica_id != home)
    hashes = tuple(prefix_block_hashes(prefix, 16))
    cached_elsewhere = [
        make_stats(s.replica_id, num_blocks_used=10, cached_prefix_hashes=hashes)
        if s.replica_id == other
        else s
        for s in stats
    ]
    assert _first_choice(policy, cached_elsewhere, prefix + [7], "a") == other

    def loads(home_blocks: int, other_blocks: int) -> list:
        return [make_stats(s.replica_id, num_blocks_used=home_blocks if s.replica_id == home
                           else other_blocks) for s in stats]  # fmt: skip

    # A busier home keeps the prefix while loads are balanced, past the balance band too
    # (0.95 against 0.75, with the 5-block prompt: a gap over balance_abs_threshold, but
    # not 1.5 times); once imbalanced (0.65 against 0.15) the lighter replicas come first.
    assert _first_choice(policy, loads(90, 70), prefix + [7], "a") == home
    assert _first_choice(policy, loads(60, 10), prefix + [7], "a") != home
    # Under one block of prompt, and with affinity off, ties break per request.
    short = {_first_choice(policy, stats, [1, 2, 3], f"s{i}") for i in range(40)}
    per_request = PrefixPolicy(0.1, 1.5, seed=1, balance_band=0.1, affinity_tokens=0)
    off = {_first_choice(per_request, stats, prefix + [7], f"o{i}") for i in range(40)}
    assert len(short) > 1 and len(off) > 1
