"""The Llama family (Llama, Qwen2, Qwen3) over the paged KV cache; parameter names match HF's.

Differences within the family are config fields, not subclasses: Qwen2 has q/k/v
biases (`qkv_bias`), Qwen3 normalises each q/k head before RoPE (`qk_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul
from kernels.linear import RowStats
from kernels.rotary import apply_rotary
from replica.attention import AttentionBackend, AttentionMetadata
from replica.models.config import ModelConfig
from replica.models.layers import Linear, LMHead, RMSNorm, uses_triton_linear
from replica.models.rope import RotaryEmbedding
from replica.options import EngineOptions


class LlamaAttention(nn.Module):
    """Attention with q/k/v projections, optional per-head q/k norm (Qwen3) and RoPE.

    Torch path (CPU): separate projections and HF's exact ops. Fused path (CUDA,
    chosen once): one q/k/v matmul over weights concatenated by finalize(), then
    one kernel for q/k norm + RoPE.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        fused: bool,
        pdl: bool = True,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.pdl = pdl
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm
        self.norm_eps = config.norm_eps
        self.sizes = [q_size, kv_size, kv_size]
        self._qkv = _qkv_fused if fused else _qkv_torch

    def finalize(self) -> None:
        """Fused path: replace q/k/v by one projection over their concatenated weights."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        self.qkv_proj = Linear(
            weight.shape[1], weight.shape[0], bias=bias is not None,
            device=weight.device, dtype=weight.dtype,
        ).requires_grad_(False)  # fmt: skip
        self.qkv_proj.triton_linear = self.q_proj.triton_linear
        self.qkv_proj.pdl = self.q_proj.pdl
        self.qkv_proj.weight.copy_(weight)
        if bias is not None:
            self.qkv_proj.bias.copy_(bias)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.o_proj(self.attend(*self._qkv(self, x, positions, rotary), kv_cache, meta))

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], normed and rotated
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]: the heads' outputs, before o_proj
        out = self.backend.forward(
            q, k, v, kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1], meta, self.scale
        )
        return out.reshape(q.shape[0], -1)

    def heads(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused path: q, k, v from qkv_proj's output [T, (heads + 2 kv heads) * head_dim],
        q/k norm (Qwen3) and RoPE in one kernel."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)  # strided views of one matmul
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q_w = self.q_norm.weight if self.qk_norm else None
        k_w = self.k_norm.weight if self.qk_norm else None
        q, k = apply_rotary(
            q, k, rotary.cos, rotary.sin, positions, q_w, k_w, self.norm_eps, pdl=self.pdl
        )
        return q, k, v


def _qkv_torch(
    attn: LlamaAttention, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens = x.shape[0]
    q = attn.q_proj(x).view(num_tokens, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(num_tokens, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    q, k = rotary(positions, q, k)  # [T, num_heads, head_dim], [T, num_kv_heads, head_dim]
    return q, k, v


def _qkv_fused(
    attn: LlamaAttention, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn.heads(attn.qkv_proj(x), positions, rotary)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP; the fused path runs one gate|up matmul and one silu_and_mul kernel,
    or, folded (gated_normed, fuse_silu), one gate|up launch that applies SiLU * up too."""

    def __init__(self, config: ModelConfig, fused: bool, pdl: bool = True) -> None:
        super().__init__()
        self.pdl = pdl
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self._act = _mlp_fused if fused else _mlp_torch
        self.fuse_silu = False  # LlamaForCausalLM.finalize's choice, for gated_normed

    def finalize(self) -> None:
        """Fused path: one projection over the concatenated gate and up weights."""
        weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        has_bias = self.gate_proj.bias is not None
        self.gate_up_proj = Linear(
            weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device,
            dtype=weight.dtype,
        ).requires_grad_(False)  # fmt: skip
        self.gate_up_proj.triton_linear = self.gate_proj.triton_linear
        self.gate_up_proj.pdl = self.gate_proj.pdl
        self.gate_up_proj.weight.copy_(weight)
        if has_bias:
            self.gate_up_proj.bias.copy_(torch.cat([self.gate_proj.bias, self.up_proj.bias]))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self.down_proj(self._act(self, x))

    def gated_normed(
        self,
        residual: torch.Tensor,  # [T, hidden_size]
        stats: RowStats,  # residual's rows
    ) -> torch.Tensor:  # [T, intermediate_size]
        """Folded path: silu(gate) * up of the normed residual, in gate_up_proj's epilogue
        where fuse_silu (one launch), else a silu_and_mul launch after it."""
        if self.fuse_silu:
            return self.gate_up_proj.normed(residual, stats, activation="silu_mul")
        return silu_and_mul(self.gate_up_proj.normed(residual, stats), pdl=self.pdl)


