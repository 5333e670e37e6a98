"""Shared benchmark helpers: timing percentiles, the copy-bandwidth ceiling, result output."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: load generators need these helpers, not torch (~3 s)
    import torch


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary_ms(values_s: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99, in ms, of durations in seconds (NaNs left out; NaN for none)."""
    values = [1e3 * v for v in values_s if not math.isnan(v)]
    out = {"mean": sum(values) / len(values) if values else math.nan}
    return out | {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 2**30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes read + written over time (the HBM ceiling)."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / statistics.median(times) / 1e9


def host_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The host's CPU model and core count. A launch-bound peer (HF generate, up to
    ~64 sequences) runs at the host's pace: its tokens/s differed by up to 1.6x between
    two H200 machines with different host CPUs."""
    name = ""
    try:
        with open(cpuinfo_path) as f:
            name = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()} x{os.cpu_count()}"


def machine_description() -> str:
    import torch

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        return f"{gpu} x{torch.cuda.device_count()} (host {host_cpu()}), torch {torch.__version__}"
    return f"{host_cpu()} CPU, torch {torch.__version__}"


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": machine_description()} | payload
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def markdown_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> str:
    """rows as a markdown table, floats to `digits` significant digits; columns: by default
    every key of the rows, first seen first."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        return f"{v:.{digits}g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
