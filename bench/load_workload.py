"""The load test's trace: seeded arrival times and token-id prompts, no Ray, no I/O.

Arrivals follow vLLM's benchmark_serving: inter-arrival gaps are gamma-distributed with
shape `burstiness` and mean 1/rate, so burstiness 1 is a Poisson process, < 1 is burstier
and > 1 is more regular; the first request arrives at 0. rate inf sends all at once.

Datasets (token ids, because presets have no tokenizer; ids in [0, vocab_size - 1) so the
last id, often EOS, never appears):
  random   input and output lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's
           random-range-ratio r).
  prefix   num_prefixes long prefixes of prefix_len tokens, each request one of them
           (uniformly) followed by a short random suffix of random length: the shared
           system-prompt case that prefix-affinity routing is for.
  longtail lengths lognormal (median len, sigma) or Pareto (median len, shape alpha),
           clipped to [1, max_*_len]: a few very long requests among many short ones.
  --trace  a Mooncake-format file replayed open loop at its timestamps (trace_specs;
           token ids from its block ids, bench/trace.py).
Arrivals and dataset draw from separate seeded streams, so changing the rate keeps the
prompts and changing the dataset keeps the arrival times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "prefix", "longtail")
TAILS = ("lognormal", "pareto")


@dataclass(frozen=True)
class RequestSpec:
    """One request of the trace; arrival_s is the offset from the run's start."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float
    prefix_id: int | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that determines a trace; the same config and seed give the same trace."""

    num_requests: int = 100
    rate: float = math.inf  # requests/s; inf sends all at once (ignored in closed loop)
    burstiness: float = 1.0
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 256
    tail: str = "lognormal"
    sigma: float = 1.0
    alpha: float = 1.5
    max_input_len: int = 1024
    max_output_len: int = 256
    vocab_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len", "num_prefixes", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_input_len", "max_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len!r}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (inf: all at once), got {self.rate!r}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio!r}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {self.tail!r}")
        if not (self.sigma > 0 and self.alpha > 0):
            raise ValueError(f"sigma and alpha must be > 0, got {self.sigma!r}, {self.alpha!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size!r}")


def arrival_offsets(
    num_requests: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send times from the run's start: gamma gaps of mean 1/rate, shape burstiness."""
    if math.isinf(rate):
        return [0.0] * num_requests
    theta = 1.0 / (rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def uniform_lengths(length: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Integers uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    lo = max(1, math.floor(length * (1 - range_ratio)))
    hi = max(lo, math.ceil(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def long_tailed_lengths(
    median: int, tail: str, spread: float, cap: int, n: int, rng: np.random.Generator
) -> list[int]:
    """Lognormal (sigma = spread) or Pareto (shape = spread) lengths of the given median."""
    if tail == "lognormal":
        raw = rng.lognormal(mean=math.log(median), sigma=spread, size=n)
    else:  # classical Pareto with minimum x_m; its median is x_m * 2 ** (1 / alpha)
        x_m = median / 2 ** (1 / spread)
        raw = x_m * (1.0 + rng.pareto(spread, size=n))
    return np.clip(np.rint(raw), 1, cap).astype(int).tolist()


def _token_ids(n: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, vocab_size - 1, size=n).tolist()


def build_trace(config: WorkloadConfig) -> list[RequestSpec]:
    """The seeded list of requests, in arrival order."""
    arrival_seed, data_seed = np.random.SeedSequence(config.seed).spawn(2)
    arrivals = arrival_offsets(
        config.num_requests, config.rate, config.burstiness, np.random.default_rng(arrival_seed)
    )
    rng = np.random.default_rng(data_seed)
    n = config.num_requests
    prefix_ids: list[int | None] = [None] * n
    if config.dataset == "longtail":
        in_lens = long_tailed_lengths(
            config.input_len, config.tail, _spread(config), config.max_input_len, n, rng
        )
        out_lens = long_tailed_lengths(
            config.output_len, config.tail, _spread(config), config.max_output_len, n, rng
        )
    else:
        in_lens = uniform_lengths(config.input_len, config.range_ratio, n, rng)
        out_lens = uniform_lengths(config.output_len, config.range_ratio, n, rng)
    prefixes: list[list[int]] = []
    if config.dataset == "prefix":
        prefixes = [
            _token_ids(config.prefix_len, config.vocab_size, rng)
            for _ in range(config.num_prefixes)
        ]
        prefix_ids = rng.integers(0, config.num_prefixes, size=n).tolist()
    trace = []
    for i in range(n):
        prompt = _token_ids(in_lens[i], config.vocab_size, rng)
        if prefix_ids[i] is not None:
            prompt = prefixes[prefix_ids[i]] + prompt
        trace.append(RequestSpec(i, prompt, out_lens[i], arrivals[i], prefix_ids[i]))
    return trace


def trace_specs(replayed: list) -> list[RequestSpec]:
    """A replayed trace (bench.trace.replay) as the load test's requests; prefix_id is
    the request's family (its first block id), for the placement report."""
    return [
        RequestSpec(i, list(r.prompt_token_ids), r.max_tokens, r.arrival_s, r.family)
        for i, r in enumerate(replayed)
    ]


def _spread(config: WorkloadConfig) -> float:
    return config.sigma if config.tail == "lognormal" else config.alpha


def split_round_robin(trace: list[RequestSpec], num_parts: int) -> list[list[RequestSpec]]:
    """Request i goes to part i % num_parts: every part sees the whole time span."""
    return [trace[p::num_parts] for p in range(num_parts)]


def split_concurrency(concurrency: int, num_parts: int) -> list[int]:
    """Closed-loop users per part, as even as possible, summing to concurrency."""
    base, extra = divmod(concurrency, num_parts)
    return [base + (1 if p < extra else 0) for p in range(num_parts)]
