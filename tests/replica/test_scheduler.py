"""Scheduler bookkeeping: the running counts of waiting tokens and blocks equal the queue's.

ReplicaStats.num_waiting_tokens and num_waiting_blocks are read from the Scheduler's
counts, kept as sequences enter and leave the waiting queue rather than summed per
snapshot. Each test drives the queue through every way in and out and recomputes them.
"""

from __future__ import annotations

import random

from replica import EngineConfig, LLMEngine, SamplingParams
from replica.block_manager import BlockManager
from replica.config import CacheConfig, SchedulerConfig
from replica.scheduler import ScheduledBatch, Scheduler
from replica.sequence import PLACEHOLDER, Sequence, SequenceStatus

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int, max_num_batched_tokens: int = 64, prefix_caching: bool = True
) -> Scheduler:
    cache = CacheConfig(BLOCK_SIZE, num_blocks, prefix_caching, max_blocks_per_seq=16)
    config = SchedulerConfig(
        max_num_seqs=4, max_model_len=64, max_num_batched_tokens=max_num_batched_tokens
    )
    return Scheduler(config, BlockManager(cache, config.max_num_seqs))


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run(scheduler: Scheduler, batch: ScheduledBatch, token: int = 7) -> None:
    """The engine's launch and drain in one: compute the chunks, sample where a sequence
    reaches its end."""
    for seq, n in zip(batch.prefill_seqs, batch.prefill_lens, strict=True):
        seq.num_computed_tokens += n
        scheduler.block_manager.commit(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(token)
    for seq in batch.decode_seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(token)


def check(scheduler: Scheduler) -> None:
    assert scheduler.num_waiting_tokens == sum(len(s) for s in scheduler.waiting)
    assert scheduler.num_waiting_blocks == sum(s.num_queued_blocks for s in scheduler.waiting)
    scheduler.block_manager.check_invariants(scheduler.running)


def step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    check(scheduler)
    run(scheduler, batch)
    check(scheduler)
    return batch


def test_count_follows_add_admit_chunk_abort_preempt_and_finish() -> None:
    scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=6)
    prefix = list(range(10, 18))  # two full blocks
    first = make_seq("first", prefix + [1, 2, 3])
    scheduler.add(first)
    check(scheduler)
    assert scheduler.num_waiting_tokens == 11

    # Chunked prefill: "first" leaves the queue whole on admission, then runs in chunks.
    batch = step(scheduler)
    assert batch.prefill_lens == [6] and scheduler.prefilling == [first]
    sharer = make_seq("sharer", prefix + [4, 5])
    other = make_seq("other", [40, 41, 42, 43, 44])
    dropped = make_seq("dropped", [50, 51, 52])
    for seq in (sharer, other, dropped):
        scheduler.add(seq)
        check(scheduler)
    assert scheduler.num_waiting_tokens == 10 + 5 + 3

    # Abort while waiting.
    scheduler.finish(dropped, "abort")
    check(scheduler)
    assert scheduler.num_waiting_tokens == 15

    # Prefix cache: "sharer" waits for the prefix "first" computes, then is admitted on
    # the cached blocks; its whole length leaves the count, whatever it reuses.
    while sharer.status is SequenceStatus.WAITING:
        step(scheduler)
    assert sharer.num_cached_tokens == 2 * BLOCK_SIZE
    while scheduler.waiting:
        step(scheduler)
    assert scheduler.num_waiting_tokens == 0

    # Preempt a sequence part-way through its chunked prefill: back at the head of the
    # queue with its full length to recompute.
    late = make_seq("late", list(range(60, 75)))
    scheduler.add(late)
    step(scheduler)
    assert late in scheduler.prefilling
    scheduler.preempt(late)
    check(scheduler)
    assert scheduler.waiting[0] is late and scheduler.num_waiting_tokens == len(late) == 15

    # Abort a running sequence: the queue is untouched.
    scheduler.finish(other, "abort")
    check(scheduler)
    assert scheduler.num_waiting_tokens == 15

    # Preempted with a token in flight: the placeholder is filled in place, then the
    # sequence stops while still waiting.
    assert first.status is SequenceStatus.RUNNING
    first.token_ids.append(PLACEHOLDER)  # launched in the step before the preemption
    first.num_computed_tokens += 1
    scheduler.preempt(first)
    check(scheduler)
    first.token_ids[-1] = 9
    check(scheduler)
    scheduler.finish(first, "stop")
    check(scheduler)
    assert scheduler.num_waiting_tokens == len(late)

    # Run to the end: finishing running sequences leaves the count alone; it drains to 0.
    while scheduler.running or scheduler.waiting:
        step(scheduler)
        for seq in list(scheduler.running):
            if len(seq) >= seq.max_len and seq not in scheduler.prefilling:
                scheduler.finish(seq, "length")
                check(scheduler)
    assert scheduler.num_waiting_tokens == 0


