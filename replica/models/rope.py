"""Rotary position embedding with a precomputed cos/sin table indexed by positions.

The table is computed once at construction, the way Hugging Face computes it at
every call (inv_freq in float32, freqs = positions * inv_freq, cos/sin in float32,
then cast to the model dtype), so that a lookup is bit-identical to HF's values
and `forward` has no data-dependent shapes or host syncs (CUDA-graph capturable).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from replica.models.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:  # [head_dim // 2], float32
    """On the CPU, as HF computes it at init (explicit device: immune to a meta-device context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency smoothing, step for step as transformers computes it."""
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of shape [max_positions, head_dim] in the model dtype.

    The tables are plain attributes, not buffers: the loader builds parameters on
    the meta device and materialises them with `to_empty`, which would wipe buffers.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [T], int32 or int64
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        q_rot = (q * cos) + (_rotate_half(q) * sin)
        k_rot = (k * cos) + (_rotate_half(k) * sin)
        return q_rot, k_rot
