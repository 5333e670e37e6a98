"""The simulator's step-time cost model and its least-squares fit.

step_ms = a_ms + b_ms_per_prefill_token * num_prefill_tokens
               + c_ms_per_decode_seq * num_decode_seqs
               + d_ms_per_context_token * total_context_tokens

total_context_tokens is the KV length summed over the step's decode sequences
(what the attention kernels read). Prefill attention over its own chunk is folded
into b.

Fit file (`--fit`), either of two shapes:
  {"points": [{"batch": 64, "context_tokens": 32000, "step_ms": 1.38,
               "prefill_tokens": 0}, ...]}
      batch = decode sequences in the step, context_tokens = their KV length
      summed, prefill_tokens optional (default 0).
  `python -m bench.engine --out` JSON: each row a decode-only point (batch, TPOT ms)
      with context_tokens = batch * (prompt_len + max_new / 2), the mean KV length.
Coefficients whose column never varies in the points (e.g. b with decode-only
points) keep their default value instead of being fitted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

# H200, GPT-2 124M fp16 on the real engine, decode-only (2026-11 measurements):
# (decode seqs, total KV tokens, step ms). Batch 1's context (~192: prompt 128 +
# half of 128 new) is an assumption; the other two contexts were measured.
H200_GPT2_POINTS = ((1, 192, 0.86), (64, 64 * 500, 1.38), (256, 256 * 190, 1.99))
# ESTIMATE, not measured: prefill cost per token.
H200_GPT2_PREFILL_MS_PER_TOKEN = 2e-3
COEFFICIENT_NAMES = (
    "a_ms",
    "b_ms_per_prefill_token",
    "c_ms_per_decode_seq",
    "d_ms_per_context_token",
)


@dataclass(frozen=True)
class CostModel:
    """Linear step-time model; see the module docstring."""

    a_ms: float
    b_ms_per_prefill_token: float
    c_ms_per_decode_seq: float
    d_ms_per_context_token: float

    def __post_init__(self) -> None:
        if self.a_ms <= 0:
            raise ValueError(f"a_ms must be > 0 (a step is never free), got {self.a_ms}")
        for name in COEFFICIENT_NAMES[1:]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, context_tokens: int) -> float:
        return 1e-3 * (
            self.a_ms
            + self.b_ms_per_prefill_token * num_prefill_tokens
            + self.c_ms_per_decode_seq * num_decode_seqs
            + self.d_ms_per_context_token * context_tokens
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def fit_cost_model(
    points: list[tuple[int, int, int, float]], default: CostModel | None = None
) -> CostModel:
    """Least squares over (prefill_tokens, decode_seqs, context_tokens, step_ms) points.

    Columns that do not vary across the points are not identifiable; they keep
    `default`'s value (subtracted from step_ms before the fit). Negative fitted
    slopes are clipped to 0 and the fit redone without them.
    """
    default = default or default_cost_model()
    x = np.array([[1.0, p, n, c] for p, n, c, _ in points], dtype=np.float64)
    y = np.array([ms for *_, ms in points], dtype=np.float64)
    values = np.array([getattr(default, n) for n in COEFFICIENT_NAMES])
    free = [0] + [j for j in (1, 2, 3) if np.ptp(x[:, j]) > 0]
    while True:
        fixed = [j for j in range(4) if j not in free]
        target = y - x[:, fixed] @ values[fixed]
        solution, *_ = np.linalg.lstsq(x[:, free], target, rcond=None)
        values[free] = solution
        negative = [j for j in free[1:] if values[j] < 0]
        if not negative:
            break
        values[negative] = 0.0
        free = [j for j in free if j not in negative]
    if len(points) < len(free):
        raise ValueError(f"{len(points)} points cannot fit {len(free)} coefficients")
    return CostModel(**dict(zip(COEFFICIENT_NAMES, values.tolist())))


def default_cost_model() -> CostModel:
    """The shipped coefficients: the H200 GPT-2 decode points, prefill slope estimated."""
    base = CostModel(1.0, H200_GPT2_PREFILL_MS_PER_TOKEN, 0.0, 0.0)
    return fit_cost_model([(0, n, c, ms) for n, c, ms in H200_GPT2_POINTS], base)


def load_fit_points(path: str) -> list[tuple[int, int, int, float]]:
    """Points from a fit file (either shape in the module docstring)."""
    with open(path) as f:
        raw = json.load(f)
    if "points" in raw:
        return [
            (int(p.get("prefill_tokens", 0)), int(p["batch"]), int(p["context_tokens"]),
             float(p["step_ms"]))
            for p in raw["points"]
        ]  # fmt: skip
    if "rows" in raw:
        if "prompt_len" not in raw or "max_new" not in raw:
            raise ValueError(
                f"{path}: bench/engine.py rows need top-level prompt_len and max_new "
                "to know each point's context length"
            )
        mean_ctx = raw["prompt_len"] + raw["max_new"] / 2
        return [
            (0, int(r["batch"]), int(r["batch"] * mean_ctx), float(r["TPOT ms"]))
            for r in raw["rows"]
        ]
    raise ValueError(f"{path}: expected a 'points' or a 'rows' list")


def cost_model_from_file(path: str | None) -> CostModel:
    return default_cost_model() if path is None else fit_cost_model(load_fit_points(path))
