"""Shared benchmark helpers: timing percentiles, the copy-bandwidth ceiling, result output."""

from __future__ import annotations

import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from typing import Any

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


def profiled_steps(engine: Any, steps: int) -> pstats.Stats:
    """cProfile's statistics over `steps` calls of engine.step() (the host side)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    return pstats.Stats(profiler)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 2**30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes read + written over time (the HBM ceiling)."""
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
    ~64 sequences) runs at the host's pace: its tokens/s on H200 machines differed by up
    to 1.6x between two sessions (BENCHMARKS.md, thirty-sixth session)."""
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
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        return f"{gpu} x{torch.cuda.device_count()} (host {host_cpu()}), torch {torch.__version__}"
    return f"{host_cpu()} CPU, torch {torch.__version__}"


def add_engine_mode_args(parser: Any) -> None:
    """--engine-process / --engine-thread into args.engine_process (None: the default,
    ClusterConfig's: a child process when the replica has a GPU)."""
    parser.add_argument(
        "--engine-process", dest="engine_process", action="store_const", const=True,
        default=None, help="replicas run their engine in a child process (ClusterConfig."
        "engine_process; default: a child process when the replica has a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-thread", dest="engine_process", action="store_const", const=False,
        help="replicas run their engine on a thread of the replica process",
    )  # fmt: skip


def add_gil_switch_interval_arg(parser: Any) -> None:
    """--gil-switch-interval-s (default: a Serve replica's, cluster.engine_loop's); the
    script applies it with sys.setswitchinterval."""
    from cluster.engine_loop import GIL_SWITCH_INTERVAL_S

    parser.add_argument(
        "--gil-switch-interval-s", type=float, default=GIL_SWITCH_INTERVAL_S,
        help="sys.setswitchinterval (default: what a Serve replica sets)",
    )  # fmt: skip


def add_burst_args(parser: Any) -> None:
    """The head that bench.engine_loop and bench.late_burst share: the model and its burst
    (--model, --dtype, --batch, --prompt-len, --max-new), --reps, the GIL switch interval
    and torch's threads; burst_engine builds the engine from them.

    --torch-threads defaults to 1, what a Serve replica runs at by default: Ray sets
    OMP_NUM_THREADS to a replica's num_cpus (ClusterConfig.num_cpus_per_replica: 1 on a CPU
    replica; 0, which Ray also makes 1, on a GPU one). At more threads, an EngineLoop's
    parallel CPU ops run on a second OpenMP pool beside the main thread's, which slowed
    its steps ~4x on a 2-core box (a CPU replica builds its engine on the engine thread).
    """
    parser.add_argument("--model", default=None, help="preset or directory (gpt2 on GPU)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-new", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    add_gil_switch_interval_arg(parser)
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch.set_num_threads before the engine is built (default 1: a Serve replica's,"
        " as Ray sets OMP_NUM_THREADS to its num_cpus, 1 or 0)",
    )  # fmt: skip


def burst_engine(args: Any, cpu_max_new: int, **config: Any) -> tuple[Any, str, int, int]:
    """add_burst_args' engine: sets the switch interval and torch's threads, then builds an
    LLMEngine of max_num_seqs --batch for the burst (gpt2 with 128-token prompts and 128
    new tokens on a GPU; on the CPU gpt2-tiny, 16 and cpu_max_new); config: more
    EngineConfig fields. Returns (engine, model, prompt_len, max_new)."""
    from replica import EngineConfig, LLMEngine

    sys.setswitchinterval(args.gil_switch_interval_s)
    torch.set_num_threads(args.torch_threads)
    on_gpu = torch.cuda.is_available()
    model = args.model or ("gpt2" if on_gpu else "gpt2-tiny")
    prompt_len = args.prompt_len or (128 if on_gpu else 16)
    max_new = args.max_new or (128 if on_gpu else cpu_max_new)
    engine = LLMEngine(
        EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.batch,
                     max_model_len=prompt_len + max_new, **config)
    )  # fmt: skip
    return engine, model, prompt_len, max_new


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": machine_description()} | payload
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
