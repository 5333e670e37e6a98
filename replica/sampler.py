"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Two implementations, chosen once by the model runner. On CUDA, `sample_fused`:
kernels.sampling's launch (rejection rounds over the logits, no sort; top-k rows over
their torch.topk candidates), with per-request seeds as Philox keys. On the CPU,
`sample`: torch ops (a sort for top-k / top-p, the exponential race), a seeded request
drawing from its own torch.Generator. Both sample the same distribution; a seed
reproduces a request's tokens on one device type, whatever its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
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
    # sample_fused's inputs (build with positions; top_ks are its rows' limits); None for
    # the torch path
    keys: torch.Tensor | None = None  # [N] int64: Philox keys
    bases: torch.Tensor | None = None  # [N] int64: Philox counter bases
    top_k_rows: torch.Tensor | None = None  # rows sampling among their top_k (None: none)
    other_rows: torch.Tensor | None = None  # the others (greedy rows among them)
    max_top_k: int = 0

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
        positions: list[int] | None = None,
        step_key: int = 0,
    ) -> SamplingBatch:
        """positions (each row's token position) and step_key (the unseeded rows' Philox
        key, [0, 2**63)): also sample_fused's inputs."""
        if all(p.greedy for p in params):
            return cls.greedy()
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        # Copies from pinned memory, not waited for: the step's forward is already queued
        # ahead of them, and a blocking copy would hold the host until the device finished
        # that forward, so the host could not prepare the next step meanwhile. float32 holds
        # every top_k exactly (vocab sizes are far below 2**24).
        pin = device.type == "cuda"
        n = len(params)
        rows = [[p.temperature for p in params], top_ks, [p.top_p for p in params]]
        values = _packed(rows, torch.float32, pin).to(device, non_blocking=True)
        batch = cls(
            temperatures=values[0, :n],
            top_ks=values[1, :n].long(),
            top_ps=values[2, :n],
            generators=generators,
            all_greedy=False,
            any_top_k=any(k < vocab_size for k in top_ks),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )
        if positions is None:
            return batch
        # A seeded request's draws depend on its seed and its token's position alone.
        keys = [step_key if p.seed is None else p.seed for p in params]
        bases = [(row if p.seed is None else pos) << 32 for row, (p, pos) in
                 enumerate(zip(params, positions, strict=True))]  # fmt: skip
        top_k_rows = [i for i, (p, k) in enumerate(zip(params, top_ks)) if k < vocab_size and
                      not p.greedy]  # fmt: skip
        chosen = set(top_k_rows)
        other_rows = [i for i in range(n) if i not in chosen]
        ints = _packed([keys, bases, top_k_rows, other_rows], torch.int64, pin)
        ints = ints.to(device, non_blocking=True)
        batch.keys, batch.bases = ints[0, :n], ints[1, :n]
        if top_k_rows:
            batch.top_k_rows = ints[2, : len(top_k_rows)]
            batch.other_rows = ints[3, : len(other_rows)]
            batch.max_top_k = max(top_ks[i] for i in top_k_rows)
        return batch


def _packed(rows: list[list], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """rows as one [len(rows), width] tensor for one copy, each row zero-padded to a width
    of whole 16 bytes: every row a kernel reads starts 16-byte aligned, as Triton's
    compiled kernels assume (an unaligned one would compile a second kernel mid-serving)."""
    per_16_bytes = 16 // dtype.itemsize
    width = -(-max(map(len, rows)) // per_16_bytes) * per_16_bytes
    packed = torch.zeros((len(rows), width), dtype=dtype, pin_memory=pin)
    host = packed.numpy()  # filled through numpy: ~5x faster than torch.tensor(lists)
    for i, row in enumerate(rows):
        host[i, : len(row)] = row
    return packed


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


def sample_fused(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [N] int64
    """sample's distribution through kernels.sampling (batch built with positions): rows
    with a top_k sample among their torch.topk candidates, the others over the whole
    vocabulary; greedy rows take the first argmax."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    params = (batch.temperatures, batch.top_ks, batch.top_ps, batch.keys, batch.bases, tokens)
    if batch.top_k_rows is None:
        return kernels.sample_tokens(logits, *params)
    width = kernels.candidates_width(batch.max_top_k, logits.shape[1])
    values, ids = logits.index_select(0, batch.top_k_rows).topk(width, dim=-1)
    kernels.sample_tokens(values, *params, rows=batch.top_k_rows, ids=ids)
    return kernels.sample_tokens(logits, *params, rows=batch.other_rows)
