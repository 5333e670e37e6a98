"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Two implementations, chosen once by the model runner. On CUDA, `sample_fused`:
kernels.sampling's launches (rejection rounds over the logits, no sort; each top-k
row's k-th logit bisected among the few logits above a lower bound), with per-request
seeds as Philox keys. On the CPU, `sample`: torch ops (a sort for top-k / top-p, the
exponential race), a seeded request drawing from its own torch.Generator. Both sample
the same distribution; a seed reproduces a request's tokens on one device type,
whatever its batch neighbours.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from replica.sampling_params import SamplingParams

# The sampling graphs of a decode graph size, as (top_k, top_p): temperature alone (two
# launches, no softmax sum), top-p, and top-k (its bound, gather and floor launches;
# top-p rows or not).
GRAPH_KINDS = ((False, False), (False, True), (True, True))


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
        temps, top_ps, ks, any_top_k, any_top_p = _columns(params, vocab_size)
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
        ints = _packed(_philox(params, positions, step_key), torch.int64, pin)
        ints = ints.to(device, non_blocking=True)
        batch.keys, batch.bases = ints[0, :n], ints[1, :n]
        return batch


def _columns(
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
    top_ps = np.fromiter(map(_TOP_P, params), np.float64, n)
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


_TEMPERATURE = operator.attrgetter("temperature")
_TOP_P = operator.attrgetter("top_p")
_TOP_K = operator.attrgetter("top_k")


def _philox(
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


class GraphSamplingInputs:
    """Persistent device inputs of kernels.sampling over all of a decode forward's rows,
    for CUDA graphs of those launches per decode graph size (ModelRunner captures them): a
    sampled decode step then costs the host one copy and one replay, where the launches
    cost it ~0.2 ms (H200 host, BENCHMARKS.md).

    Per row, at offsets of whole 16 rows per field (so that every graph's views start
    aligned): the top_k (0: none), Philox key and base; the temperature and top_p. Each
    kind of graph (GRAPH_KINDS) leaves out the launches its batch does not need. Rows
    that sample nothing (padding, a mixed step's prompt chunks short of their end) are
    greedy."""

    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        device: torch.device,
        packed: torch.Tensor | None = None,  # [buffer_length(max_rows)] int64 on the device
        staging: list[torch.Tensor] | None = None,  # its two host copies, pinned
    ) -> None:
        """packed and staging: buffers a caller copies itself (ModelRunner: the decode
        inputs' sampling region, in the step's one copy; it then calls stage, not
        upload). Without them this allocates its own."""
        # One int64 buffer: the three int rows, then the two float32 rows (as half as many
        # int64s), each row whole 16 entries wide for a graph of max_rows.
        length = self.buffer_length(max_rows)
        if packed is None:
            packed = torch.zeros(length, dtype=torch.int64, device=device)
            # Host staging, two copies (ModelRunner's parity): a step's copy may still be
            # pending while the next step fills the other.
            pin = device.type == "cuda"
            staging = [torch.zeros(length, dtype=torch.int64, pin_memory=pin) for _ in "01"]
        elif staging is None or len(packed) < length or min(map(len, staging)) < length:
            raise ValueError(f"packed, staging: {length} int64s each, and both are needed")
        self.packed = packed
        self.staging = staging
        self.staging_np = [copy.numpy() for copy in self.staging]
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.vocab_size = vocab_size

    @staticmethod
    def buffer_length(max_rows: int) -> int:
        """The int64s of packed for graphs of up to max_rows rows (a multiple of 64)."""
        return _length(_width(max_rows))

    def sample(self, logits: torch.Tensor, top_k: bool, top_p: bool) -> torch.Tensor:
        """What a graph of kind (top_k, top_p) captures: tokens [rows] for the last upload
        of as many rows (logits [rows, vocab])."""
        rows = logits.shape[0]
        ints, floats = _views(self.packed, _width(rows))
        top_ks, keys, bases = ints[:, :rows]
        temps, top_ps = floats[:, :rows]
        tokens = self.tokens[:rows]
        return kernels.sample_tokens(
            logits, temps, top_ks, top_ps, keys, bases, tokens, any_top_p=top_p, any_top_k=top_k
        )

    def upload(
        self,
        params: list[SamplingParams],
        positions: list[int],
        step_key: int,
        rows: int,  # the forward's rows (its graph's size)
        first: int,  # params are rows [first, first + len(params))
        parity: int = 0,  # which staging copy (the step's; see __init__)
    ) -> tuple[bool, bool]:
        """stage, then one copy from pinned memory, not waited for (as
        SamplingBatch.build's). Returns stage's kind."""
        kind = self.stage(params, positions, step_key, rows, first, parity)
        length = _length(_width(rows))
        self.packed[:length].copy_(self.staging[parity][:length], non_blocking=True)
        return kind

    def stage(
        self,
        params: list[SamplingParams],
        positions: list[int],
        step_key: int,
        rows: int,
        first: int,
        parity: int = 0,
    ) -> tuple[bool, bool]:
        """upload's staging alone, for a caller whose own copy carries it. Returns which
        graph samples these rows: its kind in GRAPH_KINDS."""
        temps, top_ps, ks, top_k, top_p = _columns(params, self.vocab_size)
        width = _width(rows)
        length = _length(width)
        host = self.staging_np[parity][:length]
        host[:] = 0
        ints, floats = _views(host, width)
        span = slice(first, first + len(params))
        ints[0, span] = ks
        ints[1:, span] = _philox(params, positions, step_key)
        floats[0, span] = temps
        floats[1, span] = top_ps
        return top_k, top_k or top_p


def _width(rows: int) -> int:
    return -(-rows // 16) * 16


def _length(width: int) -> int:
    return 3 * width + width  # int64s: three int rows, two float32 rows


def _views(packed: torch.Tensor | np.ndarray, width: int) -> tuple:
    """(ints [3, width], floats [2, width]) of a packed buffer, torch or numpy, as one
    graph size lays them out."""
    ints = packed[: 3 * width].reshape(3, width)
    floats = packed[3 * width : _length(width)]
    floats = floats.view(torch.float32 if isinstance(packed, torch.Tensor) else np.float32)
    return ints, floats.reshape(2, width)
