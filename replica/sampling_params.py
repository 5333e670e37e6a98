"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

_INT64_MAX = 2**63 - 1  # seeds, top_k and token ids become int64 tensors in the sampler
MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
MAX_N = 128  # OpenAI's limit on `n`
MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit
# cache_salt travels with the request on every hop (msgpack wire, router, replica); a
# tenant id or a random token fits in far less.
MAX_CACHE_SALT_CHARS = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy; top_k <= 0 and top_p == 1 disable those filters;
    seed makes a sampled request reproducible whatever else is in its batch.
    max_tokens None: the room left in the context (max_model_len - prompt length).
    stop: up to MAX_STOP_STRINGS strings matched on the detokenized output (needs a
    model with a tokenizer); the output ends before the first one, finish_reason "stop".
    n: samples of the prompt; the engine prefills it once and forks the rest from it
    (sample i's request id is sample_request_id(request_id, i), its seed seed + i).
    logprobs / prompt_logprobs: None, or how many top tokens' log probabilities to return
    beside each sampled (or prompt) token's own, 0..MAX_LOGPROBS; they are log_softmax
    of the model's logits before any penalty, bias or temperature.
    presence_penalty, frequency_penalty (OpenAI's, on output tokens), repetition_penalty
    (on prompt and output tokens: a seen token's positive logit divided by it, a negative
    one multiplied), logit_bias ({token id: bias in [-100, 100]}, added to the logits) and
    min_tokens (stop tokens masked until that many tokens are out) change the logits
    before sampling, for the rows that set them only.
    cache_salt (vLLM's field; it does not change sampling): the request's prompt blocks
    are cached under this salt (replica.hashing.root_hash), so requests share cached
    prefixes only with requests of the same salt; None shares with unsalted requests.
    Invalid values raise ValueError naming the field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT64_MAX:
            raise ValueError(
                f"top_k must be an integer in [-1, 2**63 - 1] (<= 0 disables), got {self.top_k!r}"
            )
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not all(
            _is_int(t) and 0 <= t <= _INT64_MAX for t in _iter_or_none(self.stop_token_ids)
        ):
            raise ValueError(
                f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if (
            not isinstance(stop, list | tuple)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > MAX_STOP_STRINGS
        ):
            raise ValueError(
                f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty "
                f"strings, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        self._check_extras()

    def _check_extras(self) -> None:
        """The fields beyond plain sampling: n, logprobs and the logits processors."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
            object.__setattr__(self, name, float(value))
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got {rp!r}")
        object.__setattr__(self, "repetition_penalty", float(rp))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        salt = self.cache_salt
        if salt is not None and (
            not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be None or a non-empty string of at most "
                f"{MAX_CACHE_SALT_CHARS} characters, got {type(salt).__name__} "
                f"of length {len(salt) if isinstance(salt, str) else '-'}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the row's logits change before sampling (penalties, bias, min_tokens)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @property
    def needs_extras(self) -> bool:
        """Whether the row samples outside the plain fast path: processed logits or
        logprobs."""
        return self.processes_logits or self.logprobs is not None

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Build from a JSON-like dict; an unknown key raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be an object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except RecursionError:  # a list nested thousands deep: name it, do not crash
            deep = [name for name, value in data.items() if _nests_deeper(value, 32)]
            raise ValueError(f"{', '.join(deep) or 'params'}: nested too deeply") from None

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "logit_bias": [list(pair) for pair in self.logit_bias],  # msgpack: no int keys
        }


def sample_request_id(request_id: str, index: int) -> str:
    """The request id of sample index of a request with n > 1 (sample 0 keeps the id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them) or (id, bias)
    pairs, as sorted pairs."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ValueError(f"logit_bias must be a map of token id to bias, got {value!r}")
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    pairs = {}
    for item in items:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError(f"logit_bias: entries must be (token id, bias) pairs, got {item!r}")
        token, bias = item
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if not _is_int(token) or not 0 <= token <= _INT64_MAX:
            raise ValueError(f"logit_bias: token id {item[0]!r} is not an integer >= 0")
        if not _is_number(bias) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _nests_deeper(value: object, depth: int) -> bool:
    if depth == 0:
        return True
    if isinstance(value, list | tuple):
        return any(_nests_deeper(item, depth - 1) for item in value)
    if isinstance(value, dict):
        return any(_nests_deeper(item, depth - 1) for item in value.values())
    return False


def _iter_or_none(values: object) -> list:
    try:
        return list(values)  # type: ignore[call-overload]
    except TypeError:
        return [None]


class ParamsCache:
    """SamplingParams by their params dict, for dicts seen before.

    A replica's requests mostly repeat a few settings (an app's fixed parameters, a load
    test's one set), and building SamplingParams checks every field: ~18 us a request on
    the 2-core CPU box, against ~2 us for the key. The key is the dict's msgpack bytes,
    which keep each value's type (1, 1.0 and True compare equal but validate
    differently), so a hit is a dict that would build the same params; a dict that fails
    to build is never cached and fails anew. Bounded: past max_entries distinct settings
    the cache starts over, and a dict whose key passes MAX_KEY_BYTES (long stop_token_ids
    or logit_bias) is built every time rather than kept.
    """

    MAX_KEY_BYTES = 2048

    def __init__(self, build: Callable[[dict], SamplingParams], max_entries: int = 256) -> None:
        self._build = build
        self.max_entries = max_entries
        self._entries: dict[bytes, SamplingParams] = {}

    def get(self, data: dict) -> SamplingParams:
        """build(data), or what it gave for an identical dict; raises what build raises."""
        try:
            key = msgpack.packb(data)
        except (TypeError, ValueError, OverflowError):  # no key for it: build names why
            return self._build(data)
        params = self._entries.get(key)
        if params is None:
            params = self._build(data)
            if len(key) <= self.MAX_KEY_BYTES:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[key] = params
        return params
