"""The load test's report: a summary row per router (and the offline peer's, with each
router's tokens/s over it), ratios against Serve's default router, the routing trace's
line."""

from __future__ import annotations

import math

from bench.common import markdown_table

BASELINE_ROUTER = "serve-pow2"  # Ray Serve's default request router
# The metrics compared: keys of bench.load_metrics.compute_metrics, or KEY_STAT for a
# percentile of one (ttft_ms_p50: metrics["ttft_ms"]["p50"]).
RATIO_KEYS = (
    "request_throughput output_token_throughput goodput ttft_ms_p50 ttft_ms_p99 tpot_ms_p50 "
    "tpot_ms_p99 e2e_ms_p50 e2e_ms_p99"
).split()


def _metric(metrics: dict, name: str) -> float:
    """metrics[name], else metrics[KEY][STAT] for a name KEY_STAT; NaN when neither is set."""
    key, _, stat = name.rpartition("_")
    value = metrics.get(name, metrics.get(key, {}).get(stat))
    return math.nan if value is None else float(value)


OFFLINE_ROW = "offline engine"


def x_offline(run: dict, offline: dict | None) -> float:
    """A run's output tokens/s over the offline peer's (NaN without one)."""
    if offline is None:
        return math.nan
    base = offline["metrics"]["output_token_throughput"]
    return run["metrics"]["output_token_throughput"] / base if base > 0 else math.nan


def summary_row(router: str, run: dict, offline: dict | None = None) -> dict:
    """run: bench.load.run_trace's, or the offline peer's (no leak check, no generators)."""
    m = run["metrics"]
    generators = run.get("generator", [])
    leaks = run.get("leak_check")
    return {
        "router": router,
        "path": run["path"],
        "completed": m["completed"],
        "rejected": m["rejected"],
        "errors": m["errors"],
        "lost": m["lost"],
        "req/s": m["request_throughput"],
        "out tok/s": m["output_token_throughput"],
        "x offline": "-" if offline is None else x_offline(run, offline),
        "goodput": m.get("goodput", "-"),
        "cache hit": _hit_rate(run.get("prefix_cache")),
        "TTFT p50": m["ttft_ms"]["p50"],
        "TTFT p99": m["ttft_ms"]["p99"],
        "TPOT p50": m["tpot_ms"]["p50"],
        "TPOT p99": m["tpot_ms"]["p99"],
        "ITL p99": m["itl_ms"]["p99"],
        "E2E p50": m["e2e_ms"]["p50"],
        "E2E p99": m["e2e_ms"]["p99"],
        "leaks": "-" if leaks is None else "none" if leaks["ok"] else "LEAK",
    } | _generator_columns(generators)


def _generator_columns(generators: list[dict]) -> dict:
    """Each generator process's mean CPU over the round in cores ('-' for one that failed),
    the busiest window's, and the tokens one CPU-second carried; '-' without generators."""
    if not generators:
        return dict.fromkeys(("gen CPU", "gen CPU max", "gen tok/CPU-s"), "-")
    cpu = ["-" if g.get("failed") else f"{g['cpu_fraction']:.2f}" for g in generators]
    return {
        "gen CPU": " ".join(cpu),
        "gen CPU max": max(
            (g["cpu_max_window"] for g in generators if not g.get("failed")), default=math.nan
        ),
        "gen tok/CPU-s": _tokens_per_cpu_s(generators),
    }


def _hit_rate(cache: dict | None) -> str:
    """The run's prefix-cache hit rate, or '-' when no replica reported admitting a token."""
    if not cache or cache.get("hit_rate") is None:
        return "-"
    return f"{cache['hit_rate']:.1%}"


def _tokens_per_cpu_s(generators: list[dict]) -> float:
    """Output tokens per CPU-second over every generator process: what one core carries."""
    done = [g for g in generators if not g.get("failed")]
    cpu_s = sum(g["cpu_s"] for g in done)
    return sum(g["num_output_tokens"] for g in done) / cpu_s if cpu_s > 0 else math.nan


def summary_table(runs: dict[str, dict], offline: dict | None = None) -> str:
    """One row per router, the offline peer's first when it ran; latencies in ms,
    throughputs per second."""
    rows = [summary_row(OFFLINE_ROW, offline, offline)] if offline else []
    rows += [summary_row(r, run, offline) for r, run in runs.items()]
    return markdown_table(rows)


def ratios_against(runs: dict[str, dict], baseline: str = BASELINE_ROUTER) -> dict[str, dict]:
    """metric(router) / metric(baseline) per router; empty when the baseline did not run."""
    if baseline not in runs:
        return {}
    base = runs[baseline]["metrics"]
    out: dict[str, dict] = {}
    for router, run in runs.items():
        row = {}
        for name in RATIO_KEYS:
            b, v = _metric(base, name), _metric(run["metrics"], name)
            row[name] = v / b if b and not math.isnan(b) and not math.isnan(v) else math.nan
        out[router] = row
    return out


def ratio_table(ratios: dict[str, dict]) -> str:
    return markdown_table([{"router": r} | row for r, row in ratios.items()])


def routing_line(routing: dict) -> str:
    """One line of cluster.routing_trace.summarize's figures."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    age, load_age = routing["summary_age_ms"], routing["load_age_ms"]
    gap = routing["chosen_minus_min_load"]
    return (
        f"{routing['decisions']} decisions; a replica's summary held part of the prompt in"
        f" {pct(routing['with_match'])}, an admissible one's in"
        f" {pct(routing['admissible_match'])}, followed in {pct(routing['followed'])};"
        f" all replicas admissible {pct(routing['all_admissible'])}, one at the watermark"
        f" while another under half full {pct(routing['imbalanced'])}, held first"
        f" {pct(routing['held_before'])}, no summary {pct(routing['no_summary'])};"
        f" summary age p50 {age['p50']} / p90 {age['p90']} ms,"
        f" load age p50 {load_age['p50']} / p90 {load_age['p90']} ms; chosen - least load"
        f" p50 {gap['p50']} / p90 {gap['p90']}; {routing['mean_replicas_per_prefix']}"
        f" replicas per prefix over {routing['prefixes']} prefixes"
        + (f"; {routing['dropped']} rows dropped" if routing.get("dropped") else "")
    )
