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

from replica.sequence import Sequence


@dataclass
class ProcessorStep:
    """One step's processor inputs for its extras rows: numpy arrays as prepare makes
    them, device tensors once on_device has their uploaded copies."""

    penalty_rows: Any  # [2, P] int64: the extras rows with penalty state; their state rows
    penalties: Any  # [3, P] float32: repetition, frequency, presence
    any_repetition: bool
    bias_index: Any  # [2, B] int64: rows, token ids
    bias_values: Any  # [B] float32
    masked: Any  # [2, M] int64: rows, token ids set to -inf

    def arrays(self) -> list[np.ndarray]:
        """The inputs that are present, in on_device's order."""
        fields = (self.penalty_rows, self.penalties, self.bias_index, self.bias_values, self.masked)
        return [a for a in fields if a is not None]

    def on_device(self, tensors: Iterator[torch.Tensor]) -> ProcessorStep:
        """This step with its arrays replaced by tensors (their uploads, in arrays' order)."""
        take = lambda a: None if a is None else next(tensors)  # noqa: E731
        return ProcessorStep(
            take(self.penalty_rows), take(self.penalties), self.any_repetition,
            take(self.bias_index), take(self.bias_values), take(self.masked),
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

    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # [capacity, vocab] int32 output-token counts; [capacity, vocab] prompt tokens seen
        self.counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=device)
        self.free_rows = list(range(capacity - 1, -1, -1))
        self.rows: dict[str, int] = {}  # request id -> its state row
        # Scalars that apply and record write, made once: a fresh one a step is a copy.
        self.neg_inf = torch.tensor(float("-inf"), device=device)
        self.one = torch.ones((), dtype=torch.int32, device=device)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def prepare(self, seqs: list[Sequence]) -> ProcessorStep:
        """The processors' inputs (on the host) for a step whose extras rows are seqs, in
        order; hands state rows to the requests with penalties that have none yet."""
        pen_idx, state, values = [], [], []
        bias_rows, bias_ids, bias_values = [], [], []
        mask_rows, mask_ids = [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if has_penalties(seq):
                pen_idx.append(i)
                state.append(self._state_row(seq))
                values.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            for token, bias in p.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(bias)
            # Tokens out so far, the one in flight (a PLACEHOLDER) included: this step
            # samples the next one.
            if len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
                for token in seq.stop_ids:
                    if token >= self.vocab_size:  # never sampled: nothing to mask
                        continue
                    mask_rows.append(i)
                    mask_ids.append(token)
        return ProcessorStep(
            np.array([pen_idx, state], np.int64) if pen_idx else None,
            np.array(values, np.float32).T.copy() if pen_idx else None,
            any(v[0] != 1.0 for v in values),
            np.array([bias_rows, bias_ids], np.int64) if bias_rows else None,
            np.array(bias_values, np.float32) if bias_rows else None,
            np.array([mask_rows, mask_ids], np.int64) if mask_rows else None,
        )

    def apply(self, logits: torch.Tensor, step: ProcessorStep) -> None:
        """Process the extras rows' logits [E, vocab] (float32) in place (step on the
        device)."""
        if step.penalty_rows is not None:
            pen_rows, state_rows = step.penalty_rows
            rows = logits.index_select(0, pen_rows)  # [P, vocab]
            counts = self.counts.index_select(0, state_rows)  # [P, vocab] int32
            seen = counts > 0
            repetition, frequency, presence = step.penalties.unsqueeze(2)  # each [P, 1]
            if step.any_repetition:
                seen_any = seen | self.prompt_mask.index_select(0, state_rows)
                penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
                rows = torch.where(seen_any, penalized, rows)
            rows = rows - frequency * counts - presence * seen
            logits.index_copy_(0, pen_rows, rows)
        if step.bias_index is not None:
            logits.index_put_(tuple(step.bias_index), step.bias_values, accumulate=True)
        if step.masked is not None:
            logits.index_put_(tuple(step.masked), self.neg_inf)

    def record(self, tokens: torch.Tensor, step: ProcessorStep) -> None:
        """Count the step's sampled tokens (tokens [E] int64, the extras rows') in their
        requests' state rows, on the device."""
        if step.penalty_rows is not None:
            pen_rows, state_rows = step.penalty_rows
            ids = tokens.index_select(0, pen_rows)
            self.counts.index_put_((state_rows, ids), self.one, accumulate=True)

    def _state_row(self, seq: Sequence) -> int:
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
            prompt = torch.from_numpy(seq.prompt_ids).to(self.device)
            self.prompt_mask[row, prompt] = True
        return row

    def _grow(self) -> None:
        capacity = len(self.counts)
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.free_rows += range(2 * capacity - 1, capacity - 1, -1)