def test_count_follows_preemption_for_blocks() -> None:
    scheduler = make_scheduler(num_blocks=6)  # room for three 5-token prompts, not their decodes
    for i in range(3):
        scheduler.add(make_seq(f"s{i}", [20 + i] * 5, max_tokens=12))
    check(scheduler)
    for _ in range(5):  # the 5th step computes the 9th token: a rollover, no free block
        step(scheduler)
    assert scheduler.num_preempted_total > 0
    assert [s.request_id for s in scheduler.waiting] == ["s2"]
    assert scheduler.num_waiting_tokens == len(scheduler.waiting[0]) > 5


def test_engine_snapshot_counts_the_queue_through_a_random_workload() -> None:
    """The engine's own paths: placeholders in flight when a sequence is preempted,
    stops and length ends while it waits, aborts anywhere, chunks and prefix hits."""
    engine = LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", block_size=16, num_blocks=10, max_num_seqs=6,
            max_num_batched_tokens=24, enable_cuda_graphs=False,
        )
    )  # fmt: skip
    scheduler = engine.scheduler
    ended_while: dict[tuple[SequenceStatus, str], int] = {}
    finish = scheduler.finish

    def recording_finish(seq: Sequence, reason: str, **kwargs: bool) -> None:
        key = (seq.status, "abort" if reason == "abort" else "end")
        ended_while[key] = ended_while.get(key, 0) + 1
        finish(seq, reason, **kwargs)

    scheduler.finish = recording_finish
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(33)] for _ in range(2)]
    for i in range(120):
        for _ in range(rng.choice([0, 1, 2])):
            prompt = rng.choice(prefixes)[: rng.randrange(1, 34)] + [rng.randrange(3, 500)] * 3
            params = SamplingParams(
                max_tokens=rng.randrange(1, 60), temperature=1.0, seed=i,
                stop_token_ids=rng.sample(range(500), 25),
            )  # fmt: skip
            engine.add_request(f"r{i}-{len(engine.requests)}-{rng.random()}", prompt, params)
        if engine.requests and rng.random() < 0.15:
            engine.abort(rng.choice(list(engine.requests)))
        engine.step()
        engine.check_invariants()
        assert engine.stats(with_hashes=False).num_waiting_tokens == sum(
            len(s) for s in scheduler.waiting
        )
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert scheduler.num_waiting_tokens == engine.stats().num_waiting_tokens == 0
    # The workload reached every way out of the queue, and preemption put sequences back.
    assert scheduler.num_preempted_total > 0
    assert set(ended_while) >= {
        (SequenceStatus.WAITING, "abort"),
        (SequenceStatus.WAITING, "end"),
        (SequenceStatus.RUNNING, "abort"),
        (SequenceStatus.RUNNING, "end"),
    }, ended_while


def test_waiting_blocks_leave_out_prefixes_cached_or_already_queued() -> None:
    """A queued prompt is charged the blocks it will newly take: not the leading blocks
    that are cached, nor those an earlier queued prompt brings."""
    scheduler = make_scheduler(num_blocks=24)
    prefix = list(range(10, 18))  # two full blocks
    scheduler.add(make_seq("a", prefix + [1, 2]))  # 3 blocks, nothing cached
    scheduler.add(make_seq("b", prefix + [3, 4, 5]))  # its 2 prefix blocks come with a
    assert scheduler.num_waiting_blocks == 3 + 1
    step(scheduler)  # a runs and caches the prefix; b waits for it
    assert [s.request_id for s in scheduler.waiting] == ["b"]
    assert scheduler.num_waiting_blocks == 1
    scheduler.add(make_seq("c", prefix + [6]))  # the prefix is cached: 1
    scheduler.add(make_seq("d", prefix))  # all cached, but its last token is computed: 1
    assert scheduler.num_waiting_blocks == 1 + 1 + 1
    b = scheduler.waiting[0]
    scheduler.finish(b, "abort")
    check(scheduler)
    assert scheduler.num_waiting_blocks == 2
    step(scheduler)
    assert not scheduler.waiting and scheduler.num_waiting_blocks == 0
    assert not scheduler._queued_hash_refs

    off = make_scheduler(num_blocks=24, prefix_caching=False)
    off.add(make_seq("a", prefix + [1, 2]))
    off.add(make_seq("b", prefix + [3, 4, 5]))
    assert off.num_waiting_blocks == 3 + 3


