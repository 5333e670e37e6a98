"""What the engine hands back: per-step deltas and whole completions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprobs:
    """One token's log probability and the top ones at its position (log_softmax of the
    model's logits, before penalties, bias or temperature), most likely first."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def to_wire(self) -> list:
        return [self.token_id, self.logprob, list(self.top_ids), list(self.top_logprobs)]

    @classmethod
    def from_wire(cls, wire: list) -> Logprobs:
        token_id, logprob, top_ids, top_logprobs = wire
        return cls(token_id, logprob, tuple(top_ids), tuple(top_logprobs))


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request from one engine step (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" when finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (when finished)
    logprobs: list[Logprobs] | None = None  # per new token, when the request asks them
    # The prompt's, on the request's first output (entry 0 None: the first token has none)
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass(slots=True, eq=False)
class StepOutputs(Sequence[RequestOutput]):
    """One engine step's new tokens, as columns: request request_ids[i] got the one token
    token_ids[i]; finishes maps i to (finish_reason, num_prompt_tokens, num_cached_tokens)
    for the requests that ended on it.

    A sequence of RequestOutput deltas, each made when it is read: a serving loop reads
    the columns (cluster.engine_loop), since a RequestOutput per row at 256 rows was
    about a third of the host's work turning a step's tokens into outputs.
    """

    request_ids: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    finishes: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    # Only the rows whose request asked: row -> its token's Logprobs, and row -> the
    # request's prompt logprobs (entry 0 None), on the row that starts its output.
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[Logprobs | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, index):  # an int gives a RequestOutput, a slice a list of them
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        i = range(len(self))[index]  # IndexError as a list's
        end = self.finishes.get(i)
        if end is None:
            out = RequestOutput(self.request_ids[i], [self.token_ids[i]])
        else:
            out = RequestOutput(self.request_ids[i], [self.token_ids[i]], True, *end)
        if self.logprobs or self.prompt_logprobs:
            logprobs = self.logprobs.get(i)
            out.logprobs = None if logprobs is None else [logprobs]
            out.prompt_logprobs = self.prompt_logprobs.get(i)
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        return map(self.__getitem__, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepOutputs | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request, as LLMEngine.generate returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    logprobs: list[Logprobs] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[Logprobs | None] | None = None  # one per prompt token, when asked
