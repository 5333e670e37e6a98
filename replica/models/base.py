"""The interface every model implements: a paged-KV-cache causal LM in plain torch."""

from __future__ import annotations

from typing import Protocol

import torch

from replica.attention import AttentionMetadata


class CausalLM(Protocol):
    """A decoder-only LM whose attention reads and writes the paged KV cache.

    `forward` runs one pass over packed tokens (all-prefill chunks or all-decode,
    as `meta` says): every attention layer appends its new K/V to
    kv_cache[layer] through the attention backend and attends over the cache.
    The pass has no host syncs and no data-dependent shapes, so a decode pass is
    CUDA-graph capturable; RoPE and learned position embeddings are looked up by
    `positions`, which must lie below `max_position_embeddings` (not checked).

    `checkpoint_name` maps a Hugging Face checkpoint tensor name to the name of a
    parameter here, or None for a tensor that is deliberately ignored (a tied
    lm_head, legacy attention-mask buffers); the loader raises on anything else
    that does not match a parameter.
    """

    def forward(
        self,
        input_ids: torch.Tensor,  # [T], int32 or int64
        positions: torch.Tensor,  # [T], int32 or int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        ...

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [N, hidden_size]
    ) -> torch.Tensor:  # [N, vocab_size]: float32 on the torch path, model dtype when fused
        ...

    def checkpoint_name(self, hf_name: str) -> str | None: ...

    def finalize(self) -> None:
        """Called once the weights are in place (e.g. to concatenate fused projections)."""
