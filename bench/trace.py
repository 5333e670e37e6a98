"""Mooncake-format request traces: read, replay as token-id prompts, and synthesize.

The format (Mooncake's published traces, JSONL): one request per line with
`timestamp` (ms from the trace's start), `input_length`, `output_length` (tokens) and
`hash_ids`, the ids of the prompt's 512-token blocks, equal ids meaning equal content
(and, the ids being chained in the original, an equal prefix before them).

Replay (replay()): token ids are synthesized from hash_ids, so a replica's real chained
block hashes see exactly the trace's sharing: a full block is a function of its id alone
(equal ids give identical blocks), and the last partial block is the request's own
(tokens from its line number), never shared. length_scale shrinks a 512-token block to
512 * length_scale tokens and the output length by the same factor (0.03125: 16-token
blocks), so traces of 12K-token prompts fit a small model's context with the sharing
structure kept; time_scale multiplies the timestamps (0.5: twice the arrival rate);
start_s / duration_s cut a window of the trace's own time before scaling.

Synthesis (`python -m bench.trace synth --out F --requests N`): traces with the
published shape of Mooncake's (Qin et al., "Mooncake", FAST'25: ~12K-token mean input,
~350 mean output, about half the blocks reusable): a few prefix families (system
prompts, documents) of Zipf popularity, optionally one family carrying --hot-fraction
of the traffic; multi-turn sessions whose next request extends an earlier one's
hash_ids; arrivals in bursts (gamma gaps of coefficient of variation --burst-cv).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("mooncake",)
# Token ids stay below GPT-2's vocabulary (50257), so any preset model can run them.
DEFAULT_VOCAB_SIZE = 50256


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field(record: dict, name: str, where: str) -> object:
    if name not in record:
        raise ValueError(f"{where}: field {name!r} is missing")
    return record[name]


def _int_field(record: dict, name: str, where: str, minimum: int) -> int:
    value = _field(record, name, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_mooncake_line(line: str, where: str) -> TraceRequest:
    """One JSONL line; ValueError naming the field and `where` (file:line) if malformed."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    timestamp = _field(record, "timestamp", where)
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise ValueError(f"{where}: field 'timestamp' must be a number (ms), got {timestamp!r}")
    if not (math.isfinite(timestamp) and timestamp >= 0):
        raise ValueError(f"{where}: field 'timestamp' must be finite and >= 0, got {timestamp!r}")
    input_length = _int_field(record, "input_length", where, 1)
    output_length = _int_field(record, "output_length", where, 1)
    hash_ids = _field(record, "hash_ids", where)
    if not isinstance(hash_ids, list) or any(
        isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hash_ids
    ):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    num_full = input_length // MOONCAKE_BLOCK_TOKENS
    if len(hash_ids) < num_full:
        raise ValueError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} ids, fewer than the "
            f"{num_full} full {MOONCAKE_BLOCK_TOKENS}-token blocks of input_length {input_length}"
        )
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids))


