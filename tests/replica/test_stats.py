"""ReplicaStats on the wire: what routers and carriers decode, byte for byte."""

from __future__ import annotations

import dataclasses

import msgpack

from replica.stats import ReplicaStats
from tests.router.router_fakes import make_stats


def test_msgpack_is_a_map_of_every_field_in_order_and_round_trips() -> None:
    hashes = tuple(range(2**63, 2**63 + 2048))  # as large as chained hashes get
    forecast = dataclasses.replace(
        make_stats("r2"), slot_free_steps=(3, 4, 200), step_s=0.01, prefill_tokens_per_s=1e5
    )
    for stats in (make_stats("r0"), make_stats("r1", cached_prefix_hashes=hashes), forecast):
        data = stats.to_msgpack()
        assert data == msgpack.packb(dataclasses.asdict(stats))  # the format routers read
        assert ReplicaStats.from_msgpack(data) == stats


def test_unknown_fields_are_ignored_and_missing_ones_default() -> None:
    raw = msgpack.unpackb(make_stats("r0", num_running=3).to_msgpack())
    raw["from_a_newer_replica"] = 1
    del raw["cached_prefix_hashes"], raw["slot_free_steps"]
    stats = ReplicaStats.from_msgpack(msgpack.packb(raw))
    assert stats.num_running == 3 and stats.cached_prefix_hashes == ()
    assert stats.slot_free_steps == ()
