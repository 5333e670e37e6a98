"""GPT-2 (GPT2LMHeadModel) over the paged KV cache; parameter names match HF's."""

from __future__ import annotations

import re

import torch
from torch import nn

from kernels.layer_norm import embed_add_layer_norm
from kernels.linear import RowStats
from replica.attention import AttentionBackend, AttentionMetadata
from replica.models.config import ModelConfig
from replica.models.layers import Conv1D, LayerNorm, LMHead, gelu_new, uses_triton_linear
from replica.options import EngineOptions

# Legacy checkpoints carry the causal-mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias`.
_MASK_BUFFER = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")


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
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.c_proj(self.attend(self.c_attn(x), kv_cache, meta))

    def attend(
        self,
        qkv: torch.Tensor,  # [T, 3 * hidden_size]: c_attn's output
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]: the heads' outputs, before c_proj
        num_tokens = qkv.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x [T, hidden_size], strided views
        q, k, v = q.view(shape), k.view(shape), v.view(shape)  # the kernels take row strides
        out = self.backend.forward(
            q, k, v, kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1], meta, self.scale
        )  # [T, num_heads, head_dim]
        return out.reshape(num_tokens, -1)


class GPT2MLP(nn.Module):
    """c_fc, tanh GELU, c_proj; the GELU is HF's exact formula, or fused into c_fc."""

    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self._fc_act = _fc_gelu_fused if fused else _fc_gelu_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self.c_proj(self._fc_act(self.c_fc, x))


def _fc_gelu_torch(c_fc: Conv1D, x: torch.Tensor) -> torch.Tensor:
    return gelu_new(c_fc(x))


def _fc_gelu_fused(c_fc: Conv1D, x: torch.Tensor) -> torch.Tensor:
    return c_fc(x, activation="gelu_tanh")


class GPT2Block(nn.Module):
    """Pre-LayerNorm block that carries the residual stream separately, as LlamaDecoderLayer.

    forward(x, residual) returns (MLP output, residual) and folds each residual add
    into the following norm (add_and_norm): the same additions HF makes, so the
    torch path stays exact, and one kernel per norm on CUDA.
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
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps, fused, pdl)
        self.attn = GPT2Attention(config, layer_idx, backend)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps, fused, pdl)
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
        stats: RowStats | None,  # residual's row statistics, from the previous block
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        normed: torch.Tensor | None = None,  # ln_1(residual) where the caller made it
    ) -> RowStats:  # of residual, both sublayers added
        """The block where kernels.linear runs every projection: ln_1 and ln_2 are folded
        into c_attn and c_fc, and both c_proj add their output to residual in place. Five
        launches, attention's included, where the separate add + norm kernels made seven."""
        attn, mlp = self.attn, self.mlp
        qkv = attn.c_attn(normed) if normed is not None else attn.c_attn.normed(residual, stats)
        stats = attn.c_proj.add_to(attn.attend(qkv, kv_cache, meta), residual)
        h = mlp.c_fc.normed(residual, stats, activation="gelu_tanh")
        return mlp.c_proj.add_to(h, residual)

    def fold_norms(self) -> None:
        """ln_1 into c_attn and ln_2 into c_fc, for forward_folded (after weight loading)."""
        self.attn.c_attn.fold_norm(self.ln_1)
        self.mlp.c_fc.fold_norm(self.ln_2)

    def runs_folded(self, num_tokens: int) -> bool:
        """Whether kernels.linear runs all four projections for num_tokens rows."""
        projections = (self.attn.c_attn, self.attn.c_proj, self.mlp.c_fc, self.mlp.c_proj)
        return all(p.triton_tile(num_tokens) is not None for p in projections)


class GPT2Transformer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, fused: bool, pdl: bool = True
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, i, backend, fused, pdl) for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps, fused, pdl)


class GPT2LMHeadModel(nn.Module):
    """Learned positions, pre-LayerNorm blocks, fused c_attn, lm_head tied to wte.

    options: pdl for the fused kernels; fold_norms folds ln_1 / ln_2 and the residual
    adds of decode-sized batches into kernels.linear where the model runs it.
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
        self.config = config
        self.fused = fused
        self.options = options = options or EngineOptions()
        self.transformer = GPT2Transformer(config, backend, fused, options.pdl)
        self.fold_norms = False  # finalize() decides, once the weights are in

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
                input_ids, positions, t.wte.weight, t.wpe.weight, ln.weight, ln.bias, ln.eps,
                pdl=self.options.pdl,
            )  # fmt: skip
        else:
            h, residual = first.ln_1.add_and_norm(t.wpe(positions), t.wte(input_ids))
        if self.fold_norms and first.runs_folded(input_ids.shape[0]):
            stats = first.forward_folded(residual, None, kv_cache, meta, normed=h)
            for block in t.h[1:]:
                stats = block.forward_folded(residual, stats, kv_cache, meta)
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
        self.fold_norms = self.options.fold_norms and uses_triton_linear(self)
        if self.fold_norms:
            for block in self.transformer.h:
                block.fold_norms()

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" or _MASK_BUFFER.search(hf_name):
            return None
        return hf_name if hf_name.startswith("transformer.") else f"transformer.{hf_name}"
