"""The device's timeline over engine steps: kernels, copies, and the gaps between them.

    python -m bench.step_timeline --model gpt2 --dtype float16 --batch 1 256

Runs --steps decode steps of --batch greedy sequences (or, with --prompt-phase, the
steps of their prompts' burst) under torch.profiler (CUDA activity) and splits each
step's device time, from the event after one copy of tokens to the host to the event
after the next, into kernel time, copy time and idle gaps. A gap is named by the events on
either side of it (kernel > kernel inside a graph replay, kernel > memcpy at its end,
...), and is host-late when the event after it was enqueued by the host only after
the device had gone idle: the host's work, not the device, set that gap. What the
step spends outside the graph's kernels is what a captured copy or a longer launch
queue could win back. The profiler's own callbacks slow the host, so host-late gaps
are an upper bound of what the host costs an unprofiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterable

import torch

from bench.common import machine_description, write_json
from bench.engine import random_prompts
from replica import EngineConfig, LLMEngine, SamplingParams
from replica.config import KV_CACHE_DTYPES

_DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_REGION = "kvfleet.step_timeline"  # the record_function region the profiled steps run in
_MIN_GAP_US = 0.5  # back-to-back events in a trace are often a fraction of a us apart


def region_start(trace: dict, name: str = _REGION) -> float | None:
    """The host time (us) at which the record_function region `name` began."""
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("name") == name:
            return float(e["ts"])
    return None


def device_events(trace: dict) -> tuple[list[dict], dict[int, float]]:
    """A chrome trace's device events in start order, each {kind, name, ts, end, corr},
    and the host time (end of the API call, us) at which each correlation id was enqueued."""
    events, enqueued = [], {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        corr = e.get("args", {}).get("correlation")
        cat = e.get("cat", "")
        if cat in _DEVICE_CATS:
            ts = float(e["ts"])
            events.append(
                {"kind": _DEVICE_CATS[cat], "name": e.get("name", ""), "ts": ts,
                 "end": ts + float(e.get("dur", 0)), "corr": corr}
            )  # fmt: skip
        elif cat in ("cuda_runtime", "cuda_driver") and corr is not None:
            enqueued[corr] = float(e["ts"]) + float(e.get("dur", 0))
    events.sort(key=lambda e: e["ts"])
    return events, enqueued


def _kind(event: dict) -> str:
    if event["kind"] != "memcpy":
        return event["kind"]
    name = event["name"]
    for direction in ("HtoD", "DtoH", "DtoD"):
        if direction in name:
            return f"memcpy {direction}"
    return "memcpy"


def _short(name: str, width: int = 48) -> str:
    """A kernel's name without its template arguments, cut to width."""
    return name.split("<")[0].split("(")[0].strip()[:width]


def step_timeline(
    events: list[dict], enqueued: dict[int, float], step_starts: Iterable[int]
) -> list[dict]:
    """Per step (events[start:next start]): its span to the next step's first event,
    busy time by kind, and gaps by (kind before > kind after), with the host-late part.

    step_starts are indices into events; the last start closes the last step."""
    starts = list(step_starts)
    steps = []
    for first, nxt in zip(starts, starts[1:], strict=False):
        busy: dict[str, float] = defaultdict(float)
        gaps: dict[str, float] = defaultdict(float)
        named: dict[str, float] = defaultdict(float)  # gaps by the events' names
        kernels: dict[str, float] = defaultdict(float)  # each kernel's own time, by name
        host_late = 0.0
        reach = events[first]["ts"]  # the device is busy up to here
        for i in range(first, nxt + 1):
            e = events[i]
            if i > first and e["ts"] - reach > _MIN_GAP_US:
                gap = e["ts"] - reach
                gaps[f"{_kind(events[i - 1])} > {_kind(e)}"] += gap
                named[f"{_short(events[i - 1]['name'])} > {_short(e['name'])}"] += gap
                queued = enqueued.get(e["corr"])
                if queued is not None and queued > reach:
                    host_late += min(gap, queued - reach)
            if i == nxt:
                break
            busy[_kind(e)] += e["end"] - max(e["ts"], reach) if e["end"] > reach else 0.0
            if e["kind"] == "kernel":
                kernels[_short(e["name"])] += e["end"] - e["ts"]
            reach = max(reach, e["end"])
        steps.append(
            {"span_us": events[nxt]["ts"] - events[first]["ts"], "busy_us": dict(busy),
             "gaps_us": dict(gaps), "named_gaps_us": dict(named), "host_late_us": host_late,
             "kernels_us": dict(kernels)}
        )  # fmt: skip
    return steps


def step_starts_after(events: list[dict], marker: str = "memcpy DtoH") -> list[int]:
    """Indices of the events that begin a step: each one right after an event of kind
    `marker` (a step's last device work is its tokens' copy to the host)."""
    return [i + 1 for i, e in enumerate(events[:-1]) if _kind(e) == marker]


