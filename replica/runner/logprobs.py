"""Logprobs of a step's rows and of prompt positions: on the device, then to the host.

Every logprob here is log_softmax (float32) of the model's raw logits: before
penalties, logit_bias, min_tokens and temperature (a processed row's logprobs are
those of the model, not of the distribution it sampled from). Each row's are packed as
one float32 row [1 + 2k]: the target token's logprob, the top k logprobs (most likely
first) and their ids (exact in float32: vocabularies are far below 2**24), so that a
step's logprobs take one copy to the host, beside its tokens, under the same event.

Prompt logprobs (prompt_logprobs = k): for each prompt position p >= 1, the logprob of
prompt token p given the tokens before it, read from the logits at position p - 1. A
chunked prompt's parts accumulate over its steps (PromptLogprobs) and go out with the
request's first output token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from replica.outputs import Logprobs
from replica.sequence import Sequence


def packed_logprobs(
    logits: torch.Tensor,  # [L, vocab], the model's raw logits
    targets: torch.Tensor,  # [L] int64: each row's token
    k: int,  # top logprobs per row
) -> torch.Tensor:  # [L, 1 + 2k] float32
    """Each row's target logprob, then its top k logprobs and their ids."""
    return pack(torch.log_softmax(logits.float(), dim=-1), targets, k)


def pack(
    logprobs: torch.Tensor,  # [L, vocab] float32: log_softmax of the raw logits
    targets: torch.Tensor,  # [L] int64
    k: int,
    top_ids: torch.Tensor | None = None,  # [L, >= k] int64: each row's top ids, if known
) -> torch.Tensor:  # [L, 1 + 2k] float32
    """packed_logprobs of logprobs already taken (and of the top ids, if given: log_softmax
    keeps the logits' order, so a caller may rank the raw logits, in the model's dtype)."""
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    if k == 0:
        return chosen
    if top_ids is None:
        top_ids = logprobs.topk(k, dim=-1).indices
    top_ids = top_ids[:, :k]
    return torch.cat([chosen, logprobs.gather(1, top_ids), top_ids.float()], dim=1)


def unpack(row: list[float], token_id: int, k: int, width: int) -> Logprobs:
    """A row packed with width top entries (packed_logprobs' k) as Logprobs of its top k."""
    ids = tuple(int(t) for t in row[1 + width : 1 + width + k])
    return Logprobs(token_id, row[0], ids, tuple(row[1 : 1 + k]))


def to_host(values: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host (pinned, not waited for: the step's event covers it)."""
    if values.device.type == "cpu":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def prompt_spans(seqs: list[Sequence], lens: list[int]) -> Iterator[tuple[int, Sequence, int, int]]:
    """(i, seqs[i], first, end) for each chunk whose logits at positions [first, end)
    give prompt logprobs: a request asking them, with no output yet (a request
    recomputed after preemption had them delivered), at positions q whose next token
    q + 1 is a prompt token."""
    for i, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
        if seq.params.prompt_logprobs is None or len(seq.token_ids) > seq.num_prompt_tokens:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)
        if end > start or start == 0:
            yield i, seq, start, end


@dataclass
class PromptPart:
    """The prompt logprobs of positions [first, first + len(host)) of a request."""

    first: int
    host: torch.Tensor  # [Q, 1 + 2k] float32 (packed_logprobs)


class PromptLogprobs:
    """Prompt logprobs per request, accumulated over its prompt's chunks."""

    def __init__(self) -> None:
        self.parts: dict[str, list[PromptPart]] = {}

    def add(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """logits [Q, vocab]: the raw logits at positions first..first + Q - 1. A chunk
        from position 0 starts over (the prompt is being recomputed)."""
        if first == 0:
            self.parts[seq.request_id] = []
        parts = self.parts.get(seq.request_id)
        if parts is None or not len(logits):
            return
        targets = torch.from_numpy(seq.prompt_ids[first + 1 : first + 1 + len(logits)])
        packed = packed_logprobs(logits, targets.to(logits.device), seq.params.prompt_logprobs)
        parts.append(PromptPart(first, to_host(packed)))

    def take(self, seq: Sequence) -> list[PromptPart] | None:
        """A request's parts, once its prompt is complete (None: it asked none, or they
        were delivered)."""
        return self.parts.pop(seq.request_id, None)

    def release(self, request_id: str) -> None:
        self.parts.pop(request_id, None)


@dataclass
class StepLogprobs:
    """A step's logprobs on their way to the host: its sampled rows' (rows, ks, host)
    and the prompt logprobs of the requests whose first token it samples."""

    rows: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    host: torch.Tensor | None = None  # [len(rows), 1 + 2 * max(ks)] float32
    prompts: dict[int, tuple[Sequence, list[PromptPart]]] = field(default_factory=dict)

    def outputs(
        self, tokens: list[int]
    ) -> tuple[dict[int, Logprobs], dict[int, list[Logprobs | None]]]:
        """(row -> its token's Logprobs, row -> its request's prompt logprobs), once the
        step's tokens are on the host."""
        sampled = {}
        if self.rows:
            values = self.host.tolist()
            width = max(self.ks)
            for row, k, packed in zip(self.rows, self.ks, values, strict=True):
                sampled[row] = unpack(packed, tokens[row], k, width)
        prompts = {}
        for row, (seq, parts) in self.prompts.items():
            k = seq.params.prompt_logprobs
            entries: list[Logprobs | None] = [None]  # the first prompt token has none
            for part in parts:
                ids = seq.prompt_ids[part.first + 1 : part.first + 1 + len(part.host)].tolist()
                entries += (unpack(p, t, k, k) for p, t in zip(part.host.tolist(), ids))
            prompts[row] = entries
        return sampled, prompts
