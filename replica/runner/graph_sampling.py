"""GraphSamplingInputs: the sampling graphs' persistent inputs, staged in a step's one copy.

A decode (or mixed) step whose rows sample (temperature, top-k, top-p) replays a
sampling graph after its forward's: kernels.sampling over the forward's logits, one
graph per graph size and kind (GRAPH_KINDS; replica.runner.graphs captures them). Its
parameters are staged here and ride in the step's copy, in a region of the decode
inputs' buffers (replica.runner.decode_inputs).
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from replica.runner.sampling_batch import param_columns, philox_inputs
from replica.sampling_params import SamplingParams

# The sampling graphs of a decode graph size, as (top_k, top_p): temperature alone (two
# launches, no softmax sum), top-p, and top-k (its bound, gather and floor launches;
# top-p rows or not).
GRAPH_KINDS = ((False, False), (False, True), (True, True))


class GraphSamplingInputs:
    """Persistent device inputs of kernels.sampling over all of a decode forward's rows,
    for CUDA graphs of those launches per decode graph size (ModelRunner captures them): a
    sampled decode step then costs the host one copy and one replay, where the launches
    cost it ~0.2 ms (H200 host).

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
        temps, top_ps, ks, top_k, top_p = param_columns(params, self.vocab_size)
        width = _width(rows)
        length = _length(width)
        host = self.staging_np[parity][:length]
        host[:] = 0
        ints, floats = _views(host, width)
        span = slice(first, first + len(params))
        ints[0, span] = ks
        ints[1:, span] = philox_inputs(params, positions, step_key)
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