def summarize(steps: list[dict]) -> dict:
    """Means over steps, us."""
    mean = lambda key, sub: statistics.mean(s[key].get(sub, 0.0) for s in steps)  # noqa: E731
    kinds = sorted({k for s in steps for k in s["busy_us"]})
    gap_kinds = sorted({k for s in steps for k in s["gaps_us"]})
    return {
        "num_steps": len(steps),
        "span_us": statistics.mean(s["span_us"] for s in steps),
        "busy_us": {k: mean("busy_us", k) for k in kinds},
        "gaps_us": {k: mean("gaps_us", k) for k in gap_kinds},
        "gap_total_us": statistics.mean(sum(s["gaps_us"].values()) for s in steps),
        "host_late_us": statistics.mean(s["host_late_us"] for s in steps),
        "named_gaps_us": {
            k: mean("named_gaps_us", k) for k in {k for s in steps for k in s["named_gaps_us"]}
        },
        "kernels_us": {
            k: mean("kernels_us", k) for k in {k for s in steps for k in s["kernels_us"]}
        },
    }


def format_summary(batch: int, s: dict, top: int = 0) -> str:
    busy = ", ".join(f"{k} {v:.1f}" for k, v in s["busy_us"].items())
    gaps = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["gaps_us"].items(), key=lambda kv: -kv[1]))
    named = sorted(s["named_gaps_us"].items(), key=lambda kv: -kv[1])[:top]
    kernels = sorted(s["kernels_us"].items(), key=lambda kv: -kv[1])[:top]
    return (
        f"batch {batch}: {s['num_steps']} steps, span {s['span_us']:.1f} us; busy: {busy};"
        f" gaps {s['gap_total_us']:.1f} us ({gaps}); host-late {s['host_late_us']:.1f} us"
        + ("\n  idle boundaries, us per step:" if named else "")
        + "".join(f"\n  {v:8.2f}  {k}" for k, v in named)
        + ("\n  kernels, us per step (overlaps counted in each):" if kernels else "")
        + "".join(f"\n  {v:8.2f}  {k}" for k, v in kernels)
    )


def format_steps(steps: list[dict], lead_in_us: float) -> str:
    """One line per step (a burst's prompt phase: its steps differ)."""
    lines = [f"  device idle before the first step's work: {lead_in_us:.1f} us"]
    for i, s in enumerate(steps):
        lines.append(
            f"  step {i}: span {s['span_us']:.1f} us, kernels"
            f" {s['busy_us'].get('kernel', 0.0):.1f}, idle {sum(s['gaps_us'].values()):.1f}"
            f" (host-late {s['host_late_us']:.1f})"
        )
    return "\n".join(lines)


def profile_steps(engine: LLMEngine, steps: int | None) -> dict:
    """A chrome trace of `steps` engine steps (device work included), or with None of
    the steps up to and with the first one that computes no prompt tokens (a burst's
    prompt phase). The steps run inside a record_function region named _REGION."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(_REGION):
            for _ in range(steps or 10**6):
                engine.step()
                if steps is None and not engine.last_step.num_prefill_tokens:
                    break
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def traced_steps(engine: LLMEngine, steps: int) -> list[dict]:
    """The whole steps (step_timeline) among `steps` engine steps run under the profiler."""
    events, enqueued = device_events(profile_steps(engine, steps))
    return step_timeline(events, enqueued, step_starts_after(events))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="profiled decode steps per batch")
    parser.add_argument("--top", type=int, default=12, help="boundaries and kernels listed")
    parser.add_argument(
        "--prompt-phase", action="store_true",
        help="profile each batch's prompt phase (its first steps, up to the first decode-only"
        " step) rather than decode steps",
    )  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_timeline profiles the device: it needs CUDA")
    warm = 16
    max_len = 512
    if args.prompt_len + warm + args.steps + 2 >= max_len:
        raise SystemExit(f"--prompt-len + --steps: past the {max_len} positions of these runs")
    engine = LLMEngine(
        EngineConfig(
            model=args.model, device="cuda", dtype=args.dtype, max_num_seqs=max(args.batch),
            max_model_len=max_len, kv_cache_dtype=args.kv_cache_dtype,
        )
    )  # fmt: skip
    results = []
    for batch in args.batch:
        params = SamplingParams(max_tokens=warm + args.steps + 2, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(batch, args.prompt_len, engine.model_config.vocab_size, batch)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"timeline-{batch}-{i}", prompt, params)
        if args.prompt_phase:
            trace = profile_steps(engine, None)
            events, enqueued = device_events(trace)
            # The first step from its first event: nothing of the burst ran before it.
            steps = step_timeline(events, enqueued, [0] + step_starts_after(events))
            lead_in = events[0]["ts"] - (region_start(trace) or events[0]["ts"])
            summary = summarize(steps) | {"lead_in_us": lead_in, "steps": steps}
            print(format_summary(batch, summary, args.top))
            print(format_steps(steps, lead_in))
        else:
            for _ in range(warm):  # the prefill, then decode steps
                engine.step()
            summary = summarize(traced_steps(engine, args.steps))
            print(format_summary(batch, summary, args.top))
        results.append({"batch": batch} | summary)
        while engine.has_unfinished():
            engine.step()
    write_json(args.out, {"machine": machine_description(), "model": args.model, "rows": results})


if __name__ == "__main__":
    main()