def _mlp_torch(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)


def _mlp_fused(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(mlp.gate_up_proj(x), pdl=mlp.pdl)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block that carries the residual stream separately.

    forward(x, residual) returns (sublayer output, residual) and folds each
    residual add into the following norm (add_and_norm): the same additions HF
    makes (x + residual), so the torch path stays exact, and one kernel on CUDA.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        fused: bool,
        pdl: bool = True,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, fused, pdl)
        self.mlp = LlamaMLP(config, fused, pdl)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, fused, pdl)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, fused, pdl)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]: the previous sublayer's output
        residual: torch.Tensor | None,  # [T, hidden_size]; None before the first layer
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual

    def forward_folded(
        self,
        residual: torch.Tensor,  # [T, hidden_size]: the residual stream, updated in place
        stats: RowStats | None,  # residual's row statistics, from the previous layer
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        normed: torch.Tensor | None = None,  # input_layernorm(residual) where the caller made it
    ) -> RowStats:  # of residual, both sublayers added
        """The layer where kernels.linear runs every projection: both RMSNorms are folded
        into qkv_proj and gate_up_proj, and o_proj and down_proj add their output to
        residual in place. No norm kernel, no add kernel; with the MLP's fuse_silu no
        activation kernel: the MLP is two launches."""
        attn, mlp = self.self_attn, self.mlp
        qkv = attn.qkv_proj(normed) if normed is not None else attn.qkv_proj.normed(residual, stats)
        out = attn.attend(*attn.heads(qkv, positions, rotary), kv_cache, meta)
        stats = attn.o_proj.add_to(out, residual)
        return mlp.down_proj.add_to(mlp.gated_normed(residual, stats), residual)

    def fold_norms(self) -> None:
        """Both RMSNorms into the projections after them, in place (Linear.fold_norm)."""
        self.self_attn.qkv_proj.fold_norm(self.input_layernorm)
        self.mlp.gate_up_proj.fold_norm(self.post_attention_layernorm)

    def runs_folded(self, num_tokens: int) -> bool:
        """Whether kernels.linear runs all four projections for num_tokens rows."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return all(p.triton_tile(num_tokens) is not None for p in projections)


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, fused: bool, pdl: bool = True
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, fused, pdl) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, fused, pdl)


class LlamaForCausalLM(nn.Module):
    """RMSNorm, RoPE, GQA, SiLU-gated MLP; lm_head tied to embed_tokens when configured.

    options: pdl for the fused kernels; fold_norms folds both RMSNorms and the residual
    adds of decode-sized batches into kernels.linear where the model runs it; fuse_silu
    (where folded) runs SiLU * up in gate_up_proj's epilogue ("silu_mul"), no
    silu_and_mul launch: qwen3-0.6b in bf16 on an H200, decode steps of 0.936 / 1.20 /
    1.68 ms at batch 1 / 16 / 64 against 0.976 / 1.25 / 1.69 with the launch.
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
        options: EngineOptions | None = None,  # None: EngineOptions()
    ) -> None:
        super().__init__()
        if config.rope is None:
            raise ValueError(f"{config.architecture} needs a RoPE config")
        self.config = config
        self.fused = fused
        self.options = options = options or EngineOptions()
        self.model = LlamaModel(config, backend, self.fused, options.pdl)
        self.fold_norms = False  # finalize() decides, once the weights are in
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
        layers = self.model.layers
        if self.fold_norms and layers[0].runs_folded(input_ids.shape[0]):
            residual = self.model.embed_tokens(input_ids)
            normed = layers[0].input_layernorm(residual)  # its gamma is folded: a plain norm
            stats = layers[0].forward_folded(
                residual, None, positions, self.rotary, kv_cache, meta, normed
            )
            for layer in layers[1:]:
                stats = layer.forward_folded(
                    residual, stats, positions, self.rotary, kv_cache, meta
                )
            return self.model.norm(residual)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in layers:
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        return self.model.norm.add_and_norm(x, residual)[0]

    def finalize(self) -> None:
        """After the weights are in place: the LM head; on the fused path, concatenated
        projections."""
        tied = self.config.tie_word_embeddings
        weight = self.model.embed_tokens.weight if tied else self.lm_head.weight
        self.logits_head = LMHead(weight, self.config.vocab_size, self.fused)
        if not self.fused:
            return
        for layer in self.model.layers:
            layer.self_attn.finalize()
            layer.mlp.finalize()
        self.fold_norms = self.options.fold_norms and uses_triton_linear(self)
        if self.fold_norms:
            for layer in self.model.layers:
                layer.fold_norms()
                layer.mlp.fuse_silu = self.options.fuse_silu

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size]
        return self.logits_head(hidden)

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return hf_name
