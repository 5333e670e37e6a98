"""The Llama family (Llama, Qwen2, Qwen3) over the paged KV cache; parameter names match HF's.

Differences within the family are config fields, not subclasses: Qwen2 has q/k/v
biases (`qkv_bias`), Qwen3 normalises each q/k head before RoPE (`qk_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.attention import AttentionBackend, AttentionMetadata
from replica.models.config import ModelConfig
from replica.models.layers import RMSNorm
from replica.models.rope import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotary(positions, q, k)  # [T, num_heads, head_dim], [T, num_kv_heads, head_dim]
        out = self.backend.forward(
            q, k, v, kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1], meta, self.scale
        )  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


class LlamaForCausalLM(nn.Module):
    """RMSNorm, RoPE, GQA, SiLU-gated MLP; lm_head tied to embed_tokens when configured."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if config.rope is None:
            raise ValueError(f"{config.architecture} needs a RoPE config")
        self.config = config
        self.model = LlamaModel(config, backend)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, dtype, device
        )
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size], float32
        if self.config.tie_word_embeddings:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return hf_name
