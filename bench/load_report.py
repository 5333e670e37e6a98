"""Tables and PNG plots of load runs: latency CDFs per router, KV usage per replica over time."""

from __future__ import annotations

import math

from bench.common import markdown_table
from bench.load_metrics import RequestRecord

BASELINE_ROUTER = "serve-pow2"  # Ray Serve's default request router
RATIO_KEYS = (
    ("request_throughput", None),
    ("output_token_throughput", None),
    ("goodput", None),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "p50"),
    ("tpot_ms", "p99"),
    ("e2e_ms", "p50"),
    ("e2e_ms", "p99"),
)


def _metric(metrics: dict, key: str, stat: str | None) -> float:
    value = metrics.get(key, math.nan)
    if stat is not None:
        value = value.get(stat, math.nan) if isinstance(value, dict) else math.nan
    return math.nan if value is None else float(value)


def summary_row(router: str, run: dict) -> dict:
    m = run["metrics"]
    return {
        "router": router,
        "completed": m["completed"],
        "rejected": m["rejected"],
        "errors": m["errors"],
        "lost": m["lost"],
        "req/s": m["request_throughput"],
        "out tok/s": m["output_token_throughput"],
        "goodput": m.get("goodput", "-"),
        "cache hit": _hit_rate(run.get("prefix_cache")),
        "TTFT p50": m["ttft_ms"]["p50"],
        "TTFT p99": m["ttft_ms"]["p99"],
        "TPOT p50": m["tpot_ms"]["p50"],
        "TPOT p99": m["tpot_ms"]["p99"],
        "ITL p99": m["itl_ms"]["p99"],
        "E2E p50": m["e2e_ms"]["p50"],
        "E2E p99": m["e2e_ms"]["p99"],
        "leaks": "none" if run["leak_check"]["ok"] else "LEAK",
        "gen CPU max": max((p["cpu_max_window"] for p in run["generator"]), default=math.nan),
        "gen tok/CPU-s": _tokens_per_cpu_s(run["generator"]),
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


def summary_table(runs: dict[str, dict]) -> str:
    """One row per router; latencies in ms, throughputs per second."""
    rows = [summary_row(r, run) for r, run in runs.items()]
    return markdown_table(rows)


def ratios_against(runs: dict[str, dict], baseline: str = BASELINE_ROUTER) -> dict[str, dict]:
    """metric(router) / metric(baseline) per router; empty when the baseline did not run."""
    if baseline not in runs:
        return {}
    base = runs[baseline]["metrics"]
    out: dict[str, dict] = {}
    for router, run in runs.items():
        row = {}
        for key, stat in RATIO_KEYS:
            b, v = _metric(base, key, stat), _metric(run["metrics"], key, stat)
            name = key if stat is None else f"{key}_{stat}"
            row[name] = v / b if b and not math.isnan(b) and not math.isnan(v) else math.nan
        out[router] = row
    return out


def ratio_table(ratios: dict[str, dict]) -> str:
    return markdown_table([{"router": r} | row for r, row in ratios.items()])


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v for v in values if not math.isnan(v))
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_latency_cdfs(records_by_router: dict[str, list[RequestRecord]], path: str) -> None:
    """TTFT, TPOT and E2E CDFs (ms) of completed requests, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("TTFT", lambda r: r.ttft_s),
        ("TPOT", lambda r: r.tpot_s),
        ("E2E", lambda r: r.e2e_s),
    )
    for ax, (title, get) in zip(axes, panels):
        for router, records in records_by_router.items():
            xs, ys = _cdf([get(r) * 1e3 for r in records if r.outcome == "ok"])
            if xs:
                ax.step(xs, ys, where="post", label=router)
        ax.set_title(f"{title} CDF")
        ax.set_xscale("log")  # tails span orders of magnitude
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_usage(samples_by_router: dict[str, list[dict]], path: str) -> None:
    """KV usage of each replica over the run, one panel per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(samples_by_router)
    fig, axes = plt.subplots(n, 1, figsize=(10, 3 * n), squeeze=False)
    for ax, (router, samples) in zip(axes[:, 0], samples_by_router.items()):
        replicas = sorted({s["replica_id"] for s in samples})
        for index, replica in enumerate(replicas):
            mine = [s for s in samples if s["replica_id"] == replica]
            ax.plot(
                [s["t_s"] for s in mine],
                [s["kv_usage"] for s in mine],
                label=f"replica {index} ({replica[-8:]})",
            )
        ax.set_title(f"KV usage per replica: {router}")
        ax.set_xlabel("s since start")
        ax.set_ylabel("kv_usage")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if replicas:
            ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        f" all replicas admissible {pct(routing['all_admissible'])}, imbalanced"
        f" {pct(routing['imbalanced'])}, held first {pct(routing['held_before'])}, no summary"
        f" {pct(routing['no_summary'])}; summary age p50 {age['p50']} / p90 {age['p90']} ms,"
        f" load age p50 {load_age['p50']} / p90 {load_age['p90']} ms; chosen - least load"
        f" p50 {gap['p50']} / p90 {gap['p90']}; {routing['mean_replicas_per_prefix']}"
        f" replicas per prefix over {routing['prefixes']} prefixes"
        + (f"; {routing['dropped']} rows dropped" if routing.get("dropped") else "")
    )
