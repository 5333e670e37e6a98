"""Small layers shared by the models, numerically identical to their HF counterparts."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """LlamaRMSNorm: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden_size]
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in_features, out_features], y = b + x @ W."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_features] -> [T, out_features]
        return torch.addmm(self.bias, x, self.weight)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as HF's NewGELUActivation so float32 results match bit for bit."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )
