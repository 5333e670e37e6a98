"""Per-request outcomes of a load run and the metrics over them (vLLM's definitions).

Definitions (vLLM benchmark_serving), over completed requests only:
  TTFT  time from sending the request to its first output token.
  TPOT  (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token.
  ITL   the gap between consecutive chunks of one request. A chunk here is one engine
        step's tokens for the request, which is one token unless the step produced more.
  E2E   time from sending the request to its last token.
  duration  from the run's start to the end of its last request (completed or failed).
  goodput   completed requests meeting every SLO given (TTFT, TPOT, E2E), per second of
            duration; a one-token request has TPOT 0 for this test, as in vLLM.
Accounting: every request of the trace ends as "ok" (a completion with a finish reason),
"rejected" (OverloadedError), or "error" (any other typed exception, by type name). A
request with none of those by the end of the run, or whose record never came back (its
generator process died), is lost; a correct run has zero lost.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from bench.common import summary_ms

OUTCOMES = ("ok", "rejected", "error", "lost")


@dataclass
class RequestRecord:
    """What one generator process saw of one request; times in seconds.

    sent_s and end_s are offsets from the run's start; chunk_times_s are offsets from
    sent_s, one per chunk received, with chunk_num_tokens tokens each.
    """

    index: int
    num_prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float = math.nan
    end_s: float = math.nan
    outcome: str = "lost"
    error_type: str | None = None
    error_message: str | None = None
    finish_reason: str | None = None
    replica_id: str = ""
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    # From sent to the engine's admission (the ack's admitted_s, a wall clock on the
    # replica's host: meaningful when generators and replicas share a host).
    admit_s: float = math.nan

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] if self.chunk_times_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.chunk_times_s[-1] if self.chunk_times_s else math.nan

    @property
    def tpot_s(self) -> float:
        """(E2E - TTFT) / (n - 1); NaN when fewer than two output tokens."""
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else math.nan

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        tpot_s = record.tpot_s if record.num_output_tokens > 1 else 0.0
        return all(
            limit_ms is None or value_s * 1e3 <= limit_ms
            for limit_ms, value_s in (
                (self.ttft_ms, record.ttft_s),
                (self.tpot_ms, tpot_s),
                (self.e2e_ms, record.e2e_s),
            )
        )


@dataclass(frozen=True)
class Accounting:
    """How every request of the trace ended."""

    num_expected: int
    num_ok: int
    num_rejected: int
    num_errors: int
    errors_by_type: dict[str, int]
    lost_indices: list[int]

    @property
    def num_lost(self) -> int:
        return len(self.lost_indices)


def account(records: list[RequestRecord], expected_indices: list[int]) -> Accounting:
    """Tally outcomes; an expected request with no record, or a "lost" one, is lost.

    Raises ValueError on a record for an unexpected or duplicated index: the generator
    must report each request exactly once.
    """
    expected = set(expected_indices)
    by_index: dict[int, RequestRecord] = {}
    for record in records:
        if record.index not in expected:
            raise ValueError(f"record for request {record.index}, which is not in the trace")
        if record.index in by_index:
            raise ValueError(f"request {record.index} was reported twice")
        if record.outcome not in OUTCOMES:
            raise ValueError(f"request {record.index}: unknown outcome {record.outcome!r}")
        by_index[record.index] = record
    outcomes = Counter(r.outcome for r in by_index.values())
    lost = sorted(i for i in expected if i not in by_index or by_index[i].outcome == "lost")
    errors = Counter(
        r.error_type or "?" for r in by_index.values() if r.outcome in ("error", "rejected")
    )
    return Accounting(
        num_expected=len(expected),
        num_ok=outcomes["ok"],
        num_rejected=outcomes["rejected"],
        num_errors=outcomes["error"],
        errors_by_type=dict(sorted(errors.items())),
        lost_indices=lost,
    )


def compute_metrics(
    records: list[RequestRecord], expected_indices: list[int], slo: SLO | None = None
) -> dict:
    """The run's metrics: accounting, throughput, goodput, latency summaries in ms."""
    acc = account(records, expected_indices)
    done = [r for r in records if r.outcome == "ok"]
    ended = [r.end_s for r in records if r.outcome != "lost" and not math.isnan(r.end_s)]
    duration_s = max(ended) if ended else math.nan
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)

    def per_s(count: float) -> float:
        return count / duration_s if duration_s > 0 else math.nan

    metrics = {
        "num_requests": acc.num_expected,
        "completed": acc.num_ok,
        "rejected": acc.num_rejected,
        "errors": acc.num_errors,
        "errors_by_type": acc.errors_by_type,
        "error_examples": _error_examples(records),
        "lost": acc.num_lost,
        "lost_indices": acc.lost_indices[:50],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(acc.num_ok),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": summary_ms([r.ttft_s for r in done]),
        "tpot_ms": summary_ms([r.tpot_s for r in done]),
        "itl_ms": summary_ms([gap for r in done for gap in r.itls_s]),
        "e2e_ms": summary_ms([r.e2e_s for r in done]),
        "admit_ms": summary_ms([r.admit_s for r in done]),  # leaves out the NaNs (no ack)
        "requests_per_replica": dict(sorted(Counter(r.replica_id for r in done).items())),
    }
    if slo is not None and slo.is_set:
        good = sum(1 for r in done if slo.met_by(r))
        metrics["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
        metrics["good_requests"] = good
        metrics["goodput"] = per_s(good)
    return metrics


def _error_examples(records: list[RequestRecord], per_type: int = 2) -> dict[str, list[str]]:
    """The first messages of each error type, with when the request was sent and ended."""
    out: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: r.index):
        if r.outcome in ("error", "rejected") and len(out.get(r.error_type or "?", [])) < per_type:
            out.setdefault(r.error_type or "?", []).append(
                f"request {r.index} sent at {r.sent_s:.3f} s, ended at {r.end_s:.3f} s: "
                f"{r.error_message}"
            )
    return out


def prefix_placement(records: list[RequestRecord], prefix_ids: dict[int, int]) -> dict:
    """Where each shared prefix's requests ran: share of them on the replica that ran most of
    that prefix (1.0: every prefix kept on one replica; about 1/replicas: spread at random),
    weighted by requests, and the mean number of replicas a prefix ran on.

    prefix_ids: request index -> the prefix it shares (RequestSpec.prefix_id); completed
    requests only, since a failed one may never have reached a replica.
    """
    by_prefix: dict[int, Counter] = {}
    for r in records:
        prefix_id = prefix_ids.get(r.index)
        if prefix_id is not None and r.outcome == "ok" and r.replica_id:
            by_prefix.setdefault(prefix_id, Counter())[r.replica_id] += 1
    if not by_prefix:
        return {"prefixes": 0, "top_replica_share": None, "mean_replicas_per_prefix": None}
    num_requests = sum(sum(c.values()) for c in by_prefix.values())
    on_top = sum(c.most_common(1)[0][1] for c in by_prefix.values())
    return {
        "prefixes": len(by_prefix),
        "top_replica_share": round(on_top / num_requests, 4),
        "mean_replicas_per_prefix": round(sum(map(len, by_prefix.values())) / len(by_prefix), 2),
    }