def test_deferred_release_holds_blocks_until_released_or_needed() -> None:
    """finish(defer_release=True) takes a sequence out of the batch at once; its blocks and
    slot come back with release_retired (oldest first), or all at once before the
    scheduler admits a waiting sequence."""
    scheduler = make_scheduler(num_blocks=8)
    bm = scheduler.block_manager
    a, b = make_seq("a", list(range(10, 17)), 1), make_seq("b", list(range(20, 27)), 1)
    for seq in (a, b):
        scheduler.add(seq)
    step(scheduler)  # both prompts: two blocks each, a token sampled
    free_before = bm.num_free_blocks
    for seq in (a, b):
        scheduler.finish(seq, "length", defer_release=True)
    assert not scheduler.running and list(scheduler.retired) == [a, b]
    assert bm.num_free_blocks == free_before and a.slot >= 0 and b.slot >= 0
    bm.check_invariants(list(scheduler.retired))

    scheduler.release_retired(1)
    assert list(scheduler.retired) == [b] and a.slot == -1 and not a.block_ids
    assert bm.num_free_blocks == free_before + 2
    bm.check_invariants(list(scheduler.retired))

    # A waiting sequence: b's blocks are back before admission, and its hashed prefix
    # is hit from the cache.
    c = make_seq("c", list(range(20, 28)) + [99])
    scheduler.add(c)
    batch = scheduler.schedule()
    assert not scheduler.retired and b.slot == -1
    assert batch.prefill_seqs == [c] and c.num_cached_tokens == BLOCK_SIZE
    check(scheduler)


def test_retired_block_count_leaves_out_blocks_others_hold() -> None:
    """num_retired_blocks counts the blocks a retired sequence alone holds: what its
    release frees. A block it shares with a running sequence, or with another retired
    one, is left out; never more than the release gives back."""
    scheduler = make_scheduler(num_blocks=16)
    bm = scheduler.block_manager
    prefix = list(range(10, 18))  # two full blocks
    a = make_seq("a", prefix + [1, 2, 3], 1)  # three blocks
    scheduler.add(a)
    step(scheduler)
    b = make_seq("b", prefix + [4, 5, 6], 1)  # shares a's two prefix blocks
    c = make_seq("c", prefix + [7], 1)
    scheduler.add(b)
    scheduler.add(c)
    step(scheduler)
    assert b.block_ids[:2] == a.block_ids[:2] == c.block_ids[:2]
    scheduler.finish(a, "length", defer_release=True)
    assert scheduler.num_retired_blocks == 1  # its last block alone
    scheduler.finish(b, "length", defer_release=True)
    assert scheduler.num_retired_blocks == 2  # + b's own last block
    scheduler.check_invariants()
    bm.check_invariants(scheduler.running + list(scheduler.retired))
    used = bm.num_used_blocks
    scheduler.release_retired()
    assert bm.num_used_blocks == used - 2 and scheduler.num_retired_blocks == 0
    # A prefix two retired sequences share is freed by their release, uncounted before.
    scheduler.finish(c, "length", defer_release=True)
    d = make_seq("d", list(range(40, 48)) + [1], 1)
    scheduler.add(d)
    step(scheduler)  # c's blocks come back before d is admitted
    e = make_seq("e", list(range(40, 48)) + [2], 1)
    scheduler.add(e)
    step(scheduler)
    assert e.block_ids[:2] == d.block_ids[:2]
    for seq in (d, e):
        scheduler.finish(seq, "length", defer_release=True)
    scheduler.check_invariants()
    bm.check_invariants(scheduler.running + list(scheduler.retired))
    assert scheduler.num_retired_blocks == 2  # each its last block; the shared two not
    used = bm.num_used_blocks
    scheduler.release_retired()
    assert bm.num_used_blocks == used - 4 and scheduler.num_retired_blocks == 0


