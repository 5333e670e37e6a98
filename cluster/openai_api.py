"""The OpenAI HTTP API's request and response bodies, as pydantic models.

Requests are validated strictly (no "5" for 5, no "yes" for true): a bad value is a
ValueError whose message names the field, which the ingress answers with a 400. Unknown
fields are kept aside (`ignored_fields`), not refused, as vLLM's server does, so that a
client sending a field this server does not know keeps working. What cannot be served
(`check_supported`: suffix, a streamed best_of) is refused naming the field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replica.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

# Pydantic's loc names a union member by its type ("stop", "list[str]", 0); a message
# names only the field path.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_message(error: ValidationError) -> str:
    """'field[0].sub: what is wrong' for each error, the field path first."""
    messages = []
    for e in error.errors():
        path = ""
        for part in e["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif "[" not in part and part not in _TYPE_TAGS:
                path += f".{part}" if path else part
        messages.append(f"{path or 'body'}: {e['msg']}")
    return "; ".join(dict.fromkeys(messages))


def parse(model: type[BaseModel], body: Any) -> Any:
    """model from a JSON body; ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ValueError(validation_message(exc)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # usage on every chunk


class _SamplingRequest(_Strict):
    """What completions and chat requests share."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None  # None: the room left in the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    # vLLM's: the request's prompt is cached apart from other salts' (replica.hashing).
    cache_salt: str | None = None

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")

    def sampling_params(
        self,
        max_tokens: int | None,
        n: int | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams (ValueError naming the field); OpenAI's temperature default is 1.
        n, logprobs, prompt_logprobs: what the route asks of the engine (best_of's
        samples, logprobs under the route's own field names)."""
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "ignore_eos": self.ignore_eos,
            "n": self.n if n is None else n,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": self.logit_bias or {},
        }
        for name in ("top_p", "top_k", "seed", "stop", "stop_token_ids", "cache_salt"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            fields[name] = getattr(self, name)
        return SamplingParams(**fields)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. prompt: a string, a token list, or a list of either (one
    choice per prompt)."""

    prompt: str | list[Any]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice; a token list's entries are the engine's to check."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], str | list):
            return [prompt]
        if not all(isinstance(p, type(prompt[0])) for p in prompt):
            raise ValueError("prompt: a list of prompts must be all strings or all token lists")
        return list(prompt)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:  # insertion: no model served here is trained for it
            raise ValueError("suffix: not supported (leave it out)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.stream and self.num_samples > self.n:
            raise ValueError("best_of: a stream cannot choose the best samples; use n")

    @property
    def num_samples(self) -> int:
        """Samples per prompt: best_of, of which the n most likely are returned."""
        return self.n if self.best_of is None else self.best_of

    def engine_params(self) -> SamplingParams:
        """best_of's ranking needs each sample's logprobs; echo with logprobs the
        prompt's."""
        logprobs = self.logprobs
        if logprobs is None and self.num_samples > self.n:
            logprobs = 0
        prompt_logprobs = self.logprobs if self.echo else None
        return self.sampling_params(self.max_tokens, self.num_samples, logprobs, prompt_logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as a chat template reads it: text parts joined."""
        if isinstance(self.content, list):
            return {"role": self.role, "content": "".join(p.text for p in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")

    def engine_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_new_tokens, logprobs=logprobs)

    def chat_messages(self) -> list[dict[str, str]]:
        return [m.template_dict() for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class TokenizeRequest(_Strict):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# --- responses ---------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """The completions API's logprobs: per token its text, its logprob (None for the
    prompt's first token, under echo), the top ones by text, and its offset in the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # kvfleet's: the choice's (new) token ids


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
