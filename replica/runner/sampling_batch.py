"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Two implementations, chosen once by the model runner (replica.runner.sampling). On
CUDA, `sample_fused`: kernels.sampling's launches (rejection rounds over the logits, no
sort; each top-k row's k-th logit bisected among the few logits above a lower bound),
with per-request seeds as Philox keys. On the CPU, `sample`: torch ops (a sort for
top-k / top-p, the exponential race), a seeded request drawing from its own
torch.Generator. Both sample the same distribution; a seed reproduces a request's
tokens on one device type, whatever its batch neighbours.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from replica.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as device tensors, for one step's logits."""

    temperatures: torch.Tensor  # [N] float32; 0 means greedy
    top_ks: torch.Tensor  # [N] int64; vocab size when disabled (top-k keeps ties at the k-th)
    top_ps: torch.Tensor  # [N] float32
    generators: list[torch.Generator | None]  # a seeded request's own generator, else None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # sample_fused's Philox inputs (build with positions); None for the torch path
    keys: torch.Tensor | None = None  # [N] int64: Philox keys
    bases: torch.Tensor | None = None  # [N] int64: Philox counter bases
    step_key: int | None = None  # the unseeded rows' Philox key (build with positions)

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
        temps, top_ps, ks, any_top_k, any_top_p = param_columns(params, vocab_size)
        top_ks = np.where(ks > 0, ks, vocab_size)
        # Copies from pinned memory, not waited for: the step's forward is already queued
        # ahead of them, and a blocking copy would hold the host until the device finished
        # that forward, so the host could not prepare the next step meanwhile. float32 holds
        # every top_k exactly (vocab sizes are far below 2**24).
        pin = device.type == "cuda"
        n = len(params)
        values = _packed([temps, top_ks, top_ps], torch.float32, pin).to(device, non_blocking=True)
        batch = cls(
            temperatures=values[0, :n],
            top_ks=values[1, :n].long(),
            top_ps=values[2, :n],
            generators=generators,
            all_greedy=False,
            any_top_k=any_top_k,
            any_top_p=any_top_p,
        )
        if positions is None:
            return batch
        ints = _packed(philox_inputs(params, positions, step_key), torch.int64, pin)
        ints = ints.to(device, non_blocking=True)
        batch.keys, batch.bases = ints[0, :n], ints[1, :n]
        batch.step_key = step_key
        return batch


def param_columns(
    params: list[SamplingParams], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool, bool]:
    """The rows' temperatures and top_ps (float64), each row's top-k filter (int64) and
    whether any row filters by top-k and by top-p, each field read once per row: the
    host builds these every sampled step, for up to max_num_seqs rows.

    A row's top-k filter is 0 for none: off (0 or -1), the whole vocabulary, or a greedy
    row (whose token is the argmax over the whole vocabulary, whatever its top_k). A
    greedy row's top_p changes nothing either."""
    n = len(params)
    temps = np.fromiter(map(_TEMPERATURE, params), np.float64, n)
    # float32 columns downstream: a top_p under float32's smallest normal (1.2e-38) would
    # become 0 there, dropping every token (each row then sampled token 0); clamped, the
    # most likely token is kept, as any top_p in (0, 1] keeps it.
    top_ps = np.maximum(np.fromiter(map(_TOP_P, params), np.float64, n), _FLOAT32_TINY)
    sampled = temps != 0.0  # SamplingParams.greedy is temperature == 0.0
    ks = np.fromiter(map(_TOP_K, params), np.int64, n)
    any_top_k = bool(ks.max(initial=0) > 0)
    if any_top_k:
        ks[~((ks > 0) & (ks < vocab_size) & sampled)] = 0
        any_top_k = bool(ks.any())
    else:
        ks[:] = 0  # (-1 is off too)
    any_top_p = bool(((top_ps < 1.0) & sampled).any())
    return temps, top_ps, ks, any_top_k, any_top_p


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_TEMPERATURE = operator.attrgetter("temperature")
_TOP_P = operator.attrgetter("top_p")
_TOP_K = operator.attrgetter("top_k")


def philox_inputs(
    params: list[SamplingParams], positions: list[int], step_key: int
) -> tuple[Sequence[int], Sequence[int]]:
    """Each row's Philox key and counter base: a seeded request's draws depend on its seed
    and its token's position alone; the others share the step's key, a range per row."""
    n = len(params)
    if len(positions) != n:
        raise ValueError(f"positions: {len(positions)} for {n} rows")
    if not any(map(_seeded, params)):  # the common case, without a loop over the rows
        return np.full(n, step_key, np.int64), np.arange(n, dtype=np.int64) << 32
    keys = [step_key if p.seed is None else p.seed for p in params]
    bases = [(row if p.seed is None else pos) << 32 for row, (p, pos) in
             enumerate(zip(params, positions))]  # fmt: skip
    return keys, bases


def _seeded(p: SamplingParams) -> bool:
    return p.seed is not None


def _packed(rows: Sequence[Sequence], dtype: torch.dtype, pin: bool) -> torch.Tensor:
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
    # top-k: below the k-th largest logit (its ties kept, as transformers' warper keeps them)
    kth = sorted_logits.gather(1, (batch.top_ks.clamp(1, logits.shape[1]) - 1).unsqueeze(1))
    drop = sorted_logits < kth
    if batch.any_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep the token that crosses top_p
        drop |= mass_before >= batch.top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_fused(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [N] int64
    """sample's distribution through kernels.sampling (batch built with positions); greedy
    rows take the first argmax."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    return kernels.sample_tokens(
        logits, batch.temperatures, batch.top_ks, batch.top_ps, batch.keys, batch.bases,
        tokens, any_top_p=batch.any_top_p, any_top_k=batch.any_top_k,
    )  # fmt: skip
