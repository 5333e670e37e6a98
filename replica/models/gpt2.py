"""GPT-2 (GPT2LMHeadModel) over the paged KV cache; parameter names match HF's."""

from __future__ import annotations

import re

import torch
from torch import nn

from kernels.layer_norm import embed_add_layer_norm
from kernels.linear import MAX_ROWS
from replica.attention import AttentionBackend, AttentionMetadata
from replica.models.config import ModelConfig
from replica.models.layers import Conv1D, LayerNorm, LMHead, gelu_new, uses_triton_linear

# Legacy checkpoints carry the causal-mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias`.
_MASK_BUFFER = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")
# Decode-sized batches run the norms and residual adds inside kernels.linear (where the
# model uses it); bench --no-fold-norms turns that off for A/B runs, before the engine starts.
FOLD_NORMS = True


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        self.c_attn = Conv1D(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_heads, head_dim]
        meta: AttentionMetadata,
        norm: LayerNorm | None = None,  # applied to x first (folded into c_attn)
        residual: torch.Tensor | None = None,  # [T, hidden_size]: the output is added to it
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens = x.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q, k, v = self.c_attn(x, norm=norm).chunk(3, dim=-1)  # 3 x [T, hidden], strided views
        q, k, v = q.view(shape), k.view(shape), v.view(shape)  # the kernels take row strides
        out = self.backend.forward(
            q, k, v, kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1], meta, self.scale
        )  # [T, num_heads, head_dim]
        return self.c_proj(out.reshape(num_tokens, -1), residual=residual)


class GPT2MLP(nn.Module):
    """c_fc, tanh GELU, c_proj; the GELU is HF's exact formula, or fused into c_fc."""

    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self._fc_act = _fc_gelu_fused if fused else _fc_gelu_torch

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]
        norm: LayerNorm | None = None,  # applied to x first (folded into c_fc)
        residual: torch.Tensor | None = None,  # [T, hidden_size]: the output is added to it
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.c_proj(self._fc_act(self.c_fc, x, norm), residual=residual)


def _fc_gelu_torch(c_fc: Conv1D, x: torch.Tensor, norm: LayerNorm | None) -> torch.Tensor:
    return gelu_new(c_fc(x, norm=norm))


def _fc_gelu_fused(c_fc: Conv1D, x: torch.Tensor, norm: LayerNorm | None) -> torch.Tensor:
    return c_fc(x, activation="gelu_tanh", norm=norm)


class GPT2Block(nn.Module):
    """Pre-LayerNorm block that carries the residual stream separately, as LlamaDecoderLayer.

    forward(x, residual) returns (MLP output, residual) and folds each residual add
    into the following norm (add_and_norm): the same additions HF makes, so the
    torch path stays exact, and one kernel per norm on CUDA.
    """

    def __init__(
        self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, fused: bool
    ) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps, fused)
        self.attn = GPT2Attention(config, layer_idx, backend)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps, fused)
        self.mlp = GPT2MLP(config, fused)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden_size]: the previous sublayer's output
        residual: torch.Tensor,  # [T, hidden_size]: the residual stream before x is added
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.after_ln_1(*self.ln_1.add_and_norm(x, residual), kv_cache, meta)

    def after_ln_1(
        self,
        h: torch.Tensor,  # [T, hidden_size]: ln_1's output
        residual: torch.Tensor,  # [T, hidden_size]: the residual stream, x added
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.attn(h, kv_cache, meta)
        h, residual = self.ln_2.add_and_norm(h, residual)
        return self.mlp(h), residual

    def forward_folded(
        self,
        residual: torch.Tensor,  # [T, hidden_size]: the residual stream, updated in place
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        normed: torch.Tensor | None = None,  # ln_1(residual), where the caller made it
    ) -> torch.Tensor:  # residual, both sublayers added
        """The block in kernels.linear's rows: ln_1 and ln_2 run in the prologues of
        c_attn and c_fc, and each sublayer's last projection adds its output to the
        residual stream in its epilogue. Five launches (attention included) for seven."""
        if normed is None:
            self.attn(residual, kv_cache, meta, norm=self.ln_1, residual=residual)
        else:
            self.attn(normed, kv_cache, meta, residual=residual)
        return self.mlp(residual, norm=self.ln_2, residual=residual)


class GPT2Transformer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, i, backend, fused) for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps, fused)


class GPT2LMHeadModel(nn.Module):
    """Learned positions, pre-LayerNorm blocks, fused c_attn, lm_head tied to wte."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.fused = fused
        self.transformer = GPT2Transformer(config, backend, fused)
        self.fold_norms = False  # finalize() decides, once use_triton_linear has run

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        t = self.transformer
        # The embedding sum (HF: wte + wpe) is the first block's residual add; fused, one
        # kernel gathers both rows, adds them and runs ln_1.
        first = t.h[0]
        if self.fused:
            ln = first.ln_1
            h, residual = embed_add_layer_norm(
                input_ids, positions, t.wte.weight, t.wpe.weight, ln.weight, ln.bias, ln.eps
            )
        else:
            h, residual = first.ln_1.add_and_norm(t.wpe(positions), t.wte(input_ids))
        if self.fold_norms and input_ids.shape[0] <= MAX_ROWS:  # decode-sized: 5 launches a block
            residual = first.forward_folded(residual, kv_cache, meta, normed=h)
            for block in t.h[1:]:
                residual = block.forward_folded(residual, kv_cache, meta)
            return t.ln_f(residual)
        x, residual = first.after_ln_1(h, residual, kv_cache, meta)
        for block in t.h[1:]:
            x, residual = block(x, residual, kv_cache, meta)
        return t.ln_f.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size]
        return self.logits_head(hidden)

    def finalize(self) -> None:
        """After the weights are in place: the LM head over the tied embedding."""
        wte = self.transformer.wte.weight
        self.logits_head = LMHead(wte, self.config.vocab_size, self.fused)
        self.fold_norms = FOLD_NORMS and uses_triton_linear(self)

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" or _MASK_BUFFER.search(hf_name):
            return None
        return hf_name if hf_name.startswith("transformer.") else f"transformer.{hf_name}"
