"""ReplicaStats: the one thing the router sees of a replica."""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgpack


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's KV occupancy and load at one instant, published every stats period.

    kv_usage counts blocks in use by sequences; cached blocks are free for
    allocation (evicted on demand) and so do not count as usage.
    cached_prefix_hashes holds the chained hashes (replica.hashing) of the most
    recently used resident full blocks, newest first, capped in length.

    num_waiting_blocks: the blocks the queued prompts will newly take, i.e. less the
    leading blocks already cached or brought by an earlier queued prompt (an estimate
    made as each prompt is queued; None: not reported, and readers take the whole
    prompts, ceil(num_waiting_tokens / block_size)). prefix_query_tokens and
    prefix_hit_tokens count, since the replica started, the tokens of every sequence
    it admitted and those of them found in its prefix cache (vLLM's prefix-cache
    queries and hits): their ratio over an interval is the cache hit rate.

    slot_free_steps: while every sequence slot is taken, when the slots free: per running
    sequence the steps until its max_tokens ends it, soonest first (at most
    SLOT_FORECAST_LEN), at step_s seconds a step (the recent mean). Empty: no forecast,
    because slots are free or because most recent outputs ended before their max_tokens
    (on a stop token), so max_tokens does not tell when a slot frees. Outputs that end
    together free their slots in cohorts (64-token outputs at ~1.2 s apart on an H200),
    a phase a queue's mean drain rate does not see (router.queue_wait).
    prefill_tokens_per_s: prompt tokens a second over the recent steps whose prompt
    tokens filled the step's token budget (0: none lately): how fast prompts that enter
    together get their first tokens.
    """

    replica_id: str
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    kv_usage: float
    num_running: int
    num_waiting: int
    num_preempted_total: int
    max_num_seqs: int
    tokens_per_s: float
    block_size: int = 16
    num_waiting_tokens: int = 0
    num_waiting_blocks: int | None = None
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cached_prefix_hashes: tuple[int, ...] = ()
    timestamp_s: float = 0.0
    slot_free_steps: tuple[int, ...] = ()
    step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free - self.num_blocks_cached

    def to_msgpack(self) -> bytes:
        # Not dataclasses.asdict: it copies the hash tuple element by element (1.2 ms
        # for 2048 hashes on the CPU box, on every routing-stats poll); same bytes.
        return msgpack.packb({name: getattr(self, name) for name in _FIELD_NAMES})

    @classmethod
    def from_msgpack(cls, data: bytes) -> ReplicaStats:
        raw = msgpack.unpackb(data)
        raw = {k: v for k, v in raw.items() if k in _FIELD_NAMES}
        raw["cached_prefix_hashes"] = tuple(raw.get("cached_prefix_hashes", ()))
        raw["slot_free_steps"] = tuple(raw.get("slot_free_steps", ()))
        return cls(**raw)


_FIELD_NAMES = tuple(f.name for f in fields(ReplicaStats))
# The slots a forecast covers: a queue deeper than this waits for more than the running
# sequences' ends, which the queue's drain rate covers (router.queue_wait).
SLOT_FORECAST_LEN = 128