def test_retired_blocks_are_released_before_anyone_is_preempted() -> None:
    """A decode that needs a block the retired sequences hold gets it from them: nobody
    is preempted while finished sequences still hold blocks."""
    scheduler = make_scheduler(num_blocks=4, prefix_caching=False)
    bm = scheduler.block_manager
    long = make_seq("long", list(range(10, 18)), max_tokens=4)  # 8 tokens: two full blocks
    short = make_seq("short", list(range(20, 27)), max_tokens=1)  # 7 tokens: two blocks
    for seq in (long, short):
        scheduler.add(seq)
    step(scheduler)
    scheduler.finish(short, "length", defer_release=True)
    assert bm.num_free_blocks == 0  # long's next token starts a third block
    batch = step(scheduler)
    assert batch.decode_seqs == [long] and len(long.block_ids) == 3
    assert scheduler.num_preempted_total == 0 and not scheduler.retired


def _cohort_engine() -> LLMEngine:
    """gpt2-tiny on the CPU, 32 sequences at most: retired ones come back 2 a step."""
    return LLMEngine(
        EngineConfig(
            model="gpt2-tiny", device="cpu", max_num_seqs=32, num_blocks=64,
            enable_cuda_graphs=False,
        )
    )  # fmt: skip


def test_engine_spreads_a_finishing_cohort_over_steps() -> None:
    """Requests that end on one step are output on that step, while their blocks come
    back a few a step (ceil(max_num_seqs / 16)); snapshots leave them while others run."""
    engine = _cohort_engine()
    scheduler = engine.scheduler
    prompts = [[3 + i, 5, 7, 9, 11] for i in range(12)]
    for i, prompt in enumerate(prompts):  # ten end after 3 tokens, two after 12
        params = SamplingParams(max_tokens=3 if i < 10 else 12, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    ended: dict[str, int] = {}
    retired_after: list[int] = []
    for n in range(20):
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = n
        engine.check_invariants()
        retired_after.append(len(scheduler.retired))
        if len(ended) == 10:
            break
    assert set(ended) == {f"r{i}" for i in range(10)} and len(set(ended.values())) == 1
    assert retired_after[-1] == 10 - 2  # the finishing step released two of ten
    engine.step()
    engine.check_invariants()
    assert len(scheduler.retired) == 6
    # While sequences run, either snapshot counts their blocks as free and leaves them
    # retired (a full one landing on a finishing step released a whole cohort there).
    load = engine.stats(with_hashes=False)
    assert len(scheduler.retired) == 6 and scheduler.num_retired_blocks > 0
    stats = engine.stats()
    assert len(scheduler.retired) == 6
    held = sum(len(s.block_ids) for s in scheduler.running)
    assert [s.request_id for s in scheduler.running] == ["r10", "r11"]
    assert stats.num_blocks_free + stats.num_blocks_cached == 64 - held
    assert load.num_blocks_free + load.num_blocks_cached == 64 - held
    assert load.kv_usage == stats.kv_usage == held / 64
    # The room the release gives is what they showed.
    scheduler.release_retired()
    released = engine.stats()
    assert released.num_blocks_free + released.num_blocks_cached == 64 - held
    assert released.kv_usage == stats.kv_usage
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = out.finished
        engine.check_invariants()
    assert results == {"r10": True, "r11": True}
    assert not scheduler.retired and engine.block_manager.num_free_blocks == 64


def test_an_idle_engines_full_snapshot_releases_its_retired_sequences() -> None:
    """With nothing running, the load-only snapshot leaves a finished cohort retired and
    the full one releases it, so that the hashes of its last blocks are published."""
    engine = _cohort_engine()
    scheduler = engine.scheduler
    # 5 prompt + 12 new tokens: the first block fills a step before the end, and its
    # hash waits for its turn (a few a step) past the end, which release commits.
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"r{i}", [3 + i, 5, 7, 9, 11], params)
    while engine.has_unfinished():
        engine.step()
    assert not scheduler.running and len(scheduler.retired) == 10 - 2
    published = set(engine.stats(with_hashes=False).cached_prefix_hashes)
    assert len(scheduler.retired) == 8 and not published  # the load-only one has none
    hashes_before = set(engine.block_manager.hash_to_block)
    stats = engine.stats()
    assert not scheduler.retired and engine.block_manager.num_used_blocks == 0
    last_blocks = set(engine.block_manager.hash_to_block) - hashes_before
    assert last_blocks and last_blocks <= set(stats.cached_prefix_hashes)
    engine.check_invariants()
