"""One simulated replica: continuous batching over a prefix-cached KV block pool.

Mirrors replica/scheduler.py's step: (1) decode every running sequence whose
prefill is done, preempting the most recently admitted running sequence while
the step's new blocks do not fit; (2) continue chunked prefills; (3) admit
waiting sequences first-come-first-served while a slot, blocks for the whole
prompt and token budget remain. A preempted sequence goes back to the head of
the queue and is recomputed from its tokens (prompt + what it generated), its
full blocks left in the prefix cache.

Per-step cost is O(1) plus O(sequences that start, finish or move): decoding
sequences are aggregate counters (count, summed context, blocks they will need
per step phase) and a heap of finish steps; no per-token loop.

Block pool: num_free blocks hold nothing; `cached` (LRU, refcount 0) hold a
reusable hash and are evicted on demand; `resident` maps every hashed block
(in use or cached) to its refcount, in order of last use, for the stats summary.
Invariant: num_free + len(cached) + blocks held by sequences == num_blocks_total.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from bench.sim_model import CostModel
from bench.sim_workload import Workload
from replica.hashing import summarize
from replica.scheduler import charge_queued, release_queued
from replica.stats import SLOT_FORECAST_LEN, ReplicaStats


@dataclass(frozen=True)
class ReplicaSimConfig:
    num_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_prefix_hashes_in_stats: int = 2048

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class SimSeq:
    __slots__ = (
        "rid", "prompt_len", "out_left", "computed", "held_hashes", "join_step", "epoch",
        "num_hit_tokens", "queued_hashes", "num_queued_blocks", "num_committed",
    )  # fmt: skip

    def __init__(self, rid: int, prompt_len: int, out_left: int) -> None:
        self.rid = rid
        self.prompt_len = prompt_len  # tokens to (re)compute from: prompt + generated so far
        self.out_left = out_left  # tokens still to generate
        self.computed = 0
        self.held_hashes: list[int] = []
        self.join_step = -1  # step whose end produced the first token; -1: not decoding
        self.epoch = 0  # bumped on preemption, invalidating finish-heap entries
        self.num_hit_tokens = 0
        self.queued_hashes: list[int] = []  # while waiting, as replica.Scheduler charges it
        self.num_queued_blocks = 0
        self.num_committed = 0  # leading prompt blocks computed (BlockManager.commit's count)


class SimReplica:
    """See the module docstring. Results go to the shared first_token_s / finish_s lists."""

    def __init__(
        self,
        index: int,
        config: ReplicaSimConfig,
        cost: CostModel,
        workload: Workload,
        first_token_s: list[float],
        finish_s: list[float],
    ) -> None:
        self.index = index
        self.replica_id = f"replica-{index}"
        self.config = config
        self.cost = cost
        self.workload = workload
        self.first_token_s = first_token_s
        self.finish_s = finish_s
        self.block_size = config.block_size
        self.num_free = config.num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.resident: dict[int, int] = {}
        self.waiting: deque[SimSeq] = deque()
        self.num_waiting_tokens = 0
        self.num_waiting_blocks = 0  # as replica.Scheduler.num_waiting_blocks
        self.queued_hash_refs: dict[int, int] = {}
        self.running: dict[SimSeq, None] = {}  # admission order
        self.prefilling: list[SimSeq] = []
        self.num_decode = 0
        self.context_tokens = 0  # KV length summed over decoding seqs, as of the next step
        self.phase_counts = [0] * config.block_size  # decoders needing a block at step % bs
        self.finish_heap: list[tuple[int, int, int, SimSeq]] = []
        self.step_no = 0
        self.busy = False
        self.batch: list[tuple[SimSeq, int]] = []
        self.finished: list[int] = []  # rids finished in the last completed step
        self.first_tokens: list[int] = []  # rids that got a first token in the last step
        # counters
        self.num_preempted_total = 0
        self.tokens_out = 0
        self.num_prompt_tokens = 0
        self.num_hit_tokens = 0
        self.num_steps = 0
        self.busy_s = 0.0
        self.tokens_at_publish = 0
        self.published_at_s = 0.0
        self.step_s = 0.0  # the recent mean step time (an average over ~20 steps)
        self.prefill_tokens_per_s = 0.0

    # ---- requests --------------------------------------------------------------
    def add(self, rid: int) -> None:
        wl = self.workload
        seq = SimSeq(rid, wl.prompt_len_list[rid], wl.output_len_list[rid])
        self.waiting.append(seq)
        self._queued(seq)

    def _queued(self, seq: SimSeq) -> None:
        """replica.Scheduler._queued: charge the blocks the queued prompt will newly take."""
        self.num_waiting_tokens += seq.prompt_len
        bs = self.block_size
        num_blocks = -(-seq.prompt_len // bs)
        if self.config.enable_prefix_caching:
            seq.queued_hashes = self.workload.block_hashes(seq.rid, seq.prompt_len // bs)
            num_blocks -= charge_queued(
                seq.queued_hashes, seq.prompt_len, bs, self.resident, self.queued_hash_refs
            )
        seq.num_queued_blocks = num_blocks
        self.num_waiting_blocks += num_blocks

    def _unqueued(self, seq: SimSeq) -> None:
        self.num_waiting_tokens -= seq.prompt_len
        self.num_waiting_blocks -= seq.num_queued_blocks
        release_queued(seq.queued_hashes, self.queued_hash_refs)
        seq.queued_hashes = []
        seq.num_queued_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        return self.config.num_blocks - self.num_free - len(self.cached)

    # ---- the step --------------------------------------------------------------
    def complete_step(self, now_s: float) -> None:
        """Account the step that just ended at now_s: tokens, finishes, prefill progress."""
        s = self.step_no
        self.finished.clear()
        self.first_tokens.clear()
        if self.num_decode:
            self.tokens_out += self.num_decode
            heap = self.finish_heap
            while heap and heap[0][0] == s:
                _, _, epoch, seq = heapq.heappop(heap)
                if epoch != seq.epoch:
                    continue
                self._stop_decoding(seq, s)
                seq.out_left = 0
                self._retire(seq, seq.prompt_len + s - seq.join_step, now_s)
            self.context_tokens += self.num_decode
        if self.batch:
            for seq, chunk in self.batch:
                seq.computed += chunk
                self._commit(seq)
                if seq.computed == seq.prompt_len:
                    self._finish_prefill(seq, s, now_s)
            self.batch = []

    def _finish_prefill(self, seq: SimSeq, s: int, now_s: float) -> None:
        self.prefilling.remove(seq)
        self.tokens_out += 1
        if self.first_token_s[seq.rid] < 0:
            self.first_token_s[seq.rid] = now_s
            self.first_tokens.append(seq.rid)
        seq.out_left -= 1
        if seq.out_left == 0:
            self._retire(seq, seq.prompt_len, now_s)
            return
        seq.join_step = s
        self.num_decode += 1
        self.context_tokens += seq.prompt_len + 1
        self.phase_counts[(s + 1 - seq.prompt_len) % self.block_size] += 1
        heapq.heappush(self.finish_heap, (s + seq.out_left, seq.rid, seq.epoch, seq))

    def _stop_decoding(self, seq: SimSeq, s: int) -> None:
        self.num_decode -= 1
        self.context_tokens -= seq.prompt_len + s - seq.join_step
        self.phase_counts[(seq.join_step + 1 - seq.prompt_len) % self.block_size] -= 1

    def schedule(self, now_s: float) -> float | None:
        """Build the next step; return its end time, or None (idle) when there is no work."""
        s = self.step_no + 1
        bs = self.block_size
        need = self.phase_counts[s % bs]
        while need and need > self.num_free + len(self.cached):
            self._preempt(next(reversed(self.running)))
            need = self.phase_counts[s % bs]
        self._take_blocks(need)
        budget = self.config.max_num_batched_tokens - self.num_decode
        batch = self.batch
        num_prefill = 0
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunk = min(seq.prompt_len - seq.computed, budget)
            batch.append((seq, chunk))
            budget -= chunk
            num_prefill += chunk
        max_num_seqs = self.config.max_num_seqs
        in_progress = self._hashes_in_progress()
        i = 0  # as replica.Scheduler: waiting[:i] wait for a prefix being computed
        while i < len(self.waiting) and budget > 0 and len(self.running) < max_num_seqs:
            seq = self.waiting[i]
            if in_progress and self._first_uncached_hash(seq) in in_progress:
                i += 1
                continue
            if not self._allocate(seq):
                break
            del self.waiting[i]
            if in_progress is not None:
                in_progress.update(self._uncomputed_hashes(seq))
            self._unqueued(seq)
            self.running[seq] = None
            self.prefilling.append(seq)
            chunk = min(seq.prompt_len - seq.computed, budget)
            batch.append((seq, chunk))
            budget -= chunk
            num_prefill += chunk
        if not self.num_decode and not batch:
            self.busy = False
            return None
        self.busy = True
        self.step_no = s
        self.num_steps += 1
        dt = self.cost.step_s(num_prefill, self.num_decode, self.context_tokens)
        self.busy_s += dt
        self.step_s = dt if not self.step_s else self.step_s + 0.05 * (dt - self.step_s)
        if budget <= 0 and num_prefill:
            rate = num_prefill / dt
            p = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if not p else p + 0.05 * (rate - p)
        return now_s + dt

    # ---- prefixes being computed -------------------------------------------------
    def _hashes_in_progress(self) -> set[int] | None:
        """Prompt-block hashes that prefilling sequences will register (None: caching off)."""
        if not self.config.enable_prefix_caching:
            return None
        if not self.waiting or not self.prefilling:
            return set()
        return {h for seq in self.prefilling for h in self._uncomputed_hashes(seq)}

    def _uncomputed_hashes(self, seq: SimSeq) -> list[int]:
        num_full = seq.prompt_len // self.block_size
        return self.workload.block_hashes(seq.rid, num_full)[seq.num_committed :]

    def _first_uncached_hash(self, seq: SimSeq) -> int | None:
        max_hits = (seq.prompt_len - 1) // self.block_size
        for h in self.workload.block_hashes(seq.rid, max_hits):
            if h not in self.resident:
                return h
        return None

    # ---- blocks ----------------------------------------------------------------
    def _take_blocks(self, n: int) -> None:
        from_free = min(n, self.num_free)
        self.num_free -= from_free
        for _ in range(n - from_free):
            h, _ = self.cached.popitem(last=False)
            del self.resident[h]

    def _allocate(self, seq: SimSeq) -> bool:
        """Blocks for the whole prompt, reusing its cached leading full blocks."""
        bs = self.block_size
        num_total = -(-seq.prompt_len // bs)
        hits: list[int] = []
        num_revived = 0
        if self.config.enable_prefix_caching:
            max_hits = (seq.prompt_len - 1) // bs  # at least one token is always computed
            resident = self.resident
            for h in self.workload.block_hashes(seq.rid, max_hits):
                refs = resident.get(h)
                if refs is None:
                    break
                hits.append(h)
                num_revived += refs == 0
        num_new = num_total - len(hits)
        if num_new > self.num_free + len(self.cached) - num_revived:
            return False
        resident, cached = self.resident, self.cached
        for h in hits:
            refs = resident.pop(h)
            if refs == 0:
                del cached[h]
            resident[h] = refs + 1  # re-insert: most recently used
        self._take_blocks(num_new)
        seq.held_hashes = hits
        seq.num_committed = len(hits)
        seq.computed = len(hits) * bs
        seq.num_hit_tokens = seq.computed
        self.num_prompt_tokens += seq.prompt_len
        self.num_hit_tokens += seq.computed
        return True

    def _commit(self, seq: SimSeq) -> None:
        """Full prompt blocks become shareable once a chunk has computed them, as
        BlockManager.commit registers them after each step (a duplicate stays private)."""
        num_full = seq.computed // self.block_size
        if not self.config.enable_prefix_caching or num_full <= seq.num_committed:
            return
        held = seq.held_hashes
        resident = self.resident
        for h in self.workload.block_hashes(seq.rid, num_full)[seq.num_committed :]:
            if h not in resident:
                resident[h] = 1
                held.append(h)
        seq.num_committed = num_full

    def _release(self, seq: SimSeq, kv_len: int) -> None:
        """Free the sequence's blocks; hashed and full generated blocks stay cached (LRU).

        A hashed block is one physical block however many sequences hold it, so
        only the sequence's private blocks (all but held_hashes) return to the pool.
        """
        num_private = -(-kv_len // self.block_size) - len(seq.held_hashes)
        resident, cached = self.resident, self.cached
        newly_cached = []  # in chain order; they enter the LRU tail first, as BlockManager.free
        for h in seq.held_hashes:
            refs = resident.pop(h) - 1
            resident[h] = refs
            if refs == 0:
                newly_cached.append(h)
        num_private_cached = 0
        start = len(seq.held_hashes)
        num_full = kv_len // self.block_size
        if (
            self.config.enable_prefix_caching
            and num_full > start
            and seq.prompt_len // self.block_size == start
        ):
            for h in self.workload.block_hashes(seq.rid, num_full)[start:]:
                if h not in resident:
                    resident[h] = 0
                    newly_cached.append(h)
                    num_private_cached += 1
        for h in reversed(newly_cached):
            cached[h] = None
        self.num_free += num_private - num_private_cached
        seq.held_hashes = []
        seq.num_committed = 0

    def _retire(self, seq: SimSeq, kv_len: int, now_s: float) -> None:
        del self.running[seq]
        self._release(seq, kv_len)
        self.finish_s[seq.rid] = now_s
        self.finished.append(seq.rid)

    def _preempt(self, seq: SimSeq) -> None:
        del self.running[seq]
        s = self.step_no
        if seq.join_step >= 0:
            self._stop_decoding(seq, s)
            kv_len = seq.prompt_len + s - seq.join_step
        else:
            self.prefilling.remove(seq)
            kv_len = seq.prompt_len
        # Released while prompt_len is still the prompt's: its full generated blocks stay
        # cached, as the Scheduler commits them before it frees a preempted sequence.
        self._release(seq, kv_len)
        if seq.join_step >= 0:
            seq.prompt_len = kv_len + 1  # recompute every token, including the newest
            seq.out_left -= s - seq.join_step
            seq.join_step = -1
            seq.epoch += 1
        seq.computed = 0
        self.waiting.appendleft(seq)
        self._queued(seq)
        self.num_preempted_total += 1

    # ---- stats -----------------------------------------------------------------
    def stats(self, now_s: float, with_hashes: bool) -> ReplicaStats:
        num_total = self.config.num_blocks
        elapsed = now_s - self.published_at_s
        tokens_per_s = (self.tokens_out - self.tokens_at_publish) / elapsed if elapsed > 0 else 0.0
        self.tokens_at_publish, self.published_at_s = self.tokens_out, now_s
        hashes = ()
        if with_hashes:
            hashes = tuple(
                summarize(
                    _chunks(reversed(self.resident)),
                    len(self.resident),
                    self.config.max_prefix_hashes_in_stats,
                )
            )
        return ReplicaStats(
            replica_id=self.replica_id,
            num_blocks_total=num_total,
            num_blocks_free=self.num_free,
            num_blocks_cached=len(self.cached),
            kv_usage=(num_total - self.num_free - len(self.cached)) / num_total,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_total=self.num_preempted_total,
            max_num_seqs=self.config.max_num_seqs,
            tokens_per_s=tokens_per_s,
            block_size=self.block_size,
            num_waiting_tokens=self.num_waiting_tokens,
            num_waiting_blocks=self.num_waiting_blocks,
            prefix_query_tokens=self.num_prompt_tokens,
            prefix_hit_tokens=self.num_hit_tokens,
            cached_prefix_hashes=hashes,
            timestamp_s=now_s,
            slot_free_steps=self._slot_free_steps(),
            step_s=self.step_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )

    def _slot_free_steps(self) -> tuple[int, ...]:
        """replica.LLMEngine's slot forecast. Every simulated output ends at its length
        (max_tokens), as the engine's forecast requires of most recent ones: decoding
        sequences end at their finish-heap step, prefilling ones after their output."""
        if len(self.running) + len(self.waiting) < self.config.max_num_seqs:
            return ()
        s = self.step_no
        ends = [step - s for step, _, epoch, seq in self.finish_heap if epoch == seq.epoch]
        ends += [seq.out_left for seq in self.prefilling]
        return tuple(sorted(ends)[:SLOT_FORECAST_LEN])

    def check_invariants(self) -> None:
        """free + cached + held == total, and hashed refcounts match the live sequences."""
        bs = self.block_size
        num_private = 0
        refs: dict[int, int] = {}
        for seq in self.running:
            kv_len = seq.prompt_len
            if seq.join_step >= 0:
                kv_len += self.step_no - seq.join_step
            num_private += -(-kv_len // bs) - len(seq.held_hashes)
            for h in seq.held_hashes:
                refs[h] = refs.get(h, 0) + 1
        num_shared = sum(1 for n in self.resident.values() if n > 0)
        assert self.num_free >= 0, self.num_free
        num_accounted = self.num_free + len(self.cached) + num_private + num_shared
        assert num_accounted == self.config.num_blocks, (
            self.num_free, len(self.cached), num_private, num_shared)  # fmt: skip
        for h, n in self.resident.items():
            assert n == refs.get(h, 0), (h, n, refs.get(h, 0))
            assert (n == 0) == (h in self.cached)
        assert len(self.cached) == sum(1 for n in self.resident.values() if n == 0)
        assert self.num_waiting_blocks == sum(q.num_queued_blocks for q in self.waiting)
        queued: dict[int, int] = {}
        for q in self.waiting:
            for h in q.queued_hashes:
                queued[h] = queued.get(h, 0) + 1
        assert queued == self.queued_hash_refs


def _chunks(hashes: Iterable[int], size: int = 1024) -> Iterator[np.ndarray]:
    """hashes in arrays of size, as replica.hashing.summarize reads them (object arrays:
    the simulator's hashes are any Python ints)."""
    it = iter(hashes)
    while chunk := list(islice(it, size)):
        yield np.array(chunk, dtype=object)
