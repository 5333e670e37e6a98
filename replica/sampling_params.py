"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_INT64_MAX = 2**63 - 1  # seeds, top_k and token ids become int64 tensors in the sampler
MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Build from a JSON-like dict; an unknown key raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be an object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
        }


def _iter_or_none(values: object) -> list:
    try:
        return list(values)  # type: ignore[call-overload]
    except TypeError:
        return [None]
