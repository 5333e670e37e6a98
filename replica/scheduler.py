"""Continuous batching: decode every running sequence, prefill in chunks under a budget."""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from replica.block_manager import BlockManager
from replica.config import SchedulerConfig
from replica.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One engine step's work.

    prefill_seqs[i] computes prefill_lens[i] tokens starting at its
    num_computed_tokens; decode_seqs compute their single newest token.
    block_copies are copy-on-write (src, dst) pairs to run before the model.
    """

    prefill_seqs: list[Sequence] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    decode_seqs: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill_seqs and not self.decode_seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_lens) + len(self.decode_seqs)


def charge_queued(
    hashes: list[int], num_tokens: int, block_size: int, cached: Container[int],
    queued_refs: dict[int, int],
) -> int:  # fmt: skip
    """A prompt joins a waiting queue: count its full-block hashes into queued_refs and
    return how many of its blocks it shares, i.e. its leading blocks that are cached or
    that a prompt already queued brings (less one when that covers every token: its last
    token is computed, as BlockManager._prefix_hits leaves it). The simulator's replicas
    charge their queue through this too (bench.sim_replica)."""
    num_shared = 0
    for h in hashes:  # chained hashes: only a leading run can be shared
        if h not in cached and h not in queued_refs:
            break
        num_shared += 1
    if num_shared * block_size >= num_tokens:
        num_shared -= 1
    for h in hashes:
        queued_refs[h] = queued_refs.get(h, 0) + 1
    return num_shared


def release_queued(hashes: list[int], queued_refs: dict[int, int]) -> None:
    """A prompt left the queue: uncount the hashes charge_queued counted."""
    for h in hashes:
        if queued_refs[h] == 1:
            del queued_refs[h]
        else:
            queued_refs[h] -= 1


class Scheduler:
    """Decides each step which sequences run, and with how many tokens.

    Order of a step: (1) decode: every running sequence with one token left to
    compute gets a slot for it, in one batched append; if blocks run short,
    retired sequences (finished, blocks not yet released) give theirs back, then the
    most recently admitted running sequence is preempted (blocks freed, hashed
    prefix kept cached, put back at the head of the queue to be recomputed)
    until the rest fit. (2) prefill: partially prefilled sequences continue,
    then waiting ones are admitted in arrival order while a slot, blocks for the
    whole sequence and token budget remain. A request is never dropped: one
    that cannot run now waits; the engine rejects at add time any request that
    could not fit even alone.

    Prefix sharing among requests that arrive together: a block's hash is
    registered when the step computing it is launched, so a waiting sequence
    whose next uncached block is being computed by a sequence already running
    (prefilling, or admitted earlier in this pass) waits, letting others pass,
    and is admitted a step or two later onto the cached prefix instead of
    computing and holding a copy of it (as SGLang's in-batch prefix check does).

    Parallel samples (n > 1, add_samples): sample 0 is queued; the others wait in
    awaiting_fork, never scheduled, until the engine launches sample 0's last prompt
    chunk and calls fork_samples. Each then shares sample 0's blocks (BlockManager.fork)
    and joins the running batch as a decode sequence that recomputes the last prompt
    token (into its copy-on-write copy of the last block) and samples from there: one
    prefill for all n. One with no slot or no block to spare then joins the waiting
    queue as its own request, where the prefix cache serves its full prompt blocks.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.prefilling: list[Sequence] = []  # running, more than one token still to compute
        self.num_preempted_total = 0
        # sum(len(s) for s in waiting), kept as sequences enter and leave the queue, not
        # summed on each load snapshot (every few ms). A waiting sequence's length does not
        # change: its in-flight token, if any, is its last and fills a placeholder in place;
        # chunks and prefix hits move num_computed_tokens only once it is admitted.
        # check_invariants holds it to the sum.
        self.num_waiting_tokens = 0
        # The blocks the queue will take (ReplicaStats.num_waiting_blocks): each sequence is
        # charged as it joins the queue for its blocks less its leading full blocks that are
        # cached or that a sequence already in the queue brings (counts per hash in
        # _queued_hash_refs). An estimate: the cache may gain or lose those blocks before
        # the sequence is admitted, and can_allocate decides then.
        self.num_waiting_blocks = 0
        self._queued_hash_refs: dict[int, int] = {}
        # Finished sequences whose blocks and slot are still held (finish(defer_release=
        # True)), oldest first: release_retired hands them back a few a step, and all at
        # once before the scheduler needs them (admission, preemption).
        self.retired: deque[Sequence] = deque()
        # Of the blocks retired sequences hold, those no other sequence held when each
        # retired (_retired_sole, in retired's order): free or cached once released, as no
        # sequence is admitted while any are retired. A load-only snapshot counts them as
        # free (LLMEngine.stats). Blocks two retired sequences share are left out: an
        # undercount, never more than their release gives back.
        self._retired_sole: deque[int] = deque()
        self.num_retired_blocks = 0
        # Samples waiting for sample 0's prompt (add_samples), by sample 0's request id.
        self.awaiting_fork: dict[str, list[Sequence]] = {}
        self.num_awaiting_fork = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._queued(seq)

    def add_samples(self, seqs: list[Sequence]) -> None:
        """Queue the n samples of one prompt: seqs[0] as any request, the others to
        fork from it once its prompt is computed (fork_samples)."""
        self.add(seqs[0])
        if len(seqs) > 1:
            self.awaiting_fork[seqs[0].request_id] = list(seqs[1:])
            self.num_awaiting_fork += len(seqs) - 1

    def fork_samples(self, parent: Sequence) -> None:
        """parent's last prompt chunk is launched: fork the samples awaiting it.

        Each child shares parent's blocks with its prompt counted computed but for the
        last token, and joins running; its first decode step recomputes that token into
        a copy of the last block and samples its own first token. A child forks while a
        slot is free (max_num_seqs) and a block is left for the copy of each child forked
        so far and for parent's own next token (those the family's next decode step
        takes, so forking preempts nobody); otherwise it joins the head of the waiting
        queue as its own request (it arrived with parent, before anyone queued there).
        """
        children = self.awaiting_fork.pop(parent.request_id, None)
        if children is None:
            return
        self.num_awaiting_fork -= len(children)
        if self.retired:  # their slots and blocks are free to take
            self.release_retired()
        bm = self.block_manager
        num_tokens = parent.num_prompt_tokens - 1
        queued = []
        num_forked = 0
        for child in children:
            if (
                len(self.running) < self.config.max_num_seqs
                and bm.free_slots
                and bm.num_free_blocks >= num_forked + 2
            ):
                bm.fork(parent, child, num_tokens)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                num_forked += 1
            else:
                queued.append(child)
        for child in reversed(queued):
            self.waiting.appendleft(child)
            self._queued(child)

    def _queued(self, seq: Sequence) -> None:
        """Count a sequence that joined the waiting queue."""
        self.num_waiting_tokens += len(seq)
        bm = self.block_manager
        num_blocks = bm.blocks_needed(len(seq))
        hashes: list[int] = []
        if bm.enable_prefix_caching:
            # A preempted sequence's newest token may still be on the device.
            hashes = seq.full_block_hashes(
                bm.block_size, len(seq) - (seq.token_ids[-1] == PLACEHOLDER)
            )
            num_blocks -= charge_queued(
                hashes, len(seq), bm.block_size, bm.hash_to_block, self._queued_hash_refs
            )
        seq.num_queued_blocks = num_blocks
        seq.num_queued_hashes = len(hashes)
        self.num_waiting_blocks += num_blocks

    def _unqueued(self, seq: Sequence) -> None:
        """Uncount a sequence that left the waiting queue (admitted or finished)."""
        self.num_waiting_tokens -= len(seq)
        self.num_waiting_blocks -= seq.num_queued_blocks
        release_queued(seq.block_hashes[: seq.num_queued_hashes], self._queued_hash_refs)
        seq.num_queued_blocks = seq.num_queued_hashes = 0

    def check_invariants(self) -> None:
        """Assert the running counts of the waiting queue (tokens, charged blocks, queued
        hashes) equal what the queue holds, and num_retired_blocks is at most what the
        retired sequences' release frees (tests call this, via LLMEngine)."""
        waiting = self.waiting
        num_tokens = sum(len(s) for s in waiting)
        assert self.num_waiting_tokens == num_tokens, (
            f"num_waiting_tokens {self.num_waiting_tokens} != {num_tokens} tokens in the queue"
        )
        assert self.num_waiting_blocks == sum(s.num_queued_blocks for s in waiting), (
            f"num_waiting_blocks {self.num_waiting_blocks} != the queue's charges"
        )
        refs: dict[int, int] = {}
        for s in waiting:
            for h in s.block_hashes[: s.num_queued_hashes]:
                refs[h] = refs.get(h, 0) + 1
        assert refs == self._queued_hash_refs, "queued hash counts disagree with the queue"
        assert len(self._retired_sole) == len(self.retired)
        assert self.num_retired_blocks == sum(self._retired_sole)
        holders: dict[int, int] = {}  # block -> retired sequences holding it
        for s in self.retired:
            for b in s.block_ids:
                holders[b] = holders.get(b, 0) + 1
        ref_counts = self.block_manager.ref_counts
        freed = sum(1 for b, n in holders.items() if ref_counts[b] == n)
        assert self.num_retired_blocks <= freed, (
            f"num_retired_blocks {self.num_retired_blocks} > {freed} blocks their release frees"
        )
        self._check_awaiting_fork()

    def _check_awaiting_fork(self) -> None:
        """Each awaiting sample waits, holding nothing, on a live sample 0 whose prompt
        is not yet computed."""
        assert self.num_awaiting_fork == sum(map(len, self.awaiting_fork.values()))
        if not self.awaiting_fork:
            return
        parents = {s.request_id: s for s in [*self.waiting, *self.running]}
        queued = set(map(id, self.waiting)) | set(map(id, self.running))
        for request_id, children in self.awaiting_fork.items():
            parent = parents.get(request_id)
            assert parent is not None, f"samples await {request_id!r}, which is not in flight"
            assert parent.num_computed_tokens < parent.num_prompt_tokens, (
                f"{parent} computed its prompt, yet samples still await it"
            )
            for child in children:
                assert child.status is SequenceStatus.WAITING and id(child) not in queued
                assert child.slot < 0 and not child.block_ids, f"{child} holds blocks"

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_awaiting_fork

    def schedule(self) -> ScheduledBatch:
        if self.retired and self.waiting:  # admission may need their slots and blocks
            self.release_retired()
        batch = ScheduledBatch()
        batch.decode_seqs = self._schedule_decodes()
        budget = self.config.max_num_batched_tokens - len(batch.decode_seqs)
        budget = self._continue_prefills(batch, budget)
        self._admit_waiting(batch, budget)
        batch.block_copies = self.block_manager.take_copies()
        # Sequences whose chunk stops short of their last two tokens stay in prefill.
        done = set(map(id, batch.prefill_seqs))
        self.prefilling = [s for s in self.prefilling if id(s) not in done] + [
            s
            for s, n in zip(batch.prefill_seqs, batch.prefill_lens, strict=True)
            if s.num_computed_tokens + n < len(s.token_ids) - 1
        ]
        return batch

    def _schedule_decodes(self) -> list[Sequence]:
        bm = self.block_manager
        # A sequence whose last allowed token is still in flight needs no decode step.
        if self.prefilling:
            prefilling = set(map(id, self.prefilling))
            decodes = [
                s for s in self.running if id(s) not in prefilling and len(s.token_ids) < s.max_len
            ]
        else:
            decodes = [s for s in self.running if len(s.token_ids) < s.max_len]
        needing = bm.needing_blocks(decodes)  # most steps: none, or the rollovers
        while decodes and len(needing) > bm.num_free_blocks:
            if self.retired:  # before anyone is preempted
                self.release_retired()
                needing = bm.needing_blocks(decodes)
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim in decodes:
                decodes.remove(victim)
            needing = bm.needing_blocks(decodes)
        bm.append_slots(needing)
        return decodes

    def _continue_prefills(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunk = min(len(seq) - seq.num_computed_tokens, budget)
            batch.prefill_seqs.append(seq)
            batch.prefill_lens.append(chunk)
            budget -= chunk
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        in_progress = self._hashes_in_progress()
        i = 0  # waiting[:i] wait for a prefix that running sequences are computing
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq.token_ids[-1] == PLACEHOLDER:
                break  # a preempted sequence waits for its in-flight token to come back
            if in_progress and bm.first_uncached_hash(seq) in in_progress:
                i += 1
                continue
            if not bm.can_allocate(seq):
                break  # first come, first served: later arrivals do not overtake
            del self.waiting[i]
            self._unqueued(seq)
            bm.allocate(seq)
            if bm.enable_prefix_caching:
                in_progress.update(bm.uncommitted_hashes(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = min(len(seq) - seq.num_computed_tokens, budget)
            batch.prefill_seqs.append(seq)
            batch.prefill_lens.append(chunk)
            budget -= chunk

    def _hashes_in_progress(self) -> set[int]:
        """Hashes of blocks that prefilling sequences compute in this step or later."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or not self.waiting:
            return set()
        return {h for seq in self.prefilling for h in bm.uncommitted_hashes(seq)}

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed later from its tokens."""
        self.running.remove(seq)
        self._drop_prefilling(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self._queued(seq)
        self.num_preempted_total += 1

    def finish(self, seq: Sequence, reason: str, defer_release: bool = False) -> None:
        """Retire a sequence (finished or aborted) and release its blocks.

        defer_release: a running sequence leaves the batch now, but keeps its blocks and
        slot in `retired` until release_retired. The engine defers a sequence that ends
        on a sampled token: when a cohort of requests ends on one step, releasing ~16
        blocks each there is host work the device waits for.

        A sample awaiting its fork leaves awaiting_fork. Samples still awaiting a sequence
        that finishes are queued as their own requests (the engine ends them first when it
        ends the whole request): none is left waiting for a fork that never comes.
        """
        if self.awaiting_fork:
            self._orphan_samples(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._drop_prefilling(seq)
            if defer_release:
                refs = self.block_manager.ref_counts
                sole = list(map(refs.__getitem__, seq.block_ids)).count(1)
                self.retired.append(seq)
                self._retired_sole.append(sole)
                self.num_retired_blocks += sole
            else:
                self._release(seq)
        elif seq.status is SequenceStatus.WAITING and not self._drop_awaiting(seq):
            self.waiting.remove(seq)
            self._unqueued(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _orphan_samples(self, seq: Sequence) -> None:
        """Queue the samples awaiting seq, which finishes, as their own requests."""
        children = self.awaiting_fork.pop(seq.request_id, None)  # ids are unique in flight
        if children is not None:
            self.num_awaiting_fork -= len(children)
            for child in reversed(children):
                self.waiting.appendleft(child)
                self._queued(child)

    def _drop_awaiting(self, seq: Sequence) -> bool:
        """Remove a sample from awaiting_fork; False if it is not there."""
        for parent_id, children in self.awaiting_fork.items():
            if any(c is seq for c in children):
                children.remove(seq)
                self.num_awaiting_fork -= 1
                if not children:
                    del self.awaiting_fork[parent_id]
                return True
        return False

    def release_retired(self, limit: int | None = None) -> None:
        """Release the blocks and slots of up to limit retired sequences (all if None),
        oldest first; their hashed blocks stay cached, as finish leaves them."""
        retired, sole = self.retired, self._retired_sole
        for _ in range(len(retired) if limit is None else min(limit, len(retired))):
            self._release(retired.popleft())
            self.num_retired_blocks -= sole.popleft()

    def _release(self, seq: Sequence) -> None:
        """Hash what the sequence computed (so it stays cached), then free its blocks and slot."""
        self.block_manager.commit(seq)
        self.block_manager.free(seq)

    def _drop_prefilling(self, seq: Sequence) -> None:
        if self.prefilling:
            self.prefilling = [s for s in self.prefilling if s is not seq]
