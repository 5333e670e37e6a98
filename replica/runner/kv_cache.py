"""The paged KV cache's dtype and size: how many blocks fit in the memory budget."""

from __future__ import annotations

import torch

from kernels.reference import FP8_KV_DTYPE
from replica.config import EngineConfig
from replica.models import ModelConfig


def resolve_kv_cache_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype: the model's, or float8 e4m3 for "fp8" / "fp8_e4m3"."""
    if name == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype: {name!r} needs a GPU of compute capability 8.9 or later "
            f"(fp8 conversions), this one is {torch.cuda.get_device_capability(device)}"
        )
    return FP8_KV_DTYPE


def kv_bytes_per_block(mc: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """K and V of one block, every layer."""
    itemsize = torch.empty(0, dtype=kv_cache_dtype).element_size()
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * itemsize


def num_blocks_from_memory(
    config: EngineConfig,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    max_blocks_per_seq: int,
) -> int:
    """KV blocks that fit in the memory budget, capped at what a full batch can use."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
        budget -= _activation_reserve_bytes(config, mc, dtype)
    else:
        budget = config.cpu_kv_cache_gb * 2**30
    cap = 2 * config.max_num_seqs * max_blocks_per_seq
    per_block = kv_bytes_per_block(mc, config.block_size, kv_cache_dtype)
    num_blocks = min(int(budget // per_block), cap)
    if num_blocks < max_blocks_per_seq:
        raise ValueError(
            f"num_blocks: only {num_blocks} KV blocks fit in memory, fewer than one "
            f"max_model_len sequence needs ({max_blocks_per_seq}); "
            "lower max_model_len or raise the memory budget"
        )
    return num_blocks


def _activation_reserve_bytes(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """An upper estimate of the transient memory of the largest forward pass."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tokens = config.max_num_batched_tokens + config.max_num_seqs
    per_token = 24 * mc.hidden_size * itemsize  # residual, qkv, MLP (<= 4x hidden, gated)
    logits = 3 * max(config.max_num_seqs, 64) * mc.vocab_size * 4
    return 2 * tokens * per_token + logits + 512 * 2**20
