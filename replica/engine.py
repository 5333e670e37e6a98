"""LLMEngine: one replica's serving loop — schedule, run, postprocess."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from replica.block_manager import BlockManager
from replica.config import CacheConfig, EngineConfig, SchedulerConfig
from replica.detokenizer import TextStream
from replica.hashing import root_hash
from replica.in_flight import InFlightStep
from replica.models import load_model_config, load_tokenizer
from replica.outputs import CompletionOutput, Logprobs, StepOutputs
from replica.runner.model_runner import ModelRunner
from replica.sampling_params import SamplingParams, sample_request_id
from replica.scheduler import ScheduledBatch, Scheduler
from replica.sequence import PLACEHOLDER, Sequence, SequenceStatus
from replica.stats import SLOT_FORECAST_LEN, ReplicaStats


@dataclass(frozen=True)
class StepTimings:
    """Host-side phases of the last step(), for benchmarks (seconds)."""

    schedule_s: float
    launch_s: float  # input preparation and kernel launches (graph replay)
    wait_s: float  # waiting for the previous step's tokens from the device
    drain_s: float  # placeholders, stop checks, outputs
    num_prefill_tokens: int
    num_decode_seqs: int
    num_table_rows: int  # block-table rows that changed (block rollovers, admissions, frees)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TOKENS_PER_S_WINDOW_S = 2.0
# The recent ends a slot forecast (ReplicaStats.slot_free_steps) is judged on, how many
# it needs, and the share of them max_tokens must have made: outputs that end on a stop
# token free their slots when they do, which max_tokens does not tell (it would read a
# slot as held for the whole budget, and admission would refuse a request that a slot
# about to free could take).
_ENDS_WINDOW = 64
_MIN_ENDS = 16
_MIN_LENGTH_ENDS = 0.9


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample index's params of a request with n > 1: n=1, a seeded one seed + index."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """auto: float32 on CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


