"""Small layers shared by the models, numerically identical to their HF counterparts."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layer_norm import fused_add_layer_norm, layer_norm
from kernels.linear import (
    FoldedNorm,
    RowStats,
    fold_layer_norm,
    fold_rms_norm,
    linear,
    linear_add,
    linear_norm,
)
from kernels.linear_tiles import Tile, choose_tile, gated_tile
from kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_ref


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    return rms_norm(x, weight, eps, pdl=pdl)


def add_rms_norm_fused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm(x, residual, weight, eps, pdl=pdl)


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics; `fused` (chosen once, on CUDA) runs one Triton kernel,
    launched with PDL where `pdl` (kernels.pdl).

    add_and_norm(x, residual) returns (norm(residual + x), residual + x): the
    residual add of a decoder layer fused with the next norm.
    """

    def __init__(self, hidden_size: int, eps: float, fused: bool = False, pdl: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        if fused:
            self._norm = functools.partial(rms_norm_fused, pdl=pdl)
            self._add_norm = functools.partial(add_rms_norm_fused, pdl=pdl)
        else:
            self._norm = rms_norm_ref  # LlamaRMSNorm's numerics
            self._add_norm = add_rms_norm_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden_size]
        return self._norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, hidden], [T, hidden])
        return self._add_norm(x, residual, self.weight, self.eps)


def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return layer_norm_torch(residual, weight, bias, eps), residual


def layer_norm_fused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, pdl: bool
) -> torch.Tensor:
    return layer_norm(x, weight, bias, eps, pdl=pdl)


