"""ServingEngine: what a serving loop (cluster/) needs of an engine, and nothing more.

LLMEngine is the implementation; the model-free fakes of bench/ and tests/ are others, and
tests/replica/test_protocol.py checks that each has these members with LLMEngine's exact
signatures (names, kinds, defaults and types), so a change to the engine's surface shows
up there and not as an AttributeError in a Serve replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ModelFacts(Protocol):
    """The model's fixed facts a replica reports (replica.models.ModelConfig has them)."""

    vocab_size: int
    eos_token_id: int | None


@runtime_checkable
class ServingEngine(Protocol):
    """One replica's engine, driven by one thread (cluster.engine_loop.EngineLoop).

    The loop adds and aborts requests between steps and calls step() while
    has_unfinished(); each step() returns that step's new tokens as RequestOutput deltas
    (LLMEngine returns StepOutputs, their column form, which cluster.fan_out reads without
    building a row per token). Invariants the loop relies on: every request added ends in
    exactly one finished delta or one abort() that returned True; add_request raises
    ValueError naming the field for a request it refuses, and leaves no state behind.
    """

    model_config: ModelFacts
    tokenizer: PreTrainedTokenizerBase | None  # None: token ids in and out only
    max_model_len: int

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Queue a request; ValueError naming the field for invalid input."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a request now; False if it is not in flight."""
        ...

    def has_unfinished(self) -> bool: ...

    def device_busy(self) -> bool:
        """Whether the step in flight still runs (the loop may run commands meanwhile)."""
        ...

    def step(self) -> Sequence[RequestOutput]:
        """Advance every running request by one step; its new tokens and finishes."""
        ...

    def stats(self, with_hashes: bool = True) -> ReplicaStats:
        """The replica's snapshot (with_hashes=False: without the cached prefix hashes)."""
        ...
