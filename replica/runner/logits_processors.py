"""Logits processors: penalties, logit_bias and min_tokens over a step's extras rows.

The host does not know a decode row's newest token (a PLACEHOLDER while the step before
runs), so the output-token counts the penalties read live on the device: one row of
`counts` per request with a presence, frequency or repetition penalty (and, for
repetition, one row of `prompt_mask`), handed out on the request's first sampled step
and freed by release (finish, abort). Each step that samples such a request adds its
sampled token to its row there, right after sampling, so the next step's penalties see
it whether or not the host has. A preempted request keeps its row: its counts stay right
while it is recomputed.

Order, per row (as vLLM's): repetition, frequency and presence penalties, then
logit_bias, then min_tokens' mask of the stop tokens:
    repetition r: a token seen in the prompt or the output: logit / r if > 0 else logit * r
    frequency f:  logit -= f * count
    presence p:   logit -= p * (count > 0)
    logit_bias:   logit += bias
    min_tokens:   a stop token's logit = -inf while fewer than min_tokens tokens are out
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels
from kernels.reference import apply_penalties_ref
from replica.sequence import Sequence


@dataclass
class ProcessorStep:
    """One step's processor inputs for its extras rows: numpy arrays as prepare makes
    them, device tensors once on_device has their uploaded copies. The rows with
    penalties come first (prepare's seqs are so ordered), so that apply reads them as
    a slice of the logits, not a gather and a scatter. Token positions are flat
    (row * vocab + token id): each is one index_add_ / index_fill_ launch, where a
    (rows, ids) index_put_ that accumulates sorts its indices first on CUDA."""

    num_penalty_rows: int  # P: rows 0..P-1 have penalty state
    penalty_state: Any  # [2, P] int64: their rows of counts / prompt_mask; those * vocab
    penalties: Any  # [3, P] float32: repetition, frequency, presence
    any_repetition: bool
    bias_at: Any  # [B] int64: flat positions in the step's [E, vocab] logits
    bias_values: Any  # [B] float32
    masked_at: Any  # [M] int64: flat positions set to -inf
    prompt_at: Any  # [Q] int64: flat positions in prompt_mask of new rows' prompt tokens

    def arrays(self) -> list[np.ndarray]:
        """The inputs that are present, in on_device's order."""
        fields = (self.penalty_state, self.penalties, self.bias_at, self.bias_values,
                  self.masked_at, self.prompt_at)  # fmt: skip
        return [a for a in fields if a is not None]

    def on_device(self, tensors: Iterator[torch.Tensor]) -> ProcessorStep:
        """This step with its arrays replaced by tensors (their uploads, in arrays' order)."""
        take = lambda a: None if a is None else next(tensors)  # noqa: E731
        return ProcessorStep(
            self.num_penalty_rows, take(self.penalty_state), take(self.penalties),
            self.any_repetition, take(self.bias_at), take(self.bias_values),
            take(self.masked_at), take(self.prompt_at),
        )  # fmt: skip


def has_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class LogitsProcessors:
    """The penalties' device state and the processors over a step's extras rows.

    Invariant: a request holds at most one state row, from its first sampled step until
    release; its counts row counts every token sampled for it since (placeholders
    included). capacity rows at start; more are added (doubling) when preempted
    requests holding rows and running ones together need them.
    """

    def __init__(
        self, capacity: int, vocab_size: int, device: torch.device, fused: bool = False
    ) -> None:
        """fused: the penalties by kernels.apply_penalties (the graph path: CUDA, or the CPU
        emulating it under Triton's interpreter), else by its torch reference."""
        self.vocab_size = vocab_size
        self.device = device
        self.fused = fused
        # [capacity, vocab] int32 output-token counts; [capacity, vocab] prompt tokens seen
        self.counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=device)
        self.free_rows = list(range(capacity - 1, -1, -1))
        self.rows: dict[str, int] = {}  # request id -> its state row
        # What record adds, made once (a fresh tensor a step is a launch): a step has at
        # most max_num_seqs (the initial capacity) rows with penalties.
        self.ones = torch.ones(capacity, dtype=torch.int32, device=device)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def prepare(self, seqs: list[Sequence]) -> ProcessorStep:
        """The processors' inputs (on the host) for a step whose extras rows are seqs, in
        order, those with penalties first; hands state rows to the requests with
        penalties that have none yet."""
        vocab = self.vocab_size
        state, values, prompt_at = [], [], []
        bias_at, bias_values, masked_at = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if has_penalties(seq):
                if len(state) != i:
                    raise ValueError("seqs: the rows with penalties must come first")
                state.append(self._state_row(seq, prompt_at))
                values.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            for token, bias in p.logit_bias:  # a dict's: one entry per token
                bias_at.append(i * vocab + token)
                bias_values.append(bias)
            # Tokens out so far, the one in flight (a PLACEHOLDER) included: this step
            # samples the next one.
            if len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
                masked_at += (
                    i * vocab + t for t in seq.stop_ids if t < vocab
                )  # others: never sampled
        state_rows = np.array(state, np.int64)
        return ProcessorStep(
            len(state),
            np.stack([state_rows, state_rows * vocab]) if state else None,
            np.array(values, np.float32).T.copy() if state else None,
            any(v[0] != 1.0 for v in values),
            np.array(bias_at, np.int64) if bias_at else None,
            np.array(bias_values, np.float32) if bias_at else None,
            np.array(masked_at, np.int64) if masked_at else None,
            np.concatenate(prompt_at) if prompt_at else None,
        )

    def apply(self, logits: torch.Tensor, step: ProcessorStep) -> None:
        """Process the extras rows' logits [E, vocab] (float32, contiguous) in place (step
        on the device)."""
        if step.prompt_at is not None:  # after prepare's zero_ of the new rows
            self.prompt_mask.view(-1).index_fill_(0, step.prompt_at, True)
        if step.num_penalty_rows:
            # One Triton launch on the graph path (kernels.penalties: ~12 torch launches
            # and passes over [P, vocab] fused); the same arithmetic in torch otherwise.
            apply = kernels.apply_penalties if self.fused else apply_penalties_ref
            apply(logits, self.counts, self.prompt_mask, step.penalty_state[0],
                  step.penalties, step.any_repetition)  # fmt: skip
        flat = logits.view(-1)
        if step.bias_at is not None:
            flat.index_add_(0, step.bias_at, step.bias_values)
        if step.masked_at is not None:
            flat.index_fill_(0, step.masked_at, float("-inf"))

    def record(self, tokens: torch.Tensor, step: ProcessorStep) -> None:
        """Count the step's sampled tokens (tokens [E] int64, the extras rows') in their
        requests' state rows, on the device."""
        num_rows = step.num_penalty_rows
        if num_rows:
            at = step.penalty_state[1] + tokens[:num_rows]  # flat positions in counts
            self.counts.view(-1).index_add_(0, at, self.ones[:num_rows])

    def _state_row(self, seq: Sequence, prompt_at: list[np.ndarray]) -> int:
        """seq's state row; a new one is zeroed, and its prompt tokens' flat positions in
        prompt_mask (repetition) added to prompt_at for apply to set: a pageable copy of
        the ids here would hold the host until the device finished the queued forward."""
        row = self.rows.get(seq.request_id)
        if row is not None:
            return row
        if not self.free_rows:
            self._grow()
        row = self.rows[seq.request_id] = self.free_rows.pop()
        # Ordered after any step still using the row's last owner (one stream).
        self.counts[row].zero_()
        self.prompt_mask[row].zero_()
        if seq.params.repetition_penalty != 1.0:
            prompt_at.append(row * self.vocab_size + seq.prompt_ids.astype(np.int64))
        return row

    def _grow(self) -> None:
        capacity = len(self.counts)
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.free_rows += range(2 * capacity - 1, capacity - 1, -1)
