"""What the engine hands back: per-step deltas and whole completions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request from one engine step (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" when finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (when finished)


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request, as LLMEngine.generate returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
