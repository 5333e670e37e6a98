"""The prefix policy ranks exactly as the original per-replica set intersection did.

reference_choose_replicas is the PrefixPolicy of commit 16f599a (one set() per
replica per request, O(replicas x hashes)), kept here verbatim apart from its
match, which counts to the deepest published block as the index now does, its
balance rule, applied per replica as the policy now does, and its tiebreak, which
it takes from router.tiebreak like the policy under test, so that the indexed policy
can be checked against it on random fleets: shared and private chains, truncated and
non-contiguous summaries, mixed block sizes, balanced and imbalanced loads, requests
with and without prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from replica.hashing import prefix_block_hashes
from replica.stats import ReplicaStats
from router import PrefixPolicy, RouteRequest
from router.load import load_fraction
from router.tiebreak import tiebreak
from tests.router.router_fakes import make_stats


def reference_num_matched_blocks(stats: ReplicaStats, request: RouteRequest) -> int:
    # Since the deepest-block match (router.prefix_index.deepest_levels): the deepest
    # prompt block the summary holds, not the leading run of 16f599a.
    cached = set(stats.cached_prefix_hashes)
    num_matched = 0
    for depth, block_hash in enumerate(request.prompt_block_hashes(stats.block_size)):
        if block_hash in cached:
            num_matched = depth + 1
    return num_matched


def reference_is_overloaded(
    load: float,
    loads: Sequence[float],
    balance_abs_threshold: float,
    balance_rel_threshold: float,
    num_matched: int,
    num_blocks: int,
) -> bool:
    least = min(loads)
    # Since the cached share: the gap grows from balance_abs_threshold with nothing cached
    # there to a whole replica (1.0) at half the prompt cached.
    share = min(1.0, 2 * num_matched / max(num_blocks, 1))
    threshold = balance_abs_threshold + share * max(0.0, 1.0 - balance_abs_threshold)
    return load - least > threshold and load > balance_rel_threshold * least


def reference_rank_by_load(
    stats: Sequence[ReplicaStats], request: RouteRequest, seed: int
) -> list[ReplicaStats]:
    return sorted(
        stats,
        key=lambda s: (load_fraction(s, request), tiebreak(seed, request.request_id, s.replica_id)),
    )


def reference_choose_replicas(
    stats: Sequence[ReplicaStats],
    request: RouteRequest,
    balance_abs_threshold: float,
    balance_rel_threshold: float,
    seed: int,
) -> list[list[str]]:
    if not request.prompt_token_ids:
        return [[s.replica_id] for s in reference_rank_by_load(stats, request, seed)]
    # Since the per-replica balance rule: an overloaded replica goes after the others,
    # by load, unless it caches at least half the prompt; the others by cached blocks,
    # then load.
    loads = {s.replica_id: load_fraction(s, request) for s in stats}
    spilled = {
        s.replica_id: reference_is_overloaded(loads[s.replica_id], list(loads.values()),
                                              balance_abs_threshold, balance_rel_threshold,
                                              reference_num_matched_blocks(s, request),
                                              request.num_prompt_blocks(s.block_size))
        # ... unless it caches at least half the prompt's blocks there.
        and 2 * reference_num_matched_blocks(s, request) < request.num_prompt_blocks(s.block_size)
        for s in stats
    }  # fmt: skip
    ranked = sorted(
        stats,
        key=lambda s: (
            spilled[s.replica_id],
            0 if spilled[s.replica_id] else -reference_num_matched_blocks(s, request),
            loads[s.replica_id],
            tiebreak(seed, request.request_id, s.replica_id),
        ),
    )
    return [[s.replica_id] for s in ranked]


def random_fleet(rng: random.Random, prompts: list[list[int]]) -> list[ReplicaStats]:
    fleet = []
    for i in range(rng.randrange(1, 40)):
        block_size = rng.choice([16, 16, 16, 8])
        hashes: list[int] = []
        for prompt in rng.sample(prompts, rng.randrange(0, 4)):
            chain = prefix_block_hashes(prompt, block_size)
            cut = rng.randrange(0, len(chain) + 1)
            kept = chain[:cut]
            if kept and rng.random() < 0.2:  # a summary that lost a block in the middle
                del kept[rng.randrange(len(kept))]
            hashes += kept
        hashes += [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))]
        rng.shuffle(hashes)
        total = rng.choice([64, 100, 100, 256])
        used = rng.randrange(0, total + 1) if rng.random() < 0.5 else rng.randrange(0, 8)
        cached = rng.randrange(0, total - used + 1)
        fleet.append(
            make_stats(
                f"replica-{i}",
                num_blocks_total=total,
                num_blocks_used=used,
                num_blocks_cached=cached,
                num_waiting_tokens=rng.choice([0, 0, rng.randrange(0, 2000)]),
                block_size=block_size,
                cached_prefix_hashes=tuple(hashes),
            )
        )
    return fleet


@pytest.mark.parametrize("seed", range(300))
def test_indexed_prefix_policy_ranks_like_the_set_intersection(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(0, 200))] for _ in range(6)]
    # Shared heads: prompts 1 and 2 extend prompt 0, so chains fork after a common prefix.
    prompts[1] = prompts[0] + prompts[1]
    prompts[2] = prompts[0] + prompts[2]
    stats = random_fleet(rng, prompts)
    abs_threshold = rng.choice([0.0, 0.1, 0.5, 10.0])
    rel_threshold = rng.choice([1.0, 1.5, 100.0])
    policy = PrefixPolicy(abs_threshold, rel_threshold, seed=seed % 3)
    for n in range(5):
        tokens = rng.choice(prompts)[: rng.randrange(0, 260)] + [rng.randrange(500)] * rng.choice(
            [0, 20]
        )
        request = RouteRequest.from_tokens(f"q{seed}-{n}", tokens, max_tokens=8)
        expected = reference_choose_replicas(stats, request, abs_threshold, rel_threshold, seed % 3)
        assert policy.choose_replicas(stats, request, 0.0) == expected
