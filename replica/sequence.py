"""One request's state inside a replica."""

from __future__ import annotations

import enum
import time

import numpy as np

from replica.hashing import ROOT_HASH, hash_block, packed_block_hashes, prefix_block_hashes
from replica.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token still on its way from the device
# Sequence.stop_token when it has no stop token (no token matches it), or several (the
# engine checks those rows in Python).
NO_STOP, MANY_STOPS = -1, -2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, blocks and progress of one request.

    Invariants: block_ids covers every computed token (len(block_ids) * block_size
    >= num_computed_tokens); slot is the request's row of the global block table
    while it holds blocks, else -1.
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "prompt_ids",
        "num_prompt_tokens",
        "params",
        "status",
        "block_ids",
        "block_hashes",
        "root_hash",
        "num_committed_blocks",
        "slot",
        "num_computed_tokens",
        "num_cached_tokens",
        "arrival_s",
        "finish_reason",
        "num_emitted_tokens",
        "eos_token_id",
        "stop_ids",
        "stop_token",
        "greedy",
        "extras",
        "max_len",
        "num_queued_blocks",
        "num_queued_hashes",
        "family",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_s: float | None = None,
        max_model_len: int | None = None,
        root_hash: int = ROOT_HASH,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # The prompt once more as int64s (it never changes): a prefill step's inputs and the
        # prompt's block hashes take slices of it, with no conversion from Python ints.
        self.prompt_ids = np.fromiter(self.token_ids, np.int64, self.num_prompt_tokens)
        self.params = params
        self.eos_token_id = eos_token_id
        self.status = SequenceStatus.WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full blocks, in order
        # The first block's parent: replica.hashing.root_hash of the engine's prefix_salt
        # and the request's cache_salt, so only requests of the same salts share blocks.
        self.root_hash = root_hash
        self.num_committed_blocks = 0  # leading blocks whose KV is computed and hashed
        self.slot = -1
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.finish_reason: str | None = None
        self.num_emitted_tokens = 0
        # While waiting (Scheduler): the blocks it is estimated to take, and how many of
        # its block_hashes the scheduler counts as queued.
        self.num_queued_blocks = 0
        self.num_queued_hashes = 0
        # The n samples of a request with n > 1, in sample order (shared by all of them),
        # else None: LLMEngine.abort of sample 0's id ends those still in flight.
        self.family: list[Sequence] | None = None
        # Precomputed for the per-token stop check on the hot path.
        stops = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.add(eos_token_id)
        self.stop_ids = frozenset(stops)
        # Its one stop token, for the engine's stop check over a step's rows in numpy.
        self.stop_token = next(iter(stops)) if len(stops) == 1 else MANY_STOPS if stops else NO_STOP
        self.greedy = params.greedy  # a step of greedy sequences alone samples in its graph
        # A step with such a row leaves the fast path (replica.runner.logits_processors).
        self.extras = params.needs_extras or params.prompt_logprobs is not None
        self.max_len = self.num_prompt_tokens + params.max_tokens
        if max_model_len is not None:
            self.max_len = min(self.max_len, max_model_len)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, len={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def full_block_hashes(self, block_size: int, num_tokens: int | None = None) -> list[int]:
        """Extend and return block_hashes over the full blocks of token_ids[:num_tokens].

        num_tokens bounds the hashing to tokens whose values are known (a token
        still being sampled on the device is a placeholder).
        """
        end = len(self.token_ids) if num_tokens is None else num_tokens
        hashes = self.block_hashes
        start = len(hashes) * block_size
        if end - start >= block_size:
            parent = hashes[-1] if hashes else self.root_hash
            if end <= self.num_prompt_tokens:
                hashes += packed_block_hashes(
                    self.prompt_ids[start:end].tobytes(), block_size, parent
                )
            elif end - start < 2 * block_size and start >= self.num_prompt_tokens:
                # One block of generated tokens (a decode block that filled up, ~16 a step
                # at 256 rows): hashed alone, without the general pass's packing loop.
                hashes.append(hash_block(parent, self.token_ids[start : start + block_size]))
            else:
                hashes += prefix_block_hashes(self.token_ids[start:end], block_size, parent)
        return hashes
