"""Runs the model for a scheduled batch: the only place that builds device tensors.

Decode inputs live in persistent device buffers, filled by one packed
host-to-device copy per step that carries block-table rows too, only those whose
sequence's blocks changed (replica.runner.decode_inputs); the decode forward's first
kernel puts them in the table (kernels.block_table). On CUDA, decode runs
as a replay of a CUDA graph captured for the next bucketed batch size; padding
rows point at a null table row whose blocks are all the reserved null block.

Short prompt chunks ride in the decode step (mixed steps): when a step's prefill
tokens number at most mixed_prefill_tokens, each becomes one more query row of the
decode forward, with its own position and context length, instead of a separate
prefill forward before it. One pass over the weights serves both, so a request
that joins costs the running ones a few rows, not a whole forward (ITL). The
mixed graphs append every row's K/V before attention reads any (a row reads its
chunk's earlier tokens), where plain decode graphs fuse the append into attention.
The other way round, a step with longer prompt chunks runs its decode sequences as
one-token chunks of the prefill forward (EngineOptions.decode_in_prefill), so that step
too makes one pass over the weights, not a prefill forward and then a decode forward.
replica.runner.step_plan arranges a step so; replica.runner.forwards runs the forwards.

A decode step's sampled rows (temperature, top-p, top-k) sample in a second graph,
captured per graph size over the forward graph's logits and replayed after it; its
parameters (replica.runner.graph_sampling) ride in the step's one copy, in a region of
the decode inputs' buffers. Rows that sample outside a graph (without graphs, or in a
step whose prefill forward samples) go through replica.runner.sampling;
replica.runner.graphs captures the graphs. A step with rows that ask logprobs or
process their logits (Sequence.extras) runs as it would without them, then resamples
those rows alone on a side path (replica.runner.extras_path) before its tokens go to
the host.

Steps overlap with the host: launch() enqueues a step and returns at once with
a StepHandle (replica.runner.step_handle). Sampled tokens stay on the device too
(token_buf, one entry per table row), so the next step's decode reads a token the host
has not seen yet (a PLACEHOLDER on the host side) straight from token_buf. Host staging
buffers alternate between two copies by the step's parity, so a step's inputs are never
overwritten while its copies may still be pending.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from replica.config import EngineConfig
from replica.models import ModelConfig, load_model
from replica.runner import kv_cache
from replica.runner.decode_inputs import SLOTS, DecodeInputs
from replica.runner.extras_path import ExtrasPath
from replica.runner.forwards import Forwards, make_attention_backend
from replica.runner.graph_sampling import GraphSamplingInputs
from replica.runner.graphs import capture_forward_graphs, graph_batch_sizes, graphs_on, padded_size
from replica.runner.logits_processors import LogitsProcessors
from replica.runner.logprobs import PromptLogprobs, prompt_spans
from replica.runner.prefill_inputs import PrefillBucket, PrefillInputs
from replica.runner.sampling import StepSampler, all_greedy
from replica.runner.step_handle import StepHandle, TokenStaging
from replica.runner.step_plan import arrange, completes_any
from replica.runner.warm_up import warm_up
from replica.scheduler import ScheduledBatch
from replica.sequence import Sequence

_EXTRAS = operator.attrgetter("extras")


class ModelRunner:
    """The model, its KV cache, persistent inputs and graphs; launch() runs one step.

    emulate_graphs_on_cpu (tests only): a CPU runner takes the graph path, its graphs
    EagerGraphs (replica.runner.eager_graph), its sampling kernels.sampling's launches
    under the Triton interpreter.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        emulate_graphs_on_cpu: bool = False,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache.resolve_kv_cache_dtype(config.kv_cache_dtype, device, dtype)
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        options = config.options
        self.backend = make_attention_backend(device, options)
        self.model, self.model_config = load_model(
            config.model,
            dtype=dtype,
            device=device,
            seed=config.seed,
            backend=self.backend,
            triton_linear=config.enable_triton_linear,
            options=options,
        )
        self.vocab_size = self.model_config.vocab_size
        # On CUDA (or the CPU emulating it), eager decode pads to the same buckets as the
        # graphs, so that graphs on and off run identical shapes (cuBLAS tiling, split-KV
        # choice) and give identical tokens.
        graph_path = graphs_on(device, emulate_graphs_on_cpu)
        self.use_cuda_graphs = graph_path and config.enable_cuda_graphs
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if graph_path else []
        self.mixed_prefill_tokens = config.mixed_prefill_tokens
        # A step with prompt chunks beyond mixed_prefill_tokens runs its decode sequences in
        # the prefill forward (one token each) rather than in a decode forward after it.
        self.decode_in_prefill = options.decode_in_prefill
        self._init_buffers(graph_path)

    def _init_buffers(self, graph_path: bool) -> None:
        """The persistent inputs, the host staging, token_buf and the graphs' tables."""
        device, config = self.device, self.config
        max_rows = self.max_num_seqs + self.mixed_prefill_tokens
        self.mixed_graph_sizes = (
            graph_batch_sizes(max_rows) if self.graph_sizes and self.mixed_prefill_tokens else []
        )
        pin = device.type == "cuda"
        # A decode or mixed forward's sampled rows: a graph per graph size and kind of
        # sampling, replayed after the forward's; their parameters ride in the step's copy.
        graph_sizes = self.mixed_graph_sizes + self.graph_sizes
        sampling_rows = max(graph_sizes) if self.use_cuda_graphs else 0
        rows = self.max_num_seqs + 1  # the last row is the null row for padding
        self.block_table = torch.zeros(
            (rows, self.max_blocks_per_seq), dtype=torch.int32, device=device
        )
        # Host staging, two copies each (see the module docstring); parity picks one per step.
        self.step_inputs = DecodeInputs(
            self.max_num_seqs, self.max_blocks_per_seq, device, pin, max_rows,
            GraphSamplingInputs.buffer_length(sampling_rows) if sampling_rows else 0,
        )  # fmt: skip
        self.decode_inputs = self.step_inputs.inputs  # [5, max_rows] on the device
        self.token_staging = TokenStaging(self.max_num_seqs, device, self.use_cuda_graphs)
        self.parity = 0
        self._launched: list[StepHandle | None] = [None, None]  # each parity's last step
        self.token_buf = torch.zeros(rows, dtype=torch.int64, device=device)  # last token per slot
        # Sampling outside the graphs (replica.runner.sampling): kernels.sampling on CUDA,
        # torch ops on the CPU.
        self.sampler = StepSampler(device, self.vocab_size, config.seed, fused=graph_path)
        # Rows with logits processors or logprobs (replica.runner.logits_processors,
        # replica.runner.logprobs) resample on a side path after the step's fast path.
        self.processors = LogitsProcessors(
            self.max_num_seqs, self.vocab_size, device, fused=graph_path
        )
        self.prompt_logprobs = PromptLogprobs()
        self.extras_path = ExtrasPath(
            self.max_num_seqs, self.vocab_size, device, self.sampler, self.processors,
            self.prompt_logprobs,
        )  # fmt: skip
        self.graph_sampling: GraphSamplingInputs | None = None
        if sampling_rows:
            region = self.step_inputs
            self.graph_sampling = GraphSamplingInputs(
                sampling_rows, self.vocab_size, device, region.sampling, region.sampling_staging
            )
        # (mixed, size, kind): kind (top_k, top_p) one of replica.runner.graph_sampling.GRAPH_KINDS
        self.sampling_graphs: dict[tuple[bool, int, tuple], torch.cuda.CUDAGraph] = {}
        self.kv_cache: torch.Tensor | None = None
        # decode: (graph, (logits, greedy tokens)) per batch size; mixed steps have their own
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mixed_graphs: dict[int, tuple] = {}
        # Prefill pads to captured token buckets on CUDA whether graphs are on or off (same
        # shapes, same tokens); on the CPU it runs the exact shape.
        self.prefill = PrefillInputs(
            config.max_num_batched_tokens, self.max_num_seqs, self.model_config.num_heads,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.kv_cache_dtype,
            null_row=self.max_num_seqs, device=device, padded=graph_path,
        )  # fmt: skip
        self.prefill_graphs: dict[PrefillBucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.forwards = Forwards(
            self.model, device, config.options.pdl, self.block_table, self.token_buf,
            self.step_inputs, self.prefill, self.graph_sampling,
        )  # fmt: skip

    # ---- set-up ---------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_cache.kv_bytes_per_block(self.model_config, self.block_size, self.kv_cache_dtype)

    def num_blocks_from_memory(self) -> int:
        """KV blocks that fit in the memory budget, capped at what a full batch can use."""
        return kv_cache.num_blocks_from_memory(
            self.config, self.model_config, self.device, self.dtype, self.kv_cache_dtype,
            self.max_blocks_per_seq,
        )  # fmt: skip

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        self.null_block = num_blocks
        shape = (mc.num_layers, 2, num_blocks + 1, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.forwards.kv_cache = self.kv_cache
        self.block_table.fill_(self.null_block)
        self.step_inputs.fill_padding(self.parity)
        if self.use_cuda_graphs:
            self._capture_graphs()
        if self.device.type == "cuda":  # the CPU loads nothing lazily (gpt2 there: 1 s for nothing)
            self.warm_up()

    # ---- one step -------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, block_table: np.ndarray, dirty_slots: list[int]
    ) -> StepHandle:
        """Enqueue the batch; the handle yields one token per sampling sequence.

        Sampling sequences are, in order, the prefill sequences whose chunk
        reaches their last token, then every decode sequence. A decode
        sequence's last token may be a PLACEHOLDER: it is read from token_buf.

        The step before last must have been waited on: this step reuses its staging
        buffers, which its copies may still read on the device (checked here, on the CPU
        too, where every step is done within its launch and a race could not show).
        """
        self.parity ^= 1
        before_last = self._launched[self.parity]
        if before_last is not None and before_last.tokens is None:
            raise RuntimeError(
                "launch: the step before last was never waited on; this step would"
                " overwrite the staging buffers its copies may still read"
            )
        handle = self._launch(batch, block_table, dirty_slots)
        self._launched[self.parity] = handle
        return handle

    def _launch(
        self, batch: ScheduledBatch, block_table: np.ndarray, dirty_slots: list[int]
    ) -> StepHandle:
        prefill_seqs, prefill_lens, decode_seqs, mixed = arrange(
            batch, self.mixed_prefill_tokens, self.decode_in_prefill
        )
        chunks = list(zip(prefill_seqs, prefill_lens, strict=True)) if mixed else []
        num_rows = len(decode_seqs) + (sum(prefill_lens) if mixed else 0)
        padded = self._padded_rows(num_rows, mixed)
        first, done = 0, []
        if num_rows:
            first, done = self.step_inputs.fill(self.parity, decode_seqs, padded, chunks)
        else:
            self.step_inputs.forget()
        prefill_forward = bool(prefill_seqs) and not mixed
        # A row with logits processors or logprobs (or a prompt_logprobs chunk) adds a side
        # path after the step's own sampling: two C-level passes, as all_greedy's.
        extras = any(map(_EXTRAS, batch.decode_seqs)) or any(map(_EXTRAS, batch.prefill_seqs))
        # The decode (or mixed) forward's rows first..num_rows sample; they alone do unless
        # a prefill forward completes a prompt. Alone and all greedy, the tokens are the
        # graph's argmax; alone and not, the sampling graph's parameters are staged now, to
        # ride in the step's one copy.
        rows_seqs = done + decode_seqs
        alone = num_rows > 0 and not (prefill_forward and completes_any(batch))
        greedy_alone = alone and all_greedy(rows_seqs)
        graph_kind, step_key = None, None
        if alone and not greedy_alone and self.graph_sampling is not None:
            step_key = self.sampler.step_key()
            graph_kind = self.graph_sampling.stage(
                [s.params for s in rows_seqs], [len(s) for s in rows_seqs],
                step_key, padded, first, self.parity,
            )  # fmt: skip
        # The changed table rows land in the decode forward's graph, unless a prefill
        # forward runs first (or none runs): then upload scatters them.
        self.step_inputs.upload(
            self.parity, num_rows > 0, block_table, dirty_slots, self.block_table,
            with_sampling=graph_kind is not None, scatter=prefill_forward or not num_rows,
        )  # fmt: skip
        if batch.block_copies:
            src, dst = zip(*batch.block_copies, strict=True)
            self.backend.copy_blocks(
                self.kv_cache, torch.tensor(src, device=self.device),
                torch.tensor(dst, device=self.device),
            )  # fmt: skip
        if greedy_alone and not prefill_forward and not extras:  # most steps
            _, decode_greedy = self._run_decode(padded, mixed)
            return self.token_staging.greedy_to_host(
                decode_greedy, mixed, first, num_rows, self.parity
            )
        if not prefill_forward:
            prefill_seqs = []
        rows = slice(first, num_rows) if num_rows else None
        return self._launch_sampled(
            prefill_seqs, prefill_lens, padded, rows, rows_seqs, mixed, (graph_kind, step_key),
            chunks if extras else None,
        )  # fmt: skip

    def _launch_sampled(
        self,
        prefill_seqs: list[Sequence],
        prefill_lens: list[int],
        padded: int,
        rows: slice | None,
        rows_seqs: list[Sequence],
        mixed: bool,
        graph: tuple[tuple | None, int | None],
        extras_chunks: list[tuple[Sequence, int]] | None = None,
    ) -> StepHandle:
        """Run a step that samples other than by the decode graph's argmax alone, or has
        extras rows: the prefill forward over prefill_seqs (if any), then the decode (or
        mixed) forward at padded rows (if rows, its sampling rows, is not None); sample
        every forward's rows in the sampling graph (graph: its kind and the Philox key
        staged for it; the kind None for none), else by the decode graph's argmax (a
        decode step's greedy rows), else through the step sampler. extras_chunks (not
        None: a step with extras rows; a mixed step's prompt chunks): then the extras
        rows' side path (replica.runner.extras_path)."""
        extras = extras_chunks is not None
        graph_kind, step_key = graph
        logits, slots, greedy, sampled_seqs = [], [], [], []
        if prefill_seqs:
            prefill_logits, prefill_done, done_slots = self._run_prefill(prefill_seqs, prefill_lens)
            if prefill_done:
                logits.append(prefill_logits)
                slots.append(done_slots)
                greedy.append(None)
                sampled_seqs += prefill_done
        if rows is not None:  # mixed: chunks' last tokens, then decodes
            decode_logits, decode_greedy = self._run_decode(padded, mixed)
            if extras_chunks:
                self._add_mixed_prompt_logprobs(extras_chunks, decode_logits)
            logits.append(decode_logits[rows])
            slots.append(self.decode_inputs[SLOTS, rows])
            greedy.append(decode_greedy[rows])  # already in token_buf
            sampled_seqs += rows_seqs
        host = self.token_staging.host[self.parity, : len(sampled_seqs)]
        if not sampled_seqs:
            return StepHandle(host, None)
        if graph_kind is not None:  # only the decode (or mixed) forward samples
            self.sampling_graphs[mixed, padded, graph_kind].replay()
            tokens = self.graph_sampling.tokens[rows]
        else:
            sampling = self.sampler.batch(sampled_seqs)
            step_key = sampling.step_key
            tokens = self.sampler.sample(logits, slots, greedy, sampling, self.token_buf)
        step_logprobs = None
        if extras:
            step_logprobs = self.extras_path.run(
                logits, slots, sampled_seqs, tokens, self.token_buf, step_key, self.parity
            )
        handle = self.token_staging.to_host(tokens, host, self.parity)
        handle.extras = step_logprobs
        return handle

    def warm_up(self) -> None:
        """Run every device op a step may launch outside the graphs once (replica.runner.
        warm_up); it writes only the null row and the null block."""
        warm_up(self)

    def _add_mixed_prompt_logprobs(
        self,
        chunks: list[tuple[Sequence, int]],
        logits: torch.Tensor,  # [padded, vocab]: the mixed forward's, every row
    ) -> None:
        """Prompt logprobs of a mixed step's chunks: row order as DecodeInputs.fill's (each
        chunk's tokens but the last of a chunk that completes its prompt, in order)."""
        offsets, row = [], 0
        for seq, n in chunks:
            offsets.append(row)
            end = seq.num_computed_tokens + n
            row += n - (end == len(seq.token_ids))
        seqs, lens = [c[0] for c in chunks], [c[1] for c in chunks]
        for i, seq, first, end in prompt_spans(seqs, lens):
            start = offsets[i] + first - seq.num_computed_tokens
            self.prompt_logprobs.add(seq, first, logits[start : start + end - first])

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        self.processors.release(request_id)
        self.prompt_logprobs.release(request_id)

    def _run_prefill(
        self, seqs: list[Sequence], lens: list[int]
    ) -> tuple[torch.Tensor, list[Sequence], torch.Tensor]:
        """Logits at the last token of each sequence whose chunk completes it, and their
        slots; the prompt logprobs of the chunks that ask them (run eagerly)."""
        step = self.prefill.fill(seqs, lens, self.parity)
        num_done = len(step.done)
        done_slots = self.prefill.device_views(step.bucket)["done_slots"][:num_done]
        spans = list(prompt_spans(seqs, lens)) if any(map(_EXTRAS, seqs)) else []
        if spans:
            logits = self._run_prefill_keeping(step.bucket, seqs, lens, spans)
        elif self.use_cuda_graphs:
            graph, logits = self.prefill_graphs[step.bucket]
            graph.replay()
        else:
            logits = self.forwards.prefill(step.bucket)
        return logits[:num_done], step.done, done_slots

    def _run_prefill_keeping(self, bucket, seqs, lens, spans) -> torch.Tensor:
        """The prefill forward, eagerly, keeping the logits at the spans' positions
        (prompt_spans) for their prompt logprobs; the last rows' logits [num_seqs, vocab]."""
        starts = np.cumsum([0, *lens])  # each chunk's first token row
        kept = [
            np.arange(starts[i] + first - seq.num_computed_tokens,
                      starts[i] + end - seq.num_computed_tokens)
            for i, seq, first, end in spans
        ]  # fmt: skip
        index = torch.from_numpy(np.concatenate(kept)).to(self.device)
        logits, prompt_logits = self.forwards.prefill_with_rows(bucket, index)
        at = 0
        for (_, seq, first, _), rows in zip(spans, kept, strict=True):
            self.prompt_logprobs.add(seq, first, prompt_logits[at : at + len(rows)])
            at += len(rows)
        return logits

    def _run_decode(self, padded: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [padded, vocab] and greedy tokens [padded] of the uploaded rows."""
        if self.use_cuda_graphs:
            graph, (logits, greedy) = (self.mixed_graphs if mixed else self.graphs)[padded]
            graph.replay()
            return logits, greedy
        return self.forwards.decode(padded, append_first=mixed)

    def decode_forward_eager(self, num_rows: int) -> torch.Tensor:  # [num_rows, vocab]
        """One decode forward outside any graph, on whatever the decode buffers hold (profiling)."""
        return self.forwards.decode(num_rows)[0]

    def _padded_rows(self, num_rows: int, mixed: bool) -> int:
        """The captured size a step of num_rows runs at (on CUDA, graphs on or off)."""
        return padded_size(self.mixed_graph_sizes if mixed else self.graph_sizes, num_rows)

    def _capture_graphs(self) -> None:
        """Every graph a step replays (replica.runner.graphs), over inputs whose padding
        rows write only the null row and block."""
        self.step_inputs.upload(self.parity, True)
        self.prefill.fill_padding(self.parity)
        graphs = capture_forward_graphs(
            self.forwards, self.graph_sizes, self.mixed_graph_sizes, self.prefill.buckets(),
            self.graph_sampling is not None, self.device,
        )  # fmt: skip
        self.graphs, self.mixed_graphs, self.prefill_graphs, self.sampling_graphs = graphs
