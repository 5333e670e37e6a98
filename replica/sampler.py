"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as device tensors, for one step's logits."""

    temperatures: torch.Tensor  # [N] float32; 0 means greedy
    top_ks: torch.Tensor  # [N] int64; vocab size when disabled
    top_ps: torch.Tensor  # [N] float32
    generators: list[torch.Generator | None]  # a seeded request's own generator, else None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def greedy(cls) -> SamplingBatch:
        none = torch.empty(0)
        return cls(none, none, none, [], all_greedy=True, any_top_k=False, any_top_p=False)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        if all(p.greedy for p in params):
            return cls.greedy()
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], device=device),
            top_ks=torch.tensor(top_ks, device=device),
            top_ps=torch.tensor([p.top_p for p in params], device=device),
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(k < vocab_size for k in top_ks),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )


def sample(
    logits: torch.Tensor,  # [N, vocab], float32 or the model dtype (upcast where needed)
    batch: SamplingBatch,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:  # [N] int64
    """Sample one token per row.

    Greedy rows take the argmax (first index on ties, as transformers does).
    Others sample from softmax(logits / T) restricted by top-k then top-p, via
    the exponential race argmax(p / E), E ~ Exp(1): a seeded row draws E from
    its own generator, so its tokens do not depend on its batch neighbours.
    """
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    temps = batch.temperatures.clamp_min(1e-5).unsqueeze(1)
    logits = logits / temps
    if batch.any_top_k or batch.any_top_p:
        logits = _apply_top_k_top_p(logits, batch)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperatures == 0, greedy_tokens, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, vocab]
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= batch.top_ks.unsqueeze(1)
    if batch.any_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep the token that crosses top_p
        drop |= mass_before >= batch.top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
