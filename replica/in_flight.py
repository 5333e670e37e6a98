"""InFlightStep: a launched step's sampling rows as columns, and drain's passes over them.

At 256 rows a step, what drain does per row is on the path of every token: it writes
each row's token in one Python pass and finds, in a few numpy passes over columns taken
at launch, the rows that may stop or whose block filled up; Python visits only those.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from replica.outputs import Logprobs, StepOutputs
from replica.runner.step_handle import StepHandle
from replica.sequence import MANY_STOPS, Sequence, SequenceStatus

_REQUEST_ID, _TOKEN_IDS, _STOP_TOKEN, _MAX_LEN = map(
    attrgetter, ("request_id", "token_ids", "stop_token", "max_len")
)


@dataclass
class InFlightStep:
    """A launched step: which sequences sample, where their tokens go, and the handle.

    Columns per sampling row, taken at launch: the index of each sequence's placeholder
    in its token_ids, its stop_token and its max_len.
    """

    seqs: list[Sequence]
    request_ids: tuple[str, ...]
    indices: np.ndarray  # [num_seqs] int64
    stops: np.ndarray  # [num_seqs] int64
    max_lens: np.ndarray  # [num_seqs] int64
    handle: StepHandle
    num_table_rows: int  # block-table rows copied to the device for this step
    num_ends: int  # LLMEngine.num_ends at launch: unchanged at drain, no row's sequence ended
    # Prompt tokens the step computes, and whether they filled its token budget (the
    # engine's prefill rate is measured on such steps: LLMEngine.stats).
    num_prefill_tokens: int = 0
    prefill_bound: bool = False

    @classmethod
    def launched(
        cls, seqs: list[Sequence], handle: StepHandle, num_table_rows: int, num_ends: int,
        last: InFlightStep | None,
    ) -> InFlightStep:  # fmt: skip
        """The step whose sampling rows are seqs, each with its placeholder appended.
        When seqs are the launch before's (last), in its order, each one token on (most
        decode steps), its columns are reused with each placeholder one further."""
        if last is not None and last.seqs == seqs:
            return cls(
                seqs, last.request_ids, last.indices + 1, last.stops, last.max_lens,
                handle, num_table_rows, num_ends,
            )  # fmt: skip
        n = len(seqs)
        return cls(
            seqs, tuple(map(_REQUEST_ID, seqs)),
            np.fromiter(map(len, map(_TOKEN_IDS, seqs)), np.int64, n) - 1,
            np.fromiter(map(_STOP_TOKEN, seqs), np.int64, n),
            np.fromiter(map(_MAX_LEN, seqs), np.int64, n),
            handle, num_table_rows, num_ends,
        )  # fmt: skip

    def write_tokens(self, tokens: list[int], all_live: bool) -> np.ndarray | None:
        """Each row's token over its placeholder. all_live: no sequence ended since the
        launch (LLMEngine.num_ends unchanged); else the rows of those that did (aborted,
        or stopped a step ago) take no token, and the live rows' mask is returned."""
        indices = self.indices.tolist()
        if all_live:
            for seq, index, token in zip(self.seqs, indices, tokens, strict=True):
                seq.token_ids[index] = token
            return None
        finished = SequenceStatus.FINISHED
        live = np.fromiter((s.status is not finished for s in self.seqs), bool, len(self.seqs))
        for seq, index, token in zip(self.seqs, indices, tokens, strict=True):
            if seq.status is not finished:
                seq.token_ids[index] = token
        return live

    def rows_to_check(
        self, tokens: list[int], live: np.ndarray | None, block_size: int
    ) -> tuple[list[int], list[int]]:
        """Rows that may stop (their stop token, one of several stop tokens, or max_len)
        and rows whose token filled a block, among the live rows."""
        ends_at = self.indices + 1
        check = np.asarray(tokens, dtype=np.int64) == self.stops
        check |= self.stops == MANY_STOPS
        check |= ends_at >= self.max_lens
        filled = ends_at % block_size == 0
        if live is not None:
            check &= live
            filled &= live
        return np.flatnonzero(check).tolist(), np.flatnonzero(filled).tolist()

    def outputs(
        self,
        tokens: list[int],
        ends: dict[int, tuple[str, int, int]],
        live: np.ndarray | None,
        logprobs: dict[int, Logprobs] | None = None,
        prompt_logprobs: dict[int, list[Logprobs | None]] | None = None,
    ) -> StepOutputs:
        """The step's StepOutputs: its live rows, ends and logprobs keyed by row (the
        rows of sequences that ended before drop theirs too)."""
        logprobs, prompt_logprobs = logprobs or {}, prompt_logprobs or {}
        if live is None:
            return StepOutputs(self.request_ids, tokens, ends, logprobs, prompt_logprobs)
        rows = np.flatnonzero(live).tolist()
        ends = {j: ends[i] for j, i in enumerate(rows) if i in ends}
        if logprobs or prompt_logprobs:
            logprobs = {j: logprobs[i] for j, i in enumerate(rows) if i in logprobs}
            prompt_logprobs = {
                j: prompt_logprobs[i] for j, i in enumerate(rows) if i in prompt_logprobs
            }
        return StepOutputs(
            [self.request_ids[i] for i in rows], [tokens[i] for i in rows], ends, logprobs,
            prompt_logprobs,
        )  # fmt: skip