def read_mooncake(path: str) -> list[TraceRequest]:
    """Every request of a Mooncake JSONL file (blank lines skipped), in file order."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                requests.append(parse_mooncake_line(line, f"{path}:{lineno}"))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def read_trace(path: str, trace_format: str) -> list[TraceRequest]:
    if trace_format not in FORMATS:
        raise ValueError(f"trace_format must be one of {FORMATS}, got {trace_format!r}")
    return read_mooncake(path)


@dataclass(frozen=True)
class ReplayConfig:
    """How a trace becomes requests; see the module docstring."""

    time_scale: float = 1.0
    length_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float = math.inf
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale!r}")
        if not 0 < self.length_scale <= 1:
            raise ValueError(f"length_scale must be in (0, 1], got {self.length_scale!r}")
        block = MOONCAKE_BLOCK_TOKENS * self.length_scale
        if block != int(block):
            raise ValueError(
                f"length_scale must make a whole block: {MOONCAKE_BLOCK_TOKENS} * "
                f"{self.length_scale} = {block} tokens"
            )
        if not (self.start_s >= 0 and math.isfinite(self.start_s)):
            raise ValueError(f"start_s must be finite and >= 0, got {self.start_s!r}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size!r}")

    @property
    def block_tokens(self) -> int:
        """Tokens per trace block after scaling."""
        return int(MOONCAKE_BLOCK_TOKENS * self.length_scale)


def add_replay_flags(group: argparse._ActionsContainer) -> None:
    """--trace and the flags that shape its replay (ReplayConfig's fields), as bench.load and
    bench.sim both take them; replay_config(args) reads them back."""
    group.add_argument(
        "--trace", default=None, help="replay this trace file open loop at its timestamps, "
        "instead of --dataset",
    )  # fmt: skip
    group.add_argument("--trace-format", default="mooncake", choices=FORMATS)
    group.add_argument(
        "--time-scale", type=float, default=1.0, help="--trace: timestamps times this"
    )  # fmt: skip
    group.add_argument(
        "--length-scale", type=float, default=1.0,
        help="--trace: its 512-token blocks and output lengths times this (e.g. 0.03125)",
    )  # fmt: skip
    group.add_argument("--start-s", type=float, default=0.0, help="--trace: window start (s)")
    group.add_argument("--duration-s", type=float, default=math.inf, help="--trace: window (s)")


def replay_config(args: argparse.Namespace, **overrides: float) -> ReplayConfig:
    """ReplayConfig from add_replay_flags' flags; overrides replace fields (a load scale's
    time_scale, the model's vocabulary)."""
    fields = dict(
        time_scale=args.time_scale, length_scale=args.length_scale, start_s=args.start_s,
        duration_s=args.duration_s,
    )  # fmt: skip
    return ReplayConfig(**(fields | overrides))


@dataclass(frozen=True)
class ReplayedRequest:
    arrival_s: float  # from the window's first request, scaled
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    line: int  # index in the trace (0-based)
    family: int | None  # its first full block's id: requests sharing it share a prefix


def _block_seed(kind: str, value: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{kind}\x00{value}".encode(), digest_size=8).digest())


class TokenSynth:
    """Token ids of a trace block (a function of its hash id) or of a request's own tail.

    Blocks are cached: a trace's shared blocks are few against its requests.
    """

    def __init__(self, block_tokens: int, vocab_size: int) -> None:
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        tokens = self.blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng(_block_seed("block", hash_id))
            tokens = tuple(rng.integers(0, self.vocab_size, self.block_tokens).tolist())
            self.blocks[hash_id] = tokens
        return tokens

    def own(self, line: int, num_tokens: int) -> tuple[int, ...]:
        rng = np.random.default_rng(_block_seed("own", line))
        return tuple(rng.integers(0, self.vocab_size, num_tokens).tolist())


def scaled_lengths(request: TraceRequest, length_scale: float) -> tuple[int, int, int]:
    """(full blocks, own tail tokens, output tokens) after scaling; the prompt is never empty."""
    num_full = request.input_length // MOONCAKE_BLOCK_TOKENS
    tail = request.input_length - num_full * MOONCAKE_BLOCK_TOKENS
    num_tail = round(tail * length_scale)
    if num_full == 0:
        num_tail = max(1, num_tail)
    return num_full, num_tail, max(1, round(request.output_length * length_scale))


def replay(requests: Sequence[TraceRequest], config: ReplayConfig) -> list[ReplayedRequest]:
    """The window's requests in arrival order, as token-id prompts (module docstring)."""
    start_ms = 1e3 * config.start_s
    end_ms = start_ms + 1e3 * config.duration_s
    window = [(r.timestamp_ms, i, r) for i, r in enumerate(requests)
              if start_ms <= r.timestamp_ms < end_ms]  # fmt: skip
    if not window:
        raise ValueError(
            f"start_s / duration_s: no request in [{config.start_s}, "
            f"{config.start_s + config.duration_s}) s of the trace"
        )
    window.sort(key=lambda w: (w[0], w[1]))
    first_ms = window[0][0]
    synth = TokenSynth(config.block_tokens, config.vocab_size)
    out = []
    for timestamp_ms, line, r in window:
        num_full, num_tail, max_tokens = scaled_lengths(r, config.length_scale)
        prompt: list[int] = []
        for hash_id in r.hash_ids[:num_full]:
            prompt.extend(synth.block(hash_id))
        prompt.extend(synth.own(line, num_tail))
        arrival_s = (timestamp_ms - first_ms) / 1e3 * config.time_scale
        family = r.hash_ids[0] if num_full else None
        out.append(ReplayedRequest(arrival_s, tuple(prompt), max_tokens, line, family))
    return out


def shared_block_fraction(requests: Iterable[TraceRequest]) -> float:
    """Of all full blocks the requests carry, the fraction whose id an earlier request
    already carried (what a single infinite cache would reuse)."""
    seen: set[int] = set()
    num_blocks = num_reused = 0
    for r in sorted(requests, key=lambda r: r.timestamp_ms):
        for h in r.hash_ids[: r.input_length // MOONCAKE_BLOCK_TOKENS]:
            num_blocks += 1
            num_reused += h in seen
            seen.add(h)
    return num_reused / max(1, num_blocks)


def family_shares(requests: Sequence[TraceRequest]) -> list[float]:
    """Fraction of requests per first block id, largest first (a family's share of traffic)."""
    counts: dict[int, int] = {}
    for r in requests:
        if r.hash_ids:
            counts[r.hash_ids[0]] = counts.get(r.hash_ids[0], 0) + 1
    return sorted((c / len(requests) for c in counts.values()), reverse=True)


@dataclass(frozen=True)
class SynthConfig:
    """A synthetic Mooncake-shaped trace; the defaults give the published shape."""

    num_requests: int = 2000
    rate: float = 4.0  # mean requests/s over the trace
    burst_cv: float = 2.0  # coefficient of variation of the gaps (1: Poisson)
    num_families: int = 16
    zipf_s: float = 0.8
    hot_fraction: float = 0.0  # > 0: family 0 carries this fraction of the requests
    family_blocks_mean: float = 8.0  # a family's shared prefix, 512-token blocks
    own_blocks_mean: float = 16.0  # a new request's own blocks after its family's
    session_prob: float = 0.35  # a request continues an earlier one's conversation
    turn_blocks_mean: float = 3.0  # blocks a follow-up turn appends
    output_mean: float = 350.0
    max_input_blocks: int = 128  # 64K tokens: 2,048 at length_scale 1/32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests!r}")
        for name in ("rate", "burst_cv", "zipf_s", "family_blocks_mean", "own_blocks_mean",
                     "turn_blocks_mean", "output_mean"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_families < 1 or self.max_input_blocks < 2:
            raise ValueError("num_families must be >= 1 and max_input_blocks >= 2")
        if not 0 <= self.hot_fraction < 1:
            raise ValueError(f"hot_fraction must be in [0, 1), got {self.hot_fraction!r}")
        if not 0 <= self.session_prob < 1:
            raise ValueError(f"session_prob must be in [0, 1), got {self.session_prob!r}")


def _family_weights(config: SynthConfig) -> np.ndarray:
    weights = 1.0 / np.arange(1, config.num_families + 1) ** config.zipf_s
    weights /= weights.sum()
    if config.hot_fraction > 0 and config.num_families > 1:
        rest = weights[1:] / weights[1:].sum() * (1 - config.hot_fraction)
        weights = np.concatenate([[config.hot_fraction], rest])
    return weights


def synthesize(config: SynthConfig) -> list[TraceRequest]:
    """A seeded synthetic trace (module docstring), in arrival order."""
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    shape = 1.0 / config.burst_cv**2
    gaps = rng.gamma(shape, 1.0 / (config.rate * shape), n)
    times_ms = np.round(1e3 * (np.cumsum(gaps) - gaps[0]), 3)
    weights = _family_weights(config)
    next_id = 0

    def new_ids(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    families = [
        new_ids(max(1, int(rng.poisson(config.family_blocks_mean))))
        for _ in range(config.num_families)
    ]
    by_family: list[list[int]] = [[] for _ in range(config.num_families)]  # request indices
    chains: list[list[int]] = []
    out = []
    for i in range(n):
        family = int(rng.choice(config.num_families, p=weights))
        earlier = by_family[family]
        if earlier and rng.random() < config.session_prob:
            # A later turn: an earlier conversation of this family (recent ones likelier)
            # with a new turn appended.
            back = min(len(earlier), int(rng.geometric(0.3)))
            base = chains[earlier[-back]][:-1]  # its full blocks; its tail was its own
            ids = base + new_ids(1 + int(rng.poisson(config.turn_blocks_mean - 1)))
        else:
            ids = families[family] + new_ids(1 + int(rng.poisson(config.own_blocks_mean - 1)))
        ids = ids[: config.max_input_blocks]
        chains.append(ids)
        earlier.append(i)
        tail = int(rng.integers(1, MOONCAKE_BLOCK_TOKENS))
        # The last id names the partial tail block, as in Mooncake's traces.
        input_length = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + tail
        output = max(1, round(rng.lognormal(math.log(config.output_mean) - 0.5 * 0.8**2, 0.8)))
        out.append(TraceRequest(float(times_ms[i]), input_length, output, tuple(ids)))
    return out


def write_mooncake(requests: Iterable[TraceRequest], path: str) -> None:
    with open(path, "w") as f:
        for r in requests:
            timestamp = r.timestamp_ms
            if timestamp == int(timestamp):
                timestamp = int(timestamp)
            line = {"timestamp": timestamp, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}  # fmt: skip
            f.write(json.dumps(line) + "\n")


def describe(requests: Sequence[TraceRequest]) -> dict:
    """The shape figures the synthesizer targets."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3
    return {
        "num_requests": len(requests),
        "span_s": span_s,
        "mean_input_tokens": float(np.mean([r.input_length for r in requests])),
        "mean_output_tokens": float(np.mean([r.output_length for r in requests])),
        "shared_block_fraction": shared_block_fraction(requests),
        "top_family_share": family_shares(requests)[0],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write a synthetic Mooncake-shaped trace")
    s.add_argument("--out", required=True)
    s.add_argument("--requests", type=int, default=SynthConfig.num_requests)
    s.add_argument("--rate", type=float, default=SynthConfig.rate, help="mean req/s")
    s.add_argument("--burst-cv", type=float, default=SynthConfig.burst_cv)
    s.add_argument("--families", type=int, default=SynthConfig.num_families)
    s.add_argument("--zipf", type=float, default=SynthConfig.zipf_s)
    s.add_argument(
        "--hot-fraction", type=float, default=0.0,
        help="family 0 carries this fraction of the requests (0: Zipf alone)",
    )  # fmt: skip
    s.add_argument("--session-prob", type=float, default=SynthConfig.session_prob)
    s.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("describe", help="print a trace's shape")
    d.add_argument("trace")
    args = p.parse_args(argv)
    if args.command == "synth":
        config = SynthConfig(
            num_requests=args.requests, rate=args.rate, burst_cv=args.burst_cv,
            num_families=args.families, zipf_s=args.zipf, hot_fraction=args.hot_fraction,
            session_prob=args.session_prob, seed=args.seed,
        )  # fmt: skip
        requests = synthesize(config)
        write_mooncake(requests, args.out)
    else:
        requests = read_mooncake(args.trace)
    json.dump(describe(requests), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
