"""The simulator's replica (bench.sim_replica) against the real Scheduler and BlockManager:
one trace replayed through both admits the same requests at every step.

The trace has shared prefixes, prompts of 1 to 23 tokens (blocks of 4), arrivals spread
over the first steps and a KV pool small enough that admission is refused at some steps
and running sequences are preempted at others. Both sides step in lockstep: the real one
as the engine would with no step in flight (compute each scheduled chunk, sample where a
sequence reaches its end, finish a request once it has its max_tokens), the simulated one
through schedule() and complete_step().

Two simulator bugs this found: it registered a prompt's blocks only when the whole prompt
was computed (the Scheduler commits them after each chunk, so a request sharing a prefix
got in a step or more earlier), and a preempted sequence's full generated blocks were
never kept cached (the Scheduler commits them before it frees the sequence).
"""

from __future__ import annotations

import random

import pytest

from bench.sim_model import default_cost_model
from bench.sim_replica import ReplicaSimConfig, SimReplica
from bench.sim_workload import Workload
from replica.block_manager import BlockManager
from replica.config import CacheConfig, SchedulerConfig
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import Sequence

BLOCK_SIZE = 4
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 64


def trace(num_requests: int, seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts (one of three shared prefixes of 2-3 blocks, or none, then a suffix unique to
    the request), output lengths, and the step each request arrives before."""
    rng = random.Random(seed)
    prefixes = [[1000 * (p + 1) + j for j in range(BLOCK_SIZE * (2 + p % 2))] for p in range(3)]
    prompts, outputs, arrive = [], [], []
    for rid in range(num_requests):
        prefix = rng.choice([*prefixes, []])
        suffix = [100_000 + 100 * rid + j for j in range(rng.randint(1, 2 * BLOCK_SIZE + 3))]
        prompts.append(prefix + suffix)
        outputs.append(rng.randint(1, 12))
        arrive.append(rid // 3)  # three a step, while earlier ones run
    return prompts, outputs, arrive


def real_steps(prompts, outputs, arrive, num_blocks: int, max_batched: int) -> tuple:
    """Per step of the real Scheduler: (request ids computing prompt tokens, running); and
    how many steps refused the queue's head for want of blocks (a slot free), and how
    many preemptions there were."""
    cache = CacheConfig(BLOCK_SIZE, num_blocks, True, max_blocks_per_seq=MAX_MODEL_LEN)
    config = SchedulerConfig(MAX_NUM_SEQS, MAX_MODEL_LEN, max_batched)
    scheduler = Scheduler(config, BlockManager(cache, MAX_NUM_SEQS))
    seqs = [
        Sequence(str(rid), p, SamplingParams(max_tokens=n, ignore_eos=True), arrival_s=0.0)
        for rid, (p, n) in enumerate(zip(prompts, outputs, strict=True))
    ]
    bm = scheduler.block_manager
    steps, num_done, step, num_refused = [], 0, 0, 0
    admitted_len: dict[str, int] = {}
    while num_done < len(seqs):
        for rid, when in enumerate(arrive):
            if when == step:
                scheduler.add(seqs[rid])
        step += 1
        waiting = set(map(id, scheduler.waiting))
        batch = scheduler.schedule()
        for seq in batch.prefill_seqs:
            if id(seq) in waiting:  # admitted now: prompt work until it samples a token
                admitted_len[seq.request_id] = len(seq)
        # A chunk that stops one token short of the end leaves that token to a decode row
        # (Scheduler.schedule): it is still prompt work, as the simulator counts it.
        last_prompt_token = [s for s in batch.decode_seqs if len(s) == admitted_len[s.request_id]]
        ids = sorted(int(s.request_id) for s in batch.prefill_seqs + last_prompt_token)
        steps.append((ids, len(scheduler.running)))
        waiting, running = scheduler.waiting, scheduler.running
        if waiting and len(running) < MAX_NUM_SEQS and not bm.can_allocate(waiting[0]):
            num_refused += 1
        for seq, n in zip(batch.prefill_seqs, batch.prefill_lens, strict=True):
            seq.num_computed_tokens += n
            scheduler.block_manager.commit(seq)
            if seq.num_computed_tokens == len(seq):
                _sample(seq)
        for seq in batch.decode_seqs:
            seq.num_computed_tokens += 1
            _sample(seq)
        for seq in list(scheduler.running):
            if len(seq) - seq.num_prompt_tokens == seq.params.max_tokens:
                scheduler.finish(seq, "length")
                num_done += 1
        scheduler.block_manager.check_invariants(scheduler.running)
        scheduler.check_invariants()
        assert step < 1000, "the real scheduler stalled"
    return steps, num_refused, scheduler.num_preempted_total


def _sample(seq: Sequence) -> None:
    # A token unique to the request and position: generated blocks are never shared.
    seq.token_ids.append(500_000 + 1000 * int(seq.request_id) + len(seq))


def sim_steps(prompts, outputs, arrive, num_blocks: int, max_batched: int) -> list[tuple]:
    """Per step of SimReplica: (request ids computing prompt tokens, running)."""
    workload = Workload.from_trace([0.0] * len(prompts), prompts, outputs, 1.0)
    workload.set_block_size(BLOCK_SIZE)
    config = ReplicaSimConfig(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max_batched,
    )  # fmt: skip
    first_token_s, finish_s = [-1.0] * len(prompts), [-1.0] * len(prompts)
    replica = SimReplica(0, config, default_cost_model(), workload, first_token_s, finish_s)
    steps, step = [], 0
    while min(finish_s) < 0:
        for rid, when in enumerate(arrive):
            if when == step:
                replica.add(rid)
        step += 1
        assert step < 1000, "the simulated replica stalled"
        if replica.schedule(float(step)) is None:
            steps.append(([], 0))
            continue
        steps.append((sorted(seq.rid for seq, _ in replica.batch), len(replica.running)))
        replica.complete_step(float(step))
        replica.check_invariants()
    return steps


# (KV blocks, token budget per step, seed): pools of 20-28 blocks of 4 tokens for 40
# prompts of 1-23 tokens, 3 arriving a step, refuse the queue's head at 21-36 steps and
# preempt 3-10 times; a budget of 8 or 12 tokens chunks most prompts.
CASES = [(20, 8, 0), (24, 16, 1), (28, 32, 2), (22, 12, 3), (26, 24, 4)]


@pytest.mark.parametrize(("num_blocks", "max_batched", "seed"), CASES)
def test_the_simulated_replica_admits_what_the_scheduler_admits(num_blocks, max_batched, seed):
    prompts, outputs, arrive = trace(40, seed)
    real, num_refused, num_preempted = real_steps(prompts, outputs, arrive, num_blocks, max_batched)
    assert num_refused > 0 and num_preempted > 0  # the trace reaches the block limit
    sim = sim_steps(prompts, outputs, arrive, num_blocks, max_batched)
    for step, (want, got) in enumerate(zip(real, sim, strict=False)):
        assert got == want, f"step {step + 1}: scheduler {want}, simulator {got}"
    assert len(sim) == len(real)


def test_the_simulated_replica_forecasts_its_slots_as_the_engine_does() -> None:
    """While its slots are all taken it publishes, per running sequence, the steps to its
    end, soonest first (replica.LLMEngine's slot forecast: every simulated output ends
    at its length), and the prompt tokens a second of its budget-filling prefill steps."""
    outputs = [6, 3, 9, 2]
    prompts = [[10 * rid + j for j in range(8)] for rid in range(len(outputs))]
    workload = Workload.from_trace([0.0] * len(prompts), prompts, outputs, 1.0)
    workload.set_block_size(BLOCK_SIZE)
    config = ReplicaSimConfig(
        num_blocks=64, block_size=BLOCK_SIZE, max_num_seqs=3, max_num_batched_tokens=8
    )
    first_token_s, finish_s = [-1.0] * len(prompts), [-1.0] * len(prompts)
    replica = SimReplica(0, config, default_cost_model(), workload, first_token_s, finish_s)
    replica.add(0)
    replica.add(1)
    now_s = 0.0
    for _ in range(2):  # two prompts of 8 tokens, one a step at a budget of 8
        now_s = replica.schedule(now_s)
        replica.complete_step(now_s)
    stats = replica.stats(now_s, with_hashes=False)
    assert stats.slot_free_steps == () and stats.prefill_tokens_per_s > 0  # a slot is free
    replica.add(2)
    replica.add(3)  # two running and two queued for the one free slot: all spoken for
    stats = replica.stats(now_s, with_hashes=False)
    # Request 0 got its first token at step 1 and decoded one more: 6 - 2 to go. Request
    # 1's last prompt chunk is still in (its step gave a token to request 0): its 3.
    # The queued ones hold no slot.
    assert stats.slot_free_steps == (3, 4)
    assert stats.step_s > 0
