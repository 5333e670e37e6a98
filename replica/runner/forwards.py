"""The model's forwards over the runner's persistent buffers, and the kernels they launch.

A decode (or mixed) forward takes its rows from the decode inputs' device buffer
(replica.runner.decode_inputs), a prefill forward takes a PrefillBucket's from the
prefill inputs' (replica.runner.prefill_inputs); both read a PLACEHOLDER id's token from
token_buf. Invariant: a forward reads its inputs only from those persistent buffers,
token_buf, the block table and the KV cache, never from a tensor made for the call, so
that a CUDA graph captured over it (replica.runner.graphs) replays each step's new
inputs; without graphs the runner calls the same forwards eagerly.

Kernels are chosen once, at construction, by device: Triton's on CUDA, their torch
references on the CPU.
"""

from __future__ import annotations

import functools

import torch

from replica.attention import AttentionBackend, AttentionMetadata, TorchAttention
from replica.options import EngineOptions
from replica.runner.decode_inputs import (
    CONTEXT_LENS,
    INPUT_IDS,
    OUT_SLOTS,
    POSITIONS,
    SLOTS,
    DecodeInputs,
)
from replica.runner.graph_sampling import GraphSamplingInputs
from replica.runner.prefill_inputs import PrefillBucket, PrefillInputs


def device_kernels(device: torch.device, pdl: bool, *names: str) -> tuple:
    """The kernels named: Triton kernels on CUDA (kernels' entry points, launched with
    PDL where pdl), their torch references on CPU (kernels.reference's <name>_ref)."""
    import kernels

    if device.type == "cuda":
        return tuple(functools.partial(getattr(kernels, name), pdl=pdl) for name in names)
    return tuple(getattr(kernels.reference, f"{name}_ref") for name in names)


def make_attention_backend(device: torch.device, options: EngineOptions) -> AttentionBackend:
    """Torch references on CPU, Triton kernels on CUDA; chosen once, never per call."""
    if device.type == "cpu":
        return TorchAttention()
    from replica.triton_attention import TritonAttention

    return TritonAttention(fuse_decode_append=options.fuse_decode_append, pdl=options.pdl)


class Forwards:
    """The prefill forward per PrefillBucket, the decode (or mixed) forward per row count,
    and the sampling graphs' launches over a decode forward's logits.

    kv_cache is None until the runner allocates it; no forward runs before that.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        pdl: bool,
        block_table: torch.Tensor,  # [max_num_seqs + 1, max_blocks_per_seq] int32
        token_buf: torch.Tensor,  # [max_num_seqs + 1] int64: the last token per table row
        step_inputs: DecodeInputs,
        prefill: PrefillInputs,
        graph_sampling: GraphSamplingInputs | None,
    ) -> None:
        self.model = model
        self.kv_cache: torch.Tensor | None = None
        self.block_table = block_table
        self.token_buf = token_buf
        self.step_inputs = step_inputs
        self.decode_inputs = step_inputs.inputs  # [5, max_rows] on the device
        self.prefill_inputs = prefill
        self.graph_sampling = graph_sampling
        # Greedy sampling into token_buf, the next step's read of it, and the step's
        # changed block-table rows (inside the decode graphs on CUDA).
        self.argmax_rows, self.resolve_placeholders, self.scatter_table_rows = device_kernels(
            device, pdl, "argmax_rows", "resolve_placeholders", "scatter_table_rows"
        )

    def prefill(self, bucket: PrefillBucket) -> torch.Tensor:  # [num_seqs, vocab]
        hidden, last_rows = self._prefill_hidden(bucket)
        return self.model.compute_logits(hidden[last_rows])

    def prefill_with_rows(
        self,
        bucket: PrefillBucket,
        rows: torch.Tensor,  # [num_kept] int64: token rows of the bucket
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_seqs, vocab], [num_kept, vocab]
        """prefill's logits, and the logits at the token rows kept (prompt logprobs).
        Never captured: a step that asks them runs it eagerly (a rare, opt-in feature)."""
        hidden, last_rows = self._prefill_hidden(bucket)
        return self.model.compute_logits(hidden[last_rows]), self.model.compute_logits(hidden[rows])

    def _prefill_hidden(self, bucket: PrefillBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states [num_tokens, hidden] and the rows [num_seqs] of each
        sequence's last token."""
        meta = self.prefill_inputs.metadata(bucket, self.block_table)
        views = self.prefill_inputs.device_views(bucket)
        # A decode sequence's token (decode_in_prefill) may be the one the step before
        # sampled: a PLACEHOLDER, read from token_buf as the decode forward does.
        ids = self.resolve_placeholders(views["ids"], self.token_buf, views["token_slots"])
        hidden = self.model(ids, meta.positions, self.kv_cache, meta)
        return hidden, views["last_rows"]

    def decode(
        self, num_rows: int, append_first: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [num_rows, vocab] and their argmax [num_rows], already in token_buf.

        Greedy sampling is part of the decode forward (and so of its CUDA graph): a
        greedy batch launches nothing after the graph but the tokens' copy to the host.
        append_first: rows may share a sequence (a mixed step's prompt chunks).
        """
        step = self.step_inputs  # the block-table rows this step changed, if upload left them
        self.scatter_table_rows(self.block_table, step.table_header, step.table_rows)
        inputs = self.decode_inputs[:, :num_rows]
        meta = AttentionMetadata(
            is_decode=True,
            block_table=self.block_table,
            slot_mapping=inputs[SLOTS],
            context_lens=inputs[CONTEXT_LENS],
            positions=inputs[POSITIONS],
            append_first=append_first,
        )
        # A PLACEHOLDER (negative) id is the token the previous step sampled into token_buf.
        ids = self.resolve_placeholders(inputs[INPUT_IDS], self.token_buf, inputs[SLOTS])
        hidden = self.model(ids, meta.positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden)
        # token_buf[OUT_SLOTS] = greedy; the null row takes the rows that sample nothing
        greedy = self.argmax_rows(logits, token_buf=self.token_buf, token_rows=inputs[OUT_SLOTS])
        return logits, greedy

    def sample_rows(self, logits: torch.Tensor, rows: int, kind: tuple[bool, bool]) -> None:
        """kernels.sampling over logits into graph_sampling.tokens and token_buf (rows that
        sample nothing into the null row, as the forward's argmax)."""
        tokens = self.graph_sampling.sample(logits, *kind)
        self.token_buf.index_copy_(0, self.decode_inputs[OUT_SLOTS, :rows], tokens)
