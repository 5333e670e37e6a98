"""A record of the routing decisions made in this process, to explain where requests went.

Off unless enabled (bench.load --routing-trace turns it on in its generator processes).
When on, KVFleetRequestRouter adds one RoutingRow per admitted decision: which replica
came first, how many prompt blocks it and the best replica had cached by the published
summaries, the loads the policy compared, and how old the summaries were. That answers
"did the prefix policy see a match, and if so why did it not follow it" without a
debugger on a GPU host: a summary that reached the router late or not at all, a load gap
that outweighed the match (the prefix policy's spill rule), or no admissible replica
holding it.

Process-wide, as cluster.live_stats is: the routers live inside Serve's handles, where
the caller cannot reach them. Bounded: past MAX_ROWS the newest rows are dropped and
counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from replica.stats import ReplicaStats
from router import RouteRequest
from router.admission import Decision
from router.config import RouterConfig
from router.load import watermark_imbalanced

MAX_ROWS = 1 << 20
AFFINITY_TOKENS = 64  # the prompt's prefix that names its group (RouterConfig's default)


@dataclass(frozen=True, slots=True)
class RoutingRow:
    """One admitted decision, as the router saw it."""

    t_s: float  # router clock (time.time())
    request_id: str
    prefix_key: int  # hash of the prompt's first AFFINITY_TOKENS tokens (whole blocks); 0: none
    chosen: str  # the first tier's replica
    chosen_matched: int  # prompt blocks the chosen replica's summary holds
    best_matched: int  # the most any replica's summary holds (admissible or not)
    best_admissible_matched: int  # the most any admissible replica's summary holds
    num_replicas: int
    num_admissible: int
    chosen_load: float  # load_fraction with the request (nan: a last-resort tier)
    min_load: float  # least load among the admissible (nan: none)
    # a replica at the high watermark while another is under half full, by the router's
    # snapshots (router.load.watermark_imbalanced; bench.sim's watermark_imbalance_frac)
    imbalanced: bool
    summary_age_s: float  # now - stamp of the chosen replica's prefix summary (nan: none)
    load_age_s: float  # now - stamp of the load snapshot the decision used (nan: none)
    summary_size: int  # hashes in the chosen replica's summary
    attempt: int  # times this request was held before


_rows: list[RoutingRow] | None = None
_num_dropped = 0


def enable() -> None:
    """Start recording (again, from nothing)."""
    global _rows, _num_dropped
    _rows, _num_dropped = [], 0


def disable() -> None:
    """Stop recording and forget the rows."""
    global _rows, _num_dropped
    _rows, _num_dropped = None, 0


def is_enabled() -> bool:
    return _rows is not None


def drain() -> tuple[list[RoutingRow], int]:
    """The rows so far and how many were dropped past MAX_ROWS; recording goes on, emptied."""
    global _rows, _num_dropped
    rows, dropped = _rows or [], _num_dropped
    if _rows is not None:
        _rows, _num_dropped = [], 0
    return rows, dropped


def prefix_key(request: RouteRequest, block_size: int) -> int:
    """The prompt's group: as the prefix policy's affinity key (0: none)."""
    block_hash = request.leading_block_hash(AFFINITY_TOKENS, block_size) if block_size > 0 else None
    return 0 if block_hash is None else block_hash


def record(
    request: RouteRequest,
    decision: Decision,
    now_s: float,
    summaries: Mapping[str, ReplicaStats],
    config: RouterConfig,
    attempt: int = 0,
) -> None:
    """Add the row of an admitted decision; summaries: the snapshot each replica's prefix
    hashes came from, by replica id (the router's view of Serve's routing stats)."""
    global _num_dropped
    view = decision.view
    if _rows is None or view is None or not decision.tiers:
        return
    if len(_rows) >= MAX_ROWS:
        _num_dropped += 1
        return
    chosen = decision.tiers[0][0]
    ids = list(view.replica_ids)
    slot = ids.index(chosen) if chosen in ids else -1
    admissible = view.admissible
    matched = view.matched if view.matched is not None else np.zeros(len(ids), dtype=np.int64)
    summary = summaries.get(chosen)
    block_size = summary.block_size if summary is not None else 16
    loads = view.loads[admissible]
    _rows.append(
        RoutingRow(
            t_s=now_s,
            request_id=request.request_id,
            prefix_key=prefix_key(request, block_size),
            chosen=chosen,
            chosen_matched=int(matched[slot]) if slot >= 0 else 0,
            best_matched=int(matched.max()) if len(matched) else 0,
            best_admissible_matched=int(matched[admissible].max()) if len(admissible) else 0,
            num_replicas=len(ids),
            num_admissible=len(admissible),
            chosen_load=float(view.loads[slot]) if (admissible == slot).any() else math.nan,
            min_load=float(loads.min()) if len(loads) else math.nan,
            imbalanced=watermark_imbalanced(list(summaries.values()), config.high_watermark),
            summary_age_s=now_s - summary.timestamp_s if summary is not None else math.nan,
            load_age_s=now_s - float(view.timestamps_s[slot]) if slot >= 0 else math.nan,
            summary_size=len(summary.cached_prefix_hashes) if summary is not None else 0,
            attempt=attempt,
        )
    )


def summarize(rows: Sequence[RoutingRow]) -> dict:
    """What the decisions of a run add up to (bench.load prints and saves it).

    - with_match: a replica's summary held some of the prompt; admissible_match: an
      admissible one did; followed: the chosen replica held as much as the best
      admissible one (where one held any).
    - prefixes: for each prefix key, the replicas chosen for it; mean_replicas_per_prefix
      is 1 when every router keeps each prefix on one replica.
    """
    n = len(rows)
    if not n:
        return {"decisions": 0}
    with_match = [r for r in rows if r.best_matched > 0]
    admissible_match = [r for r in rows if r.best_admissible_matched > 0]
    followed = sum(1 for r in admissible_match if r.chosen_matched >= r.best_admissible_matched)
    by_prefix: dict[int, set[str]] = {}
    for r in rows:
        if r.prefix_key:
            by_prefix.setdefault(r.prefix_key, set()).add(r.chosen)
    summary_ages = [1e3 * r.summary_age_s for r in rows if not math.isnan(r.summary_age_s)]
    load_ages = [1e3 * r.load_age_s for r in rows if not math.isnan(r.load_age_s)]
    gaps = [
        r.chosen_load - r.min_load
        for r in rows
        if not (math.isnan(r.chosen_load) or math.isnan(r.min_load))
    ]

    def share(k: int, of: int) -> float | None:
        return round(k / of, 4) if of else None

    def quantiles(values: list[float], digits: int) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p90": None}
        p50, p90 = np.percentile(values, [50, 90]).tolist()
        return {"p50": round(p50, digits), "p90": round(p90, digits)}

    return {
        "decisions": n,
        "with_match": share(len(with_match), n),
        "admissible_match": share(len(admissible_match), n),
        "followed": share(followed, len(admissible_match)),
        "all_admissible": share(sum(1 for r in rows if r.num_admissible == r.num_replicas), n),
        "imbalanced": share(sum(1 for r in rows if r.imbalanced), n),
        "held_before": share(sum(1 for r in rows if r.attempt), n),
        "no_summary": share(sum(1 for r in rows if r.summary_size == 0), n),
        "summary_age_ms": quantiles(summary_ages, 1),
        "load_age_ms": quantiles(load_ages, 1),
        "chosen_minus_min_load": quantiles(gaps, 4),
        "prefixes": len(by_prefix),
        "mean_replicas_per_prefix": (
            round(sum(map(len, by_prefix.values())) / len(by_prefix), 2) if by_prefix else None
        ),
    }
