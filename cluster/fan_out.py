"""FanOut: the requests a replica's engine runs for its callers, and each engine step's
outputs cut into one StepBatch per caller (cluster.engine_loop runs it on the engine
thread, once a step: at 256 rows a step it is on the path of every token)."""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, KeysView, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.messages import ERROR_FINISH, StepBatch
from cluster.metrics import ReplicaMetrics
from replica.outputs import Logprobs, StepOutputs


@dataclass(slots=True)
class _Tracked:
    caller_id: str
    admitted_s: float
    num_prompt_tokens: int = 0
    first_token_s: float | None = None


_CALLER_ID = operator.attrgetter("caller_id")


def error_batches(requests: Iterable[tuple[str, str]]) -> dict[str, StepBatch]:
    """(request id, caller id) pairs of requests an engine failure ends: one StepBatch
    per caller, each request finished with ERROR_FINISH and no tokens."""
    per_caller: dict[str, StepBatch] = {}
    for request_id, caller_id in requests:
        per_caller.setdefault(caller_id, StepBatch()).add(request_id, [], ERROR_FINISH)
    return per_caller


class FanOut:
    """Which caller each tracked request belongs to; a step's outputs as StepBatches.

    An LLMEngine's StepOutputs (one token a row) goes by its columns: a caller's batch
    is sliced from them, and only the rows that start a request's output (its TTFT,
    and an urgent batch) or end it (its TPOT, and it is no longer tracked) are visited
    one by one. Any other engine's outputs (RequestOutputs: test and bench engines),
    and a step holding a row whose request is no longer tracked (aborted after its step
    launched: its final delta is already sent), go row by row, to the same batches.

    Invariant: a tracked request leaves by exactly one of a finish in a step, untrack
    (abort: an abort counted as such) or fail_all. With metrics (cluster.metrics), a step
    counts its tokens and its rows past a request's first at once, and only the rows
    that start or end a request are measured one by one; tokens are counted per request
    only with metrics (TPOT).
    """

    def __init__(self, metrics: ReplicaMetrics | None = None) -> None:
        self._metrics = metrics
        self._tracked: dict[str, _Tracked] = {}
        self._awaiting_first: set[str] = set()  # tracked, no token delivered yet
        self._num_tokens: collections.Counter[str] = collections.Counter()
        self._num_tracked: collections.Counter[str] = collections.Counter()  # per caller

    @property
    def tracked_ids(self) -> KeysView[str]:
        return self._tracked.keys()

    @property
    def awaiting_first(self) -> frozenset[str]:
        return frozenset(self._awaiting_first)

    def num_tokens(self, request_id: str) -> int:
        """Tokens delivered to a tracked request so far (counted only with metrics)."""
        return self._num_tokens[request_id]

    def track(
        self, request_id: str, caller_id: str, admitted_s: float, num_prompt_tokens: int = 0
    ) -> None:
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already tracked")
        self._tracked[request_id] = _Tracked(caller_id, admitted_s, num_prompt_tokens)
        self._awaiting_first.add(request_id)
        self._num_tracked[caller_id] += 1

    def untrack(self, request_id: str) -> str | None:
        """Stop tracking a request (an abort); its caller, or None if it was not tracked."""
        tracked = self._tracked.pop(request_id, None)
        self._awaiting_first.discard(request_id)
        self._num_tokens.pop(request_id, None)
        if tracked is None:
            return None
        if self._num_tracked[tracked.caller_id] == 1:
            del self._num_tracked[tracked.caller_id]
        else:
            self._num_tracked[tracked.caller_id] -= 1
        return tracked.caller_id

    def abort(self, request_id: str) -> str | None:
        """untrack, counting the request as aborted when it was tracked."""
        caller_id = self.untrack(request_id)
        if caller_id is not None and self._metrics is not None:
            self._metrics.count_ended("abort")
        return caller_id

    def fail_all(self) -> dict[str, StepBatch]:
        """End every tracked request with ERROR_FINISH: one batch per caller."""
        ended = error_batches((rid, t.caller_id) for rid, t in self._tracked.items())
        if self._metrics is not None and self._tracked:
            self._metrics.count_ended(ERROR_FINISH, len(self._tracked))
        self._tracked.clear()
        self._awaiting_first.clear()
        self._num_tokens.clear()
        self._num_tracked.clear()
        return ended

    def step(self, outputs: Sequence[Any], now_s: float) -> dict[str, StepBatch]:
        """One StepBatch per caller with output in this step (now_s: time.monotonic())."""
        batches = None
        if isinstance(outputs, StepOutputs):
            batches = self._column_batches(outputs, now_s)
        if batches is None:
            batches = self._row_batches(_rows(outputs), now_s)
        return batches

    def _column_batches(self, outputs: StepOutputs, now_s: float) -> dict[str, StepBatch] | None:
        request_ids, token_ids, ends = outputs.request_ids, outputs.token_ids, outputs.finishes
        if outputs.logprobs or outputs.prompt_logprobs:  # rows that asked: row by row
            return None
        if not all(map(self._tracked.__contains__, request_ids)):
            return None
        if not request_ids:
            return {}
        firsts = self._awaiting_first.intersection(request_ids) if self._awaiting_first else set()
        if self._metrics is not None:
            self._num_tokens.update(request_ids)
            self._metrics.observe_step(now_s, len(request_ids), len(request_ids) - len(firsts))
        batches: dict[str, StepBatch] = {}
        if len(self._num_tracked) == 1:  # every request here is one caller's
            finishes = [(i, ends[i][0]) for i in sorted(ends)]
            rows = [1] * len(request_ids)
            (caller_id,) = self._num_tracked
            batches[caller_id] = StepBatch(list(request_ids), rows, list(token_ids), finishes)
        else:
            groups: dict[str, list[int]] = {}
            trackeds = map(self._tracked.__getitem__, request_ids)
            for i, caller_id in enumerate(map(_CALLER_ID, trackeds)):
                groups.setdefault(caller_id, []).append(i)
            for caller_id, rows in groups.items():
                finishes = [(k, ends[i][0]) for k, i in enumerate(rows) if i in ends]
                batches[caller_id] = StepBatch(
                    [request_ids[i] for i in rows], [1] * len(rows),
                    [token_ids[i] for i in rows], finishes,
                )  # fmt: skip
        for batch in batches.values():
            batch.urgent = bool(batch.finishes) or not firsts.isdisjoint(batch.request_ids)
        for request_id in firsts:
            self._first_token(request_id, now_s)
        for i, end in ends.items():
            self._finished(request_ids[i], now_s, end[0])
        return batches

    def _row_batches(self, rows: Iterable[_Row], now_s: float) -> dict[str, StepBatch]:
        batches: dict[str, StepBatch] = {}
        num_tokens = num_continuing = 0
        for request_id, token_ids, finish_reason, logprobs, prompt_logprobs in rows:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # aborted: its final delta is already sent
            if not token_ids and finish_reason is None:
                continue  # e.g. a prefill chunk: nothing for the caller yet
            first = request_id in self._awaiting_first
            if first and token_ids:
                self._first_token(request_id, now_s)
            if self._metrics is not None:
                self._num_tokens[request_id] += len(token_ids)
                num_tokens += len(token_ids)
                num_continuing += bool(token_ids) and not first
            batch = batches.get(tracked.caller_id)
            if batch is None:
                batch = batches[tracked.caller_id] = StepBatch()
            batch.add(request_id, token_ids, finish_reason, first, logprobs, prompt_logprobs)
            if finish_reason is not None:
                self._finished(request_id, now_s, finish_reason)
        if num_tokens:
            self._metrics.observe_step(now_s, num_tokens, num_continuing)
        return batches

    def _first_token(self, request_id: str, now_s: float) -> None:
        """A tracked request's first token is out: its TTFT."""
        self._awaiting_first.discard(request_id)
        tracked = self._tracked[request_id]
        tracked.first_token_s = now_s
        if self._metrics is not None:
            self._metrics.observe_first_token(now_s - tracked.admitted_s, tracked.num_prompt_tokens)

    def _finished(self, request_id: str, now_s: float, reason: str) -> None:
        """A tracked request ended on the engine: its latencies, and it is no longer
        tracked."""
        tracked = self._tracked[request_id]
        num_tokens = self._num_tokens[request_id]
        self.untrack(request_id)
        if self._metrics is not None:
            tpot_s = None
            if num_tokens > 1 and tracked.first_token_s is not None:
                tpot_s = (now_s - tracked.first_token_s) / (num_tokens - 1)
            self._metrics.observe_finish(reason, now_s - tracked.admitted_s, tpot_s)


# (request id, new token ids, finish reason or None, their logprobs, the prompt's)
_Row = tuple[str, list[int], str | None, list[Logprobs] | None, list[Logprobs | None] | None]


def _rows(outputs: Sequence[Any]) -> Iterable[_Row]:
    """One _Row per output of a step: a StepOutputs by its columns, else each
    RequestOutput's fields (test and bench engines)."""
    if isinstance(outputs, StepOutputs):
        ends, logprobs = outputs.finishes, outputs.logprobs
        prompt_logprobs = outputs.prompt_logprobs
        return (
            (
                request_id,
                [token],
                ends[i][0] if i in ends else None,
                [logprobs[i]] if i in logprobs else None,
                prompt_logprobs.get(i),
            )  # fmt: skip
            for i, (request_id, token) in enumerate(
                zip(outputs.request_ids, outputs.token_ids, strict=True)
            )
        )
    return (
        (
            out.request_id,
            out.new_token_ids,
            (out.finish_reason or "stop") if out.finished else None,
            getattr(out, "logprobs", None),
            getattr(out, "prompt_logprobs", None),
        )  # fmt: skip
        for out in outputs
    )
