"""Prometheus text exposition format 0.0.4: what a /metrics answer is made of.

A metric family is its HELP and TYPE lines, then one line per sample:
`name{label="value",...} value`. A histogram's samples are its cumulative buckets
(`name_bucket{le="..."}`, the last `le="+Inf"`), `name_sum` and `name_count`. Label
values escape backslash, double quote and newline; HELP text escapes backslash and
newline. Written here rather than through prometheus_client: its registry wants a
collector class per source, and this renders snapshots that arrive from other
processes as plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KINDS = ("counter", "gauge", "histogram")

# (sample name, labels, value)
Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True)
class Family:
    """One metric family. name: as exposed (a counter's ends in `_total`); kind: one of
    KINDS; samples: its lines, for a histogram as histogram_samples makes them."""

    name: str
    kind: str
    help: str
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"name: a counter's must end in _total, got {self.name!r}")


def histogram_samples(
    name: str,
    labels: dict[str, str],
    bounds: Sequence[float],
    counts: Sequence[int],
    total: float,
) -> list[Sample]:
    """A histogram's sample lines from per-bucket counts: counts[i] observations in
    (bounds[i-1], bounds[i]], counts[-1] those above every bound (len(bounds) + 1)."""
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"counts: need len(bounds) + 1 = {len(bounds) + 1}, got {len(counts)}")
    samples: list[Sample] = []
    cumulative = 0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        cumulative += count
        samples.append((f"{name}_bucket", {**labels, "le": format_value(bound)}, cumulative))
    samples.append((f"{name}_sum", labels, total))
    samples.append((f"{name}_count", labels, cumulative))
    return samples


def render(families: Iterable[Family]) -> str:
    """The exposition text of families, in order, ending with a newline."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for name, labels, value in family.samples:
            if labels:
                pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
                lines.append(f"{name}{{{pairs}}} {format_value(value)}")
            else:
                lines.append(f"{name} {format_value(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def format_value(value: float) -> str:
    """An int as written, a float as Python's repr (round-trips), infinities and NaN
    as Prometheus spells them."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
