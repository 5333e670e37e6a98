"""cluster.routing_trace: one row per admitted decision, and what a run's rows add up to."""

from __future__ import annotations

import math

import pytest

from cluster import routing_trace
from replica.hashing import prefix_block_hashes
from router import Admission, RouterConfig, RouteRequest
from tests.router.router_fakes import NOW_S, make_stats

TOKENS = list(range(100, 164))  # 4 blocks of 16
HASHES = tuple(prefix_block_hashes(TOKENS, 16))


@pytest.fixture(autouse=True)
def _fresh_trace():
    routing_trace.enable()
    yield
    routing_trace.disable()  # back to off, as in a process that never enabled it


def _decide(config: RouterConfig, stats, request_id: str = "r1"):
    admission = Admission(config)
    request = RouteRequest(request_id, tuple(TOKENS) + (7,) * 8)
    return request, admission.admit(stats, request, NOW_S)


def test_a_row_names_the_match_the_loads_and_the_summary_age() -> None:
    config = RouterConfig(policy="prefix")
    warm = make_stats("warm", num_blocks_used=12, cached_prefix_hashes=HASHES[:3])
    cold = make_stats("cold", num_blocks_used=10)
    full = make_stats("full", num_blocks_used=100, cached_prefix_hashes=HASHES)
    request, decision = _decide(config, [warm, cold, full])
    # 0.25 s old hashes of warm, as Serve's routing stats bring them
    summaries = {"warm": make_stats("warm", timestamp_s=NOW_S - 0.25, cached_prefix_hashes=HASHES)}
    routing_trace.record(request, decision, NOW_S + 0.01, summaries, config, attempt=2)
    rows, dropped = routing_trace.drain()
    assert dropped == 0 and len(rows) == 1
    row = rows[0]
    assert row.chosen == "warm" == decision.tiers[0][0]
    assert (row.chosen_matched, row.best_admissible_matched, row.best_matched) == (3, 3, 4)
    assert (row.num_replicas, row.num_admissible) == (3, 2)  # full has no room
    assert row.chosen_load == pytest.approx(0.14)  # warm: 12 used + 2 uncached blocks
    assert row.min_load == pytest.approx(0.14)  # cold: 10 used + the whole prompt, 0.15
    assert not row.imbalanced
    assert row.summary_age_s == pytest.approx(0.26)
    assert row.load_age_s == pytest.approx(0.01)
    assert row.summary_size == 4 and row.attempt == 2  # the summary Serve delivered
    assert row.prefix_key == HASHES[3]  # the 64-token affinity prefix's last block
    assert routing_trace.drain() == ([], 0)  # drained, still on


def test_imbalanced_is_a_replica_at_the_watermark_while_another_is_under_half_full() -> None:
    # The per-replica rule bench.sim counts (watermark_imbalance_frac), by the router's
    # snapshots: a 0.7 / 0.1 gap tripped the old fleet-wide gap rule (0.5 and 1.5x), but
    # nothing waits there; 0.9 used + 6 queued blocks at the 0.95 watermark does count.
    config = RouterConfig(policy="prefix")
    gap = [make_stats("a", num_blocks_used=70), make_stats("b", num_blocks_used=10)]
    full = [make_stats("a", num_blocks_used=90, num_waiting_blocks=6), gap[1]]
    for stats, expected in ((gap, False), (full, True)):
        request, decision = _decide(config, stats)
        routing_trace.record(request, decision, NOW_S, {s.replica_id: s for s in stats}, config)
        assert routing_trace.drain()[0][0].imbalanced is expected


def test_nothing_is_recorded_while_off_or_for_a_held_decision() -> None:
    config = RouterConfig(policy="kv")
    request, decision = _decide(config, [make_stats("a", num_blocks_used=99)])
    assert not decision.admitted
    routing_trace.record(request, decision, NOW_S, {}, config)
    assert routing_trace.drain() == ([], 0)
    routing_trace.disable()
    request, decision = _decide(config, [make_stats("a")])
    routing_trace.record(request, decision, NOW_S, {}, config)
    assert not routing_trace.is_enabled() and routing_trace.drain() == ([], 0)


def test_summarize_counts_followed_matches_and_replicas_per_prefix() -> None:
    def row(chosen: str, key: int, chosen_matched: int, best: int, age_s: float):
        return routing_trace.RoutingRow(
            t_s=0.0, request_id=chosen + str(key), prefix_key=key, chosen=chosen,
            chosen_matched=chosen_matched, best_matched=best, best_admissible_matched=best,
            num_replicas=2, num_admissible=2, chosen_load=0.5, min_load=0.25,
            imbalanced=False, summary_age_s=age_s, load_age_s=0.0, summary_size=8, attempt=0,
        )  # fmt: skip

    rows = [row("a", 1, 4, 4, 0.1), row("b", 1, 0, 4, 0.3), row("a", 2, 0, 0, math.nan)]
    s = routing_trace.summarize(rows)
    assert s["decisions"] == 3
    assert s["with_match"] == s["admissible_match"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["followed"] == 0.5
    assert s["prefixes"] == 2 and s["mean_replicas_per_prefix"] == 1.5
    assert s["summary_age_ms"] == {"p50": 200.0, "p90": 280.0}  # the two known ages
    assert s["chosen_minus_min_load"]["p50"] == 0.25
    assert routing_trace.summarize([]) == {"decisions": 0}
