"""The engine's Logprobs in OpenAI's two shapes, and best_of's choice of samples.

A token's text is the tokenizer's decoding of that token alone (a byte-level BPE piece
that is part of a multi-byte character decodes to U+FFFD, as OpenAI's does); a model
without a tokenizer names tokens "token_id:<id>", as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.client import Completion
from cluster.openai_api import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
)
from replica.outputs import Logprobs


def token_text(tokenizer: Any | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any | None,
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs | None],  # one per token; None: the prompt's first
    text_offset: int = 0,  # where the first token's text starts in the choice's text
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        tops = zip(lp.top_ids, lp.top_logprobs, strict=True)
        out.top_logprobs.append({token_text(tokenizer, t): v for t, v in tops})
    return out


def chat_logprobs(tokenizer: Any | None, logprobs: Sequence[Logprobs]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for lp in logprobs:
        first = top(lp.token_id, lp.logprob)
        tops = [top(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)


class Echo:
    """A prompt as `echo` puts it before its choices: its text and token ids."""

    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids

    @classmethod
    def of(cls, body: CompletionRequest, prompt: Any, tokenizer: Any) -> Echo:
        if isinstance(prompt, str):  # the Client encodes a text prompt the same way
            if tokenizer is None:
                raise ValueError("prompt: text prompts need a model with a tokenizer")
            return cls(prompt, list(tokenizer.encode(prompt)))
        return cls(tokenizer.decode(prompt) if tokenizer is not None else "", list(prompt))


def choice_logprobs(
    body: CompletionRequest,
    tokenizer: Any,
    echo: Echo | None,
    token_ids: list[int],
    logprobs: Any,
    prompt_logprobs: Any,
    text_offset: int = 0,
) -> CompletionLogprobs | None:
    """A choice's (or a streamed delta's) logprobs, the echoed prompt's first;
    text_offset: where its first token starts in the choice's text."""
    if body.logprobs is None:
        return None
    ids, lps = list(token_ids), list(logprobs or [])
    if echo is not None:
        ids, lps = echo.token_ids + ids, list(prompt_logprobs or []) + lps
    return completion_logprobs(tokenizer, ids, lps, text_offset)


def best_of(samples: list[Completion], n: int) -> list[Completion]:
    """The n samples with the highest cumulative logprob (ties: the earlier sample), in
    that order, as OpenAI's best_of returns them; all of them, in sample order, when
    there are n."""
    if len(samples) <= n:
        return samples
    ranked = sorted(samples, key=lambda c: -c.cumulative_logprob)  # type: ignore[operator]
    return ranked[:n]
