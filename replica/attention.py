"""The attention seam between models and kernels.

A model's attention layer calls `backend.forward(...)` with its new q/k/v and
one layer's cache views; the backend appends K/V into the paged cache and runs
paged attention. Which kernels run (torch references on CPU, TorchAttention here;
Triton on CUDA, replica.triton_attention) is decided once, when the model runner builds
the backend. This module imports no backend of its own beyond the references, so the
backends import it and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import reference as ref


@dataclass
class AttentionMetadata:
    """Indices for one forward pass: all-prefill (packed chunks) or all-decode.

    Decode: one token per batch row; slot_mapping/context_lens/positions are [B].
    append_first: rows may share a sequence (a mixed step's prompt chunk, one row
    per token, each with its own context length), so every row's K/V must be in
    the cache before any row's attention reads it.
    Prefill: chunks packed; slot_mapping/context_lens/start_positions are
    [num_seqs], cu_seqlens_q is [num_seqs + 1], positions is [num_tokens].
    context_lens count the cached tokens after this pass's tokens are appended.
    A bucketed prefill (CUDA graphs) pads tokens and sequences: padding sequences
    are empty (cu_seqlens_q repeats), padding tokens follow the last chunk, and
    token_slots [num_tokens] (each token's table row; the null row for padding)
    plus prefill_work, prefill_short_work and prefill_long_work (the attention work
    lists) make every launch's grid a function of the bucket alone. Backends that do
    not need them ignore them.
    """

    is_decode: bool
    block_table: torch.Tensor  # [max_num_seqs + 1, max_blocks_per_seq], int32
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor  # [num_tokens]
    cu_seqlens_q: torch.Tensor | None = None
    start_positions: torch.Tensor | None = None
    max_q_len: int = 1
    token_slots: torch.Tensor | None = None
    prefill_work: torch.Tensor | None = None  # [capacity, 2] (seq, query block), -1 padded
    prefill_short_work: torch.Tensor | None = None  # the same for short chunks (decode rows)
    prefill_long_work: torch.Tensor | None = None  # and for long chunks (None: no such list)
    append_first: bool = False


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def copy_blocks(
        self,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        src: torch.Tensor,  # [num_copies]
        dst: torch.Tensor,  # [num_copies]
    ) -> None: ...


class TorchAttention:
    """The torch references: the CPU path, and the ground truth for the kernels."""

    def copy_blocks(self, kv_cache, src, dst):
        ref.copy_blocks_ref(kv_cache, src, dst)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        if meta.is_decode:
            ref.append_kv_slots_ref(
                k, v, k_cache, v_cache, meta.block_table, meta.slot_mapping, meta.positions
            )
            return ref.paged_decode_attention_ref(
                q, k_cache, v_cache, meta.block_table, meta.slot_mapping, meta.context_lens, scale
            )
        ref.append_kv_prefill_ref(
            k, v, k_cache, v_cache, meta.block_table, meta.slot_mapping,
            meta.cu_seqlens_q, meta.start_positions,
        )  # fmt: skip
        return ref.paged_prefill_attention_ref(
            q, k_cache, v_cache, meta.block_table, meta.slot_mapping,
            meta.cu_seqlens_q, meta.context_lens, scale,
        )  # fmt: skip
