"""Seeded request traces for the simulator: arrivals, lengths, shared prefixes.

Datasets:
  random         prompt ~ U[prompt_min, prompt_max], output ~ U[output_min, output_max]
  shared_prefix  one of num_prefixes system prompts (prefix_len tokens, Zipf(1.1)
                 popularity) + a unique suffix ~ U[16, 128], output ~ U[16, 128]
  long_tail      prompt and output lognormal (median 128 / 64, sigma 1.0), clipped
Arrivals: Poisson, or gamma with coefficient of variation arrival_cv (bursty when > 1).

Token ids are made on demand: a shared prefix is the same ids for every request
that uses it, and every suffix starts with the request index, so two prompts share
exactly their common prefix's full blocks. Block hashes are the real chained
hashes (replica.hashing) for shared blocks and unique negative ints for each
request's own blocks (never shared, so any unique name matches reality).

Workload.from_trace replays a recorded trace instead (bench.load's: explicit
prompts and arrival times); its prompts' full blocks are named by their real
chained hashes, so prompts share exactly the blocks their tokens share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.hashing import prefix_block_hashes

DATASETS = ("random", "shared_prefix", "long_tail")
ARRIVALS = ("poisson", "gamma")
VOCAB_SIZE = 50257
MAX_BLOCKS_PER_REQUEST = 1 << 16


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    num_requests: int = 10_000
    rate: float = 1000.0  # offered requests per second
    arrival: str = "poisson"
    arrival_cv: float = 1.0  # gamma only
    max_model_len: int = 1024
    prompt_min: int = 32
    prompt_max: int = 512
    output_min: int = 16
    output_max: int = 256
    num_prefixes: int = 16
    prefix_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.num_requests <= 0 or self.rate <= 0 or self.arrival_cv <= 0:
            raise ValueError("num_requests, rate and arrival_cv must be > 0")
        if self.prefix_len + 128 + 128 > self.max_model_len and self.dataset == "shared_prefix":
            raise ValueError(
                f"max_model_len: {self.max_model_len} does not fit prefix_len + 256 "
                f"({self.prefix_len + 256}) for shared_prefix"
            )


class Workload:
    """A trace: arrival_s, prompt_len, output_len, prefix_id (-1: none) per request."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.offered_rate = config.rate
        self.prompts: list[tuple[int, ...]] | None = None  # from_trace only
        self.prompt_hashes: list[tuple[int, ...]] | None = None
        rng = np.random.default_rng(config.seed)
        n = config.num_requests
        if config.arrival == "poisson":
            gaps = rng.exponential(1.0 / config.rate, n)
        else:
            shape = 1.0 / config.arrival_cv**2
            gaps = rng.gamma(shape, 1.0 / (config.rate * shape), n)
        self.arrival_s = np.cumsum(gaps) - gaps[0]
        self.prefix_id = np.full(n, -1, dtype=np.int64)
        self.prefix_tokens: list[tuple[int, ...]] = []
        self.prefix_hashes: list[tuple[int, ...]] = []
        if config.dataset == "random":
            prompt = rng.integers(config.prompt_min, config.prompt_max + 1, n)
            output = rng.integers(config.output_min, config.output_max + 1, n)
        elif config.dataset == "shared_prefix":
            weights = 1.0 / np.arange(1, config.num_prefixes + 1) ** 1.1
            self.prefix_id = rng.choice(config.num_prefixes, n, p=weights / weights.sum())
            prompt = config.prefix_len + rng.integers(16, 129, n)
            output = rng.integers(16, 129, n)
            for _ in range(config.num_prefixes):
                tokens = tuple(rng.integers(0, VOCAB_SIZE, config.prefix_len).tolist())
                self.prefix_tokens.append(tokens)
        else:
            prompt = np.clip(np.round(rng.lognormal(np.log(128), 1.0, n)), 8, None)
            output = np.clip(np.round(rng.lognormal(np.log(64), 1.0, n)), 4, None)
            prompt = np.minimum(prompt, config.max_model_len // 2)
        output = np.minimum(output, config.max_model_len - prompt)
        self._set_lengths(prompt, output)

    @classmethod
    def from_trace(
        cls,
        arrival_s: Sequence[float],
        prompts: Sequence[Sequence[int]],
        output_lens: Sequence[int],
        offered_rate: float,
    ) -> Workload:
        """A recorded trace: request i arrives at arrival_s[i] (from 0) with prompts[i]."""
        if not len(arrival_s) == len(prompts) == len(output_lens) > 0:
            raise ValueError(
                "arrival_s, prompts and output_lens must be non-empty, one per request"
            )
        if any(not p for p in prompts) or min(output_lens) < 1:
            raise ValueError("every request needs a prompt token and an output token")
        workload = cls.__new__(cls)
        workload.config = None
        workload.offered_rate = offered_rate
        workload.prompts = [tuple(p) for p in prompts]
        workload.prompt_hashes = None
        workload.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        workload.prefix_id = np.full(len(prompts), -1, dtype=np.int64)
        workload.prefix_tokens, workload.prefix_hashes = [], []
        workload._set_lengths(np.array([len(p) for p in prompts]), np.asarray(output_lens))
        return workload

    def _set_lengths(self, prompt: np.ndarray, output: np.ndarray) -> None:
        self.prompt_len = prompt.astype(np.int64)
        self.output_len = output.astype(np.int64)
        # Python lists: per-request reads in the event loop are faster than numpy scalars.
        self.prompt_len_list: list[int] = self.prompt_len.tolist()
        self.output_len_list: list[int] = self.output_len.tolist()
        self.prefix_id_list: list[int] = self.prefix_id.tolist()
        self.block_size = 0

    def set_block_size(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefix_hashes = [tuple(prefix_block_hashes(t, block_size)) for t in self.prefix_tokens]
        if self.prompts is not None:
            self.prompt_hashes = [tuple(prefix_block_hashes(p, block_size)) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompt_len_list)

    def prompt_token_ids(self, rid: int) -> tuple[int, ...]:
        """The prompt's ids: shared prefix (if any) + a suffix unique to this request."""
        if self.prompts is not None:
            return self.prompts[rid]
        num_prompt = self.prompt_len_list[rid]
        prefix = (
            self.prefix_tokens[self.prefix_id_list[rid]] if self.prefix_id_list[rid] >= 0 else ()
        )
        head = (rid % VOCAB_SIZE, rid // VOCAB_SIZE % VOCAB_SIZE, rid // VOCAB_SIZE**2)
        num_rest = num_prompt - len(prefix) - len(head)
        rest = tuple((rid * 7919 + j * 104729) % VOCAB_SIZE for j in range(max(0, num_rest)))
        return (prefix + head + rest)[:num_prompt]

    def block_hashes(self, rid: int, num_blocks: int) -> list[int]:
        """Names of the request's first num_blocks full blocks (prompt, then generated)."""
        if self.prompt_hashes is not None:
            shared = self.prompt_hashes[rid]
        else:
            pid = self.prefix_id_list[rid]
            shared = self.prefix_hashes[pid] if pid >= 0 else ()
        num_shared = min(len(shared), num_blocks)
        base = -rid * MAX_BLOCKS_PER_REQUEST - 1
        return [*shared[:num_shared], *range(base - num_shared, base - num_blocks, -1)]
