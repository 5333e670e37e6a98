"""Which forward each of a scheduled batch's sequences runs in, and whether a prefill
forward samples.

A step makes one pass over the weights where it can: a mixed step (prompt tokens at
most mixed_prefill_tokens) runs its prompt chunks as rows of the decode forward, and a
step with longer chunks runs its decode sequences as one-token chunks of the prefill
forward (EngineOptions.decode_in_prefill). Invariant: the sampling order stays the
scheduler's, prompt chunks that complete their prompt, then decode sequences; that is
the order of the tokens a step's handle yields.
"""

from __future__ import annotations

from replica.scheduler import ScheduledBatch
from replica.sequence import Sequence


def arrange(
    batch: ScheduledBatch, mixed_prefill_tokens: int, decode_in_prefill: bool
) -> tuple[list[Sequence], list[int], list[Sequence], bool]:
    """The step's prompt chunks and decode sequences, and whether it is mixed: its
    prompt tokens (at most mixed_prefill_tokens) ride in the decode forward."""
    num_prefill = sum(batch.prefill_lens)
    mixed = 0 < num_prefill <= mixed_prefill_tokens
    prefill_seqs, prefill_lens = batch.prefill_seqs, batch.prefill_lens
    decode_seqs = batch.decode_seqs
    if prefill_seqs and not mixed and decode_seqs and decode_in_prefill:
        # Each decode sequence's newest token (its num_computed_tokens is one short) is
        # a chunk of one that completes it, after the prompt chunks: the sampling order
        # stays prompt chunks that complete, then decode sequences.
        prefill_seqs = prefill_seqs + decode_seqs
        prefill_lens = prefill_lens + [1] * len(decode_seqs)
        decode_seqs = []
    return prefill_seqs, prefill_lens, decode_seqs, mixed


def completes_any(batch: ScheduledBatch) -> bool:
    """Whether a prompt chunk of the batch reaches its sequence's last token (samples)."""
    return any(
        s.num_computed_tokens + n == len(s.token_ids)
        for s, n in zip(batch.prefill_seqs, batch.prefill_lens, strict=True)
    )