def add_layer_norm_fused(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_layer_norm(x, residual, weight, bias, eps, pdl=pdl)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (GPT-2's ln_*); `fused` (chosen once, on CUDA) runs one Triton kernel,
    launched with PDL where `pdl` (kernels.pdl).

    add_and_norm(x, residual) returns (norm(residual + x), residual + x), like
    RMSNorm's; the fused kernel writes the sum into residual in place.
    """

    def __init__(self, hidden_size: int, eps: float, fused: bool = False, pdl: bool = True) -> None:
        super().__init__(hidden_size, eps=eps)
        if fused:
            self._norm = functools.partial(layer_norm_fused, pdl=pdl)
            self._add_norm = functools.partial(add_layer_norm_fused, pdl=pdl)
        else:
            self._norm = layer_norm_torch
            self._add_norm = add_layer_norm_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self._norm(x, self.weight, self.bias, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, hidden], [T, hidden])
        return self._add_norm(x, residual, self.weight, self.bias, self.eps)


class Projection:
    """What Conv1D and Linear share where kernels.linear runs their rows: the tile, the
    residual add in the epilogue (add_to) and the norm before them folded in (normed).

    A model runs a block this way only where every projection of the block has a tile
    for its rows (a decode step, a short prefill); other rows run the plain forward.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    weight_is_kn: bool  # [K, N] (Conv1D) or [N, K] (nn.Linear)
    triton_linear: bool
    pdl: bool  # kernels.linear's launches with PDL (kernels.pdl); set by use_triton_linear
    folded_norm: FoldedNorm | None

    def triton_tile(
        self, num_rows: int, row_stats: bool = False, gated: bool = False
    ) -> Tile | None:
        """kernels.linear's tile for num_rows rows (of add_to where row_stats; of a
        "silu_mul" launch, gated_tile's, where gated), or None where cuBLAS runs them."""
        if not self.triton_linear:
            return None
        tile = choose_tile(
            num_rows, self.out_features, self.in_features, row_stats, self.weight_is_kn
        )
        if tile is None or not gated:
            return tile
        return gated_tile(tile, self.weight.element_size())

    def add_to(
        self,
        x: torch.Tensor,  # [T, in_features]
        residual: torch.Tensor,  # [T, out_features], updated in place
    ) -> RowStats:  # of residual's new rows
        """`residual += self(x)` in one kernels.linear launch, where it runs T rows."""
        tile = self.triton_tile(x.shape[0], row_stats=True)
        assert tile is not None, "add_to: kernels.linear does not run this many rows"
        return linear_add(
            x, self.weight, self.bias, residual, weight_is_kn=self.weight_is_kn, tile=tile,
            pdl=self.pdl,
        )  # fmt: skip

    def normed(
        self,
        x: torch.Tensor,  # [T, in_features]
        stats: RowStats,  # x's rows (from the add_to that wrote them)
        activation: str = "none",
    ) -> torch.Tensor:  # [T, out_features] ([T, out_features / 2] for "silu_mul")
        """`self(norm(x), activation)` in one launch, norm being the folded one; "silu_mul"
        takes the output's halves as gate and up (kernels.linear)."""
        tile = self.triton_tile(x.shape[0], gated=activation == "silu_mul")
        if self.folded_norm is None or tile is None:
            why = "fold_norm first" if tile else "kernels.linear does not run this many rows"
            raise AssertionError(f"normed: {why}")
        return linear_norm(
            x, self.folded_norm, stats, activation=activation, tile=tile, pdl=self.pdl
        )


class Conv1D(Projection, nn.Module):
    """GPT-2's linear layer: weight stored [in_features, out_features], y = b + x @ W.

    forward(x, activation) applies "gelu_tanh" (torch's tanh GELU) after the
    product when asked. With `triton_linear` set (use_triton_linear: the fused
    path in fp16 / bf16) a batch that kernels.linear's tile table covers runs that
    kernel, activation fused; larger batches (prefill) run cuBLASLt with the GELU
    in its epilogue (H200, fc at 8192 rows: 68 us against 90 for addmm + GELU);
    the torch path runs addmm.

    Where kernels.linear runs, a decode-sized GPT-2 block also calls add_to (the
    residual add in the epilogue) and normed (the LayerNorm before the layer,
    folded into a copy of its weights by fold_norm).
    """

    weight_is_kn = True

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        self.triton_linear = False
        self.pdl = True
        self.folded_norm = None  # fold_norm's

    def forward(
        self, x: torch.Tensor, activation: str = "none"
    ) -> torch.Tensor:  # [T, in_features] -> [T, out_features]
        tile = self.triton_tile(x.shape[0])
        if tile is not None:
            return linear(
                x, self.weight, self.bias, weight_is_kn=True, activation=activation, tile=tile,
                pdl=self.pdl,
            )  # fmt: skip
        if self.triton_linear and activation == "gelu_tanh":
            # cuBLASLt's bias + tanh-GELU epilogue, one kernel
            return torch._addmm_activation(self.bias, x, self.weight, use_gelu=True)
        y = torch.addmm(self.bias, x, self.weight)
        return gelu_tanh_fused(y) if activation == "gelu_tanh" else y

    def fold_norm(self, norm: nn.LayerNorm) -> None:
        """Fold the LayerNorm before this layer into a copy of its weights (for normed)."""
        self.folded_norm = fold_layer_norm(norm.weight, norm.bias, norm.eps, self.weight, self.bias)


class Linear(Projection, nn.Linear):
    """nn.Linear (weight [out_features, in_features]) for the Llama family's projections.

    With `triton_linear` set (use_triton_linear: the fused path in fp16 / bf16) a
    batch that kernels.linear's [N, K] tile table covers (decode sizes) runs that
    kernel, which joins the decode step's launch overlap; other batches and the
    torch path run F.linear. Such a batch's block also runs add_to and normed, the
    RMSNorm before the layer folded into its weight (fold_norm, in place).
    """

    weight_is_kn = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        self.triton_linear = False
        self.pdl = True
        self.folded_norm = None  # fold_norm's

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        tile = self.triton_tile(x.shape[0]) if x.dim() == 2 else None
        if tile is None:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, weight_is_kn=False, tile=tile, pdl=self.pdl)

    def fold_norm(self, norm: RMSNorm) -> None:
        """Fold the RMSNorm before this layer into this layer's weight, in place, and set
        the norm's weight to ones. Both paths then compute rms_norm(x) @ (gamma * W).T:
        normed from the residual's statistics, and forward after the (now plain) norm.
        No copy of W is kept; folding again folds the new gamma (ones after a fold)."""
        folded = fold_rms_norm(norm.weight, norm.eps, self.weight, self.bias, weight_is_kn=False)
        self.weight.copy_(folded.weight)
        norm.weight.fill_(1.0)
        self.folded_norm = dataclasses.replace(folded, weight=self.weight)


def use_triton_linear(module: nn.Module, pdl: bool = True) -> None:
    """Every Conv1D and Linear in module runs kernels.linear for the batches its tile
    table covers, launched with PDL where pdl (kernels.pdl)."""
    for layer in module.modules():
        if isinstance(layer, Conv1D | Linear):
            layer.triton_linear = True
            layer.pdl = pdl


def uses_triton_linear(module: nn.Module) -> bool:
    """Whether use_triton_linear was applied: some Conv1D or Linear in module runs
    kernels.linear."""
    return any(isinstance(m, Conv1D | Linear) and m.triton_linear for m in module.modules())


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as HF's NewGELUActivation so float32 results match bit for bit."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def gelu_tanh_fused(x: torch.Tensor) -> torch.Tensor:
    """The same tanh GELU in one kernel (CUDA path; not bitwise equal to gelu_new)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


class LMHead(nn.Module):
    """Logits over the vocabulary from the final hidden states.

    Torch path: float32 logits, as HF computes them. Fused path: the weight is
    copied with its rows padded to a multiple of 64, so that the GEMM gets an
    aligned kernel (an odd vocabulary such as GPT-2's 50257 otherwise falls to a
    slow unaligned one), and logits stay in the model dtype: argmax is the same,
    and the sampler upcasts where it computes probabilities.
    """

    PAD_ROWS_TO = 64

    def __init__(self, weight: torch.Tensor, vocab_size: int, fused: bool) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.fused = fused
        if fused:
            rows = -(-vocab_size // self.PAD_ROWS_TO) * self.PAD_ROWS_TO
            padded = weight.new_zeros(rows, weight.shape[1])
            padded[:vocab_size] = weight
            weight = padded
        self.weight = weight  # a plain attribute: finalize() runs after weight loading

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = torch.nn.functional.linear(hidden, self.weight)
        return logits[:, : self.vocab_size] if self.fused else logits.float()
