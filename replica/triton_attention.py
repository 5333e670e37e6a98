"""The Triton attention backend: paged KV append + paged attention kernels on CUDA."""

from __future__ import annotations

import torch

from kernels.copy_blocks import copy_blocks
from kernels.decode_attention import paged_decode_attention
from kernels.kv_append import append_kv_prefill, append_kv_slots
from kernels.prefill_attention import paged_prefill_attention
from replica.attention import AttentionMetadata


class TritonAttention:
    """AttentionBackend on the Triton kernels.

    Decode: paged_decode_attention, which appends the new K/V itself (positions are
    context_lens - 1 in a decode batch), or append_kv_slots first where
    fuse_decode_append is off (EngineOptions; False for A/B runs) or rows share a
    sequence (meta.append_first). pdl: the kernels that take it launch with PDL
    (kernels.pdl).
    Neither reads device data on the host and the split count comes from shapes
    (the block table width), so the decode branch can be captured in a CUDA graph.
    Prefill with a work list (bucketed, capturable): append_kv_slots per token +
    the work-list form of paged_prefill_attention. Prefill without one: append_kv_prefill +
    paged_prefill_attention, with grids sized by the host int meta.max_q_len.
    """

    def __init__(
        self,
        decode_num_splits: int | None = None,
        fuse_decode_append: bool = True,
        pdl: bool = True,
    ) -> None:
        # None: chosen from shapes per batch size (fixed per captured graph).
        self.decode_num_splits = decode_num_splits
        self.fuse_decode_append = fuse_decode_append
        self.pdl = pdl

    def copy_blocks(
        self,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        src: torch.Tensor,  # [num_copies]
        dst: torch.Tensor,  # [num_copies]
    ) -> None:
        copy_blocks(kv_cache, src, dst)

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
        if meta.is_decode:
            if self.fuse_decode_append and not meta.append_first:
                return paged_decode_attention(
                    q, k_cache, v_cache, meta.block_table, meta.slot_mapping, meta.context_lens,
                    scale, num_splits=self.decode_num_splits, k_new=k, v_new=v, pdl=self.pdl,
                )  # fmt: skip
            append_kv_slots(
                k, v, k_cache, v_cache, meta.block_table, meta.slot_mapping, meta.positions,
                pdl=self.pdl,
            )  # fmt: skip
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.slot_mapping, meta.context_lens,
                scale, num_splits=self.decode_num_splits, pdl=self.pdl,
            )  # fmt: skip
        if meta.prefill_work is not None:
            append_kv_slots(
                k, v, k_cache, v_cache, meta.block_table, meta.token_slots, meta.positions,
                pdl=self.pdl,
            )  # fmt: skip
            return paged_prefill_attention(
                q, k_cache, v_cache, meta.block_table, meta.slot_mapping,
                meta.cu_seqlens_q, meta.context_lens, scale, work=meta.prefill_work,
                short_work=meta.prefill_short_work, long_work=meta.prefill_long_work,
            )  # fmt: skip
        append_kv_prefill(
            k, v, k_cache, v_cache, meta.block_table, meta.slot_mapping,
            meta.cu_seqlens_q, meta.start_positions, meta.max_q_len, pdl=self.pdl,
        )  # fmt: skip
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.block_table, meta.slot_mapping,
            meta.cu_seqlens_q, meta.context_lens, scale, max_q_len=meta.max_q_len,
        )  # fmt: skip