class LLMEngine:
    """Continuous-batching engine for one device.

    Use generate() for blocking batch inference, or add_request / step / abort
    to drive it from a serving loop: each step() returns the new tokens of
    every request that advanced (StepOutputs: RequestOutput deltas, one per request,
    with their columns).

    emulate_graphs_on_cpu (tests only): a CPU engine takes the CUDA graph path, its graphs
    emulated (replica.runner.eager_graph), so CI covers that path's host side.
    """

    def __init__(self, config: EngineConfig, emulate_graphs_on_cpu: bool = False) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = load_model_config(config.model)
        mc = self.model_config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's "
                f"{mc.max_position_embeddings} positions"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.dtype = resolve_dtype(config.dtype, self.device, mc.torch_dtype)
        self.runner = ModelRunner(
            config, mc, self.device, self.dtype, self.max_model_len, emulate_graphs_on_cpu
        )
        num_blocks = config.num_blocks or self.runner.num_blocks_from_memory()
        self.runner.allocate_kv_cache(num_blocks)
        self.cache_config = CacheConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            max_blocks_per_seq=self.runner.max_blocks_per_seq,
        )
        self.block_manager = BlockManager(self.cache_config, config.max_num_seqs)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            ),
            self.block_manager,
        )
        self.tokenizer = load_tokenizer(config.model)
        self.requests: dict[str, Sequence] = {}
        # Requests with n > 1: sample 0's request id -> the n samples, until all have ended.
        self.families: dict[str, list[Sequence]] = {}
        self.in_flight: InFlightStep | None = None
        self.last_step: StepTimings | None = None
        self._token_events: deque[tuple[float, int]] = deque()  # (time_s, tokens) per step
        self.clock = time.monotonic  # of the tokens_per_s window; tests inject their own
        self._num_window_tokens = 0  # sum of _token_events' tokens, kept as they come and go
        self._length_ends: deque[bool] = deque(maxlen=_ENDS_WINDOW)  # ended by max_tokens?
        # Steps whose prompt tokens filled the token budget: (drained at, duration, prompt
        # tokens), and their sums over the window, the engine's prefill rate when prompts
        # are what it is short of (ReplicaStats.prefill_tokens_per_s).
        self._prefill_events: deque[tuple[float, float, int]] = deque()
        self._prefill_window = [0.0, 0]
        self._last_drain_s: float | None = None
        self._next_id = 0
        # Decode blocks that filled up, hashed a few per step (_commit_filled_blocks).
        self._filled: deque[Sequence] = deque()
        # Each running sequence fills at most one block per block_size steps, so this
        # budget keeps up with any batch (and works off a backlog by one a step) while
        # spreading a batch-wide rollover evenly over the steps until the next one.
        self._commits_per_step = -(-config.max_num_seqs // config.block_size) + 1
        # Sequences that ended on a sampled token keep their blocks until drain releases
        # them, this many a step (Scheduler.finish's defer_release): a cohort of 64 ending
        # together at 256 rows is spread over four steps' host slack instead of one
        # step's ~1 ms (its blocks are released at once when admission or preemption needs them).
        self._releases_per_step = -(-config.max_num_seqs // 16)
        self.num_ends = 0  # sequences finished or aborted so far (InFlightStep.num_ends)
        self._last_launch: InFlightStep | None = None
        # Start-up objects (model, graphs, tokenizer) go to the collector's permanent
        # generation, so its full passes during serving do not walk them (ITL spikes).
        gc.freeze()

    # ---- requests -------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams
    ) -> None:
        """Queue a request. Invalid input raises ValueError naming the field.

        params.n > 1 queues n samples, all or nothing: sample i's request id is
        sample_request_id(request_id, i) (sample 0 keeps request_id), its params n=1 and,
        when seeded, seed (seed + i) % 2**63, so each sample is the one an n=1 request
        with that seed gives. Sample 0 prefills the prompt; the others fork from its
        blocks when its last prompt chunk is launched (Scheduler.fork_samples).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = [sample_request_id(request_id, i) for i in range(params.n)]
        for i in ids:
            if i in self.requests:
                raise ValueError(f"request_id {i!r} is already in flight")
        prompt = self._validate_prompt(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by token id
            raise ValueError(
                f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary"
                f" [0, {vocab})"
            )
        if params.max_tokens is None:  # the room left in the context
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(prompt))
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if self.block_manager.blocks_needed(total) > self.cache_config.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens needs {self.block_manager.blocks_needed(total)}"
                f" KV blocks, more than the replica's {self.cache_config.num_blocks}"
            )
        root = root_hash(self.config.prefix_salt, params.cache_salt)
        if params.n == 1:
            seq = Sequence(
                request_id, prompt, params, self.model_config.eos_token_id,
                max_model_len=self.max_model_len, root_hash=root,
            )  # fmt: skip
            self.requests[request_id] = seq
            self.scheduler.add(seq)
            return
        eos, max_len = self.model_config.eos_token_id, self.max_model_len
        family = [
            Sequence(
                sample_id,
                prompt,
                _sample_params(params, i),
                eos,
                max_model_len=max_len,
                root_hash=root,
            )
            for i, sample_id in enumerate(ids)
        ]
        for seq in family:
            seq.family = family
            self.requests[seq.request_id] = seq
        self.families[request_id] = family
        self.scheduler.add_samples(family)

    def _validate_prompt(self, prompt_token_ids: Seq[int]) -> list[int]:
        if isinstance(prompt_token_ids, str | bytes) or not hasattr(prompt_token_ids, "__len__"):
            raise ValueError("prompt_token_ids must be a list of token ids")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        # The common case in C-level passes (a 256 x 128-token burst validated token by token
        # in Python took ~10 ms of the host's time); anything else takes the loop below,
        # which names the first bad entry.
        valid = set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab
        for i, t in enumerate(() if valid else prompt):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt_token_ids[{i}] must be an integer, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(
                    f"prompt_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab})"
                )
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(prompt)} tokens leave no room under "
                f"max_model_len ({self.max_model_len})"
            )
        return prompt

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks now; False if it is not in flight.

        Of a request with n > 1, its request_id (sample 0's) drops every sample still in
        flight; a sample's own id (sample_request_id(request_id, i)) drops it alone.
        """
        members = self.families.pop(request_id, None)
        if members is None:
            return self._abort_one(request_id, None)
        # The awaiting samples before sample 0, which would queue them as orphans.
        return any([self._abort_one(s.request_id, s) for s in reversed(members)])

    def abort_sample(self, request_id: str) -> bool:
        """Drop one sequence alone, also sample 0 of a request with n > 1 (a stop string
        ended it; samples still awaiting its prompt then queue as their own requests);
        False if it is not in flight."""
        return self._abort_one(request_id, None)

    def _abort_one(self, request_id: str, expected: Sequence | None) -> bool:
        """Drop one sequence (expected: only if it is still the one in flight there)."""
        seq = self.requests.get(request_id)
        if seq is None or (expected is not None and seq is not expected):
            return False
        del self.requests[request_id]
        self.num_ends += 1
        self.scheduler.finish(seq, "abort")
        self.runner.release(request_id)
        if seq.family is not None:
            self._forget_family(seq.family)
        return True

    def _forget_family(self, family: list[Sequence]) -> None:
        """Drop a request's entry in families once all its samples have ended."""
        if all(s.is_finished for s in family) and self.families.get(family[0].request_id) is family:
            del self.families[family[0].request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def device_busy(self) -> bool:
        """Whether the device is still running the step in flight: the host's time until
        the next step() waits is free (cluster.engine_loop runs posted commands in it)."""
        return self.in_flight is not None and self.in_flight.handle.running()

    # ---- the loop -------------------------------------------------------------
    def step(self) -> StepOutputs:
        """Schedule and launch the next step, then collect the one before it.

        The device runs step N while the host schedules N + 1 and turns N - 1's
        tokens into outputs. A request that stops on a sampled stop token is
        seen one step late; that step's token for it is discarded.
        """
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = self.launch(batch)
        t2 = time.perf_counter()
        if self.in_flight is not None:
            self.in_flight.handle.wait()
        t3 = time.perf_counter()
        outputs = self.drain()
        t4 = time.perf_counter()
        self.in_flight = launched
        self.last_step = StepTimings(
            t1 - t0, t2 - t1, t3 - t2, t4 - t3, sum(batch.prefill_lens), len(batch.decode_seqs),
            launched.num_table_rows if launched else 0,
        )  # fmt: skip
        return outputs

    def launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Enqueue the batch on the device and advance the host-side bookkeeping."""
        if batch.is_empty:
            self._last_launch = None
            return None
        bm = self.block_manager
        dirty_slots = bm.take_dirty_slots()
        handle = self.runner.launch(batch, bm.block_table, dirty_slots)
        sampled: list[Sequence] = []
        for seq, n in zip(batch.prefill_seqs, batch.prefill_lens, strict=True):
            seq.num_computed_tokens += n
            bm.commit(seq)
            if seq.num_computed_tokens == len(seq.token_ids):
                sampled.append(seq)
        if self.scheduler.awaiting_fork:  # samples fork once sample 0's prompt is computed
            for seq in sampled:
                self.scheduler.fork_samples(seq)
        for seq in sampled:
            seq.token_ids.append(PLACEHOLDER)
        decode_seqs = batch.decode_seqs
        for seq in decode_seqs:
            seq.num_computed_tokens += 1
            seq.token_ids.append(PLACEHOLDER)
        last = None if sampled else self._last_launch  # a prompt that completes: new rows
        launched = InFlightStep.launched(
            sampled + decode_seqs if sampled else decode_seqs, handle, len(dirty_slots),
            self.num_ends, last,
        )  # fmt: skip
        launched.num_prefill_tokens = sum(batch.prefill_lens)
        budget = self.scheduler.config.max_num_batched_tokens
        launched.prefill_bound = launched.num_prefill_tokens + len(decode_seqs) >= budget
        self._last_launch = launched
        return launched

    def drain(self) -> StepOutputs:
        """Wait for the in-flight step's tokens; fill placeholders, stop, emit deltas.

        The checks run over the step's columns (replica.in_flight); Python visits each
        row once to write its token, and again only the rows that may stop (a stop
        token, several stop tokens, max_len) or whose block filled up.
        """
        step, self.in_flight = self.in_flight, None
        if step is None:
            return StepOutputs()
        tokens = step.handle.wait()
        live = step.write_tokens(tokens, all_live=self.num_ends == step.num_ends)
        may_stop, filled = step.rows_to_check(tokens, live, self.block_manager.block_size)
        ends: dict[int, tuple[str, int, int]] = {}
        for i in may_stop:
            seq, index, token = step.seqs[i], int(step.indices[i]), tokens[i]
            if token in seq.stop_ids:
                ends[i] = self._finish(seq, index, "stop")
            elif index + 1 >= seq.max_len:
                ends[i] = self._finish(seq, index, "length")
        for i in filled:
            if i not in ends:
                self._filled.append(step.seqs[i])  # the block ending here is now known
        self._commit_filled_blocks()
        # A few a step, also when nothing is left running: releasing a whole cohort here
        # held back its last tokens (~3 ms for 256 sequences on an H200's host). An idle
        # engine's retired sequences go with its next full stats() snapshot (cluster.
        # engine_loop takes one every stats_period_s) or its next admission.
        self.scheduler.release_retired(self._releases_per_step)
        now_s = self.clock()
        self._token_events.append((now_s, len(tokens)))
        self._num_window_tokens += len(tokens)
        if step.prefill_bound and self._last_drain_s is not None:
            duration_s = now_s - self._last_drain_s  # this step's, while steps run back to back
            self._prefill_events.append((now_s, duration_s, step.num_prefill_tokens))
            self._prefill_window[0] += duration_s
            self._prefill_window[1] += step.num_prefill_tokens
        self._last_drain_s = now_s
        return step.outputs(tokens, ends, live, *step.handle.logprobs())

    def _commit_filled_blocks(self) -> None:
        """Register the hashes of decode blocks that filled up, at most _commits_per_step
        sequences a step, oldest first.

        When a batch decodes in lockstep every sequence fills a block on the same step;
        hashing them all there (a few us each) made that step's host work outlast the
        device's and left the GPU idle. A sequence that finishes or is preempted first
        commits in Scheduler.finish / preempt; commit is idempotent, so a stale entry
        costs one check. Until its turn, a block is reusable by nobody, as before it filled.
        """
        filled, bm = self._filled, self.block_manager
        for _ in range(min(len(filled), self._commits_per_step)):
            seq = filled.popleft()
            if seq.status is SequenceStatus.RUNNING:
                bm.commit(seq)

    def _finish(self, seq: Sequence, index: int, reason: str) -> tuple[str, int, int]:
        """End a sequence on its token at index; its StepOutputs.finishes entry."""
        del seq.token_ids[index + 1 :]  # a placeholder launched after the stop
        seq.num_computed_tokens = min(seq.num_computed_tokens, index)
        self.num_ends += 1
        self._length_ends.append(reason == "length")
        self.scheduler.finish(seq, reason, defer_release=True)
        del self.requests[seq.request_id]
        self.runner.release(seq.request_id)
        if seq.family is not None:
            self._forget_family(seq.family)
        return reason, seq.num_prompt_tokens, seq.num_cached_tokens

    # ---- offline --------------------------------------------------------------
    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Run prompts to completion; outputs in prompt order.

        A prompt whose params have n > 1 gives n outputs, in sample order (request ids
        sample_request_id(its request id, i)), after the earlier prompts' outputs and
        before the later ones' (as OpenAI indexes choices: prompt index * n + i).

        All or nothing: a bad prompt or params raises ValueError naming prompts[i] and
        the field, with none of the prompts left queued. The engine must be idle: the
        steps would hand requests added with add_request their outputs here, where
        they would be lost, so generate refuses to run beside them (RuntimeError).
        """
        if self.requests:
            raise RuntimeError(
                f"generate needs an idle engine: {len(self.requests)} requests added with"
                " add_request are in flight, and their outputs would be lost here; finish"
                " them with step() (or abort them) first"
            )
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or one for all")
        if self.tokenizer is None and any(p.stop for p in per_prompt):
            raise ValueError("stop: stop strings need a model with a tokenizer")
        ids = []
        samples = []  # (request id, prompt, params) of each output, in order
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                request_id = f"gen-{self._next_id}"
                self._next_id += 1
                self.add_request(request_id, prompt, p)
                ids.append(request_id)
                samples += [(sample_request_id(request_id, k), prompt, p) for k in range(p.n)]
        except ValueError as e:
            for request_id in ids:
                self.abort(request_id)
            raise ValueError(f"prompts[{len(ids)}]: {e}") from None
        tokens: dict[str, list[int]] = {i: [] for i, _, _ in samples}
        finals: dict[str, tuple[str, int, int]] = {}  # (reason, prompt tokens, cached tokens)
        logprobs: dict[str, list[Logprobs]] = {}  # of the requests that ask them
        prompt_logprobs: dict[str, list[Logprobs | None]] = {}
        texts = {  # stop strings are matched on the detokenized text
            i: TextStream(self.tokenizer, prompt, p.stop) for i, prompt, p in samples if p.stop
        }
        while len(finals) < len(samples):
            outs = self.step()
            stopped = []
            for request_id, token in zip(outs.request_ids, outs.token_ids, strict=True):
                if request_id in finals:  # ended on a stop string
                    continue
                tokens[request_id].append(token)
                text = texts.get(request_id)
                if text is not None and text.add([token]).stopped:
                    stopped.append(request_id)
            for i, lp in outs.logprobs.items():  # a row skipped above skips its logprobs
                if outs.request_ids[i] not in finals:
                    logprobs.setdefault(outs.request_ids[i], []).append(lp)
            for i, entries in outs.prompt_logprobs.items():
                prompt_logprobs[outs.request_ids[i]] = entries
            for i, end in outs.finishes.items():
                finals.setdefault(outs.request_ids[i], end)
            for request_id in stopped:
                seq = self.requests.get(request_id)
                if seq is None:  # its last token both ended it and completed the stop string
                    finals[request_id] = ("stop", *finals[request_id][1:])
                else:
                    finals[request_id] = ("stop", seq.num_prompt_tokens, seq.num_cached_tokens)
                    self.abort_sample(request_id)
        lps, plps = logprobs.get, prompt_logprobs.get
        return [
            CompletionOutput(i, list(p), tokens[i], finals[i][0], finals[i][2], lps(i), plps(i))
            for i, p, _ in samples
        ]

    # ---- stats ----------------------------------------------------------------
    def stats(self, with_hashes: bool = True) -> ReplicaStats:
        """The replica's snapshot; with_hashes=False leaves out cached_prefix_hashes (the
        walk over up to max_prefix_hashes_in_stats blocks) for a load-only snapshot.

        Either shows the blocks as the next request would find them: the scheduler
        releases retired sequences' blocks before it admits anyone, so both count the
        blocks they alone hold as free. While sequences run, retired ones are left to
        drain, a few a step: releasing a finishing cohort's blocks at once is what
        deferring spares, and a snapshot (the load-only one every few ms and on each step
        that ends requests, the full one every stats_period_s: cluster.engine_loop)
        landing on such a step undid it. The full snapshot of an idle engine releases
        them all, which commits the hashes of their last blocks, so that it publishes
        them; while sequences run, those wait for a later snapshot.
        """
        if with_hashes and not self.scheduler.running:
            self.scheduler.release_retired()
        retiring = self.scheduler.num_retired_blocks  # 0 once released
        bm = self.block_manager
        now = self.clock()
        events = self._token_events
        while events and events[0][0] < now - _TOKENS_PER_S_WINDOW_S:
            self._num_window_tokens -= events.popleft()[1]
        # A running total: the engine thread takes a load snapshot every few ms
        # (cluster.deployment), and the window holds one event per step of the last 2 s.
        tokens_per_s = self._num_window_tokens / _TOKENS_PER_S_WINDOW_S
        prefill = self._prefill_events
        while prefill and prefill[0][0] < now - _TOKENS_PER_S_WINDOW_S:
            _, duration_s, num_tokens = prefill.popleft()
            self._prefill_window[0] -= duration_s
            self._prefill_window[1] -= num_tokens
        if not prefill:
            self._prefill_window = [0.0, 0]  # no float drift left over from the sums
        prefill_s, num_prefill_tokens = self._prefill_window
        waiting = self.scheduler.waiting
        num_waiting = len(waiting) + self.scheduler.num_awaiting_fork
        slot_free_steps, step_s = self._slot_forecast(num_waiting)
        return ReplicaStats(
            replica_id=self.config.replica_id,
            num_blocks_total=bm.num_blocks,
            num_blocks_free=len(bm.free_blocks) + retiring,
            num_blocks_cached=bm.num_cached_blocks,
            kv_usage=(bm.num_used_blocks - retiring) / bm.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=num_waiting,
            num_preempted_total=self.scheduler.num_preempted_total,
            max_num_seqs=self.config.max_num_seqs,
            tokens_per_s=tokens_per_s,
            block_size=bm.block_size,
            num_waiting_tokens=self.scheduler.num_waiting_tokens,  # kept, not summed per call
            num_waiting_blocks=self.scheduler.num_waiting_blocks,
            prefix_query_tokens=bm.prefix_query_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            cached_prefix_hashes=(
                tuple(bm.recent_hashes(self.config.max_prefix_hashes_in_stats))
                if with_hashes
                else ()
            ),
            timestamp_s=time.time(),
            slot_free_steps=slot_free_steps,
            step_s=step_s,
            prefill_tokens_per_s=num_prefill_tokens / prefill_s if prefill_s > 0 else 0.0,
        )

    def _slot_forecast(self, num_waiting: int) -> tuple[tuple[int, ...], float]:
        """ReplicaStats.slot_free_steps and step_s: the running sequences' steps to their
        max_tokens, while every slot is taken or queued for and max_tokens has ended most
        recent outputs; else ((), 0.0). In the load snapshots taken every 2 ms."""
        running = self.scheduler.running
        if len(running) + num_waiting < self.config.max_num_seqs:
            return (), 0.0
        ends, events = self._length_ends, self._token_events
        if len(ends) < _MIN_ENDS or sum(ends) < _MIN_LENGTH_ENDS * len(ends) or len(events) < 2:
            return (), 0.0
        step_s = (events[-1][0] - events[0][0]) / (len(events) - 1)
        launch = self._last_launch
        if (
            launch is not None
            and launch.num_ends == self.num_ends
            and len(launch.seqs) == len(running)
        ):
            # Every running sequence samples in the step launched last (none ended since,
            # and as many: a full decode batch): its columns say the same in numpy, 9 us
            # against 63 at 256 rows (CPU box).
            ends = np.sort(launch.max_lens - launch.indices - 1)[:SLOT_FORECAST_LEN]
            return tuple(np.maximum(ends, 0).tolist()), step_s
        steps = sorted(max(0, seq.max_len - len(seq.token_ids)) for seq in running)
        return tuple(steps[:SLOT_FORECAST_LEN]), step_s

    def check_invariants(self) -> None:
        """Assert the block manager agrees with the live sequences, and the scheduler's
        running counts with its queue (tests call this)."""
        self.block_manager.check_invariants(self.scheduler.running + list(self.scheduler.retired))
        self.scheduler.check_invariants()
