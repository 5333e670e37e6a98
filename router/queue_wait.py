"""Expected queueing wait: the work queued ahead of a request, at the rate it drains.

A request that enters a replica waits behind that replica's queued prompts (its
snapshot's num_waiting_tokens, plus what this router routed there that no snapshot
shows yet), and behind the requests this router holds, which go to whichever replica
frees first. The rate is measured, not configured: how many prompt tokens a replica's
engine took from its queue per second while the queue was not empty (DrainRates), so it
is the engine's real capacity for the workload it serves, whichever limit binds
(prefill compute, sequence slots, KV blocks).

A mean rate does not see when: a replica whose slots are all taken by outputs that end
together frees them in cohorts (one H200, qwen3-0.6b, 64-token outputs: 256 slots every
~1.2 s), so a request queued just after a cohort waits ~1.2 s whatever the mean says,
and with a 0.3-s bound a third of the requests admitted at 3x capacity started past a
500-ms TTFT SLO. Where the replica forecasts its slots (ReplicaStats.slot_free_steps,
from its running sequences' max_tokens), the wait is also at least the time until the
slot the request needs frees (slot_wait_s).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from replica.stats import ReplicaStats

# The backlogged time a drain rate is measured over: the engine's own tokens_per_s
# window, long enough to hold a few cohorts of sequences ending together (a slot-bound
# replica admits in bursts) and short enough to follow a change of workload.
DRAIN_WINDOW_S = 2.0
# Less backlogged time than this in the window: the rate is unknown, not zero. A replica
# that has just started to queue tells nothing of its rate yet, and a slot-bound one
# admits in cohorts (64-token outputs at 5 ms a step end together every 0.32 s), so a
# shorter span could read a gap between cohorts as a rate of 0.
MIN_BACKLOG_S = 0.5


@dataclass(frozen=True)
class _Interval:
    end_s: float
    duration_s: float
    num_tokens: int


class DrainRates:
    """Per replica, the prompt tokens its engine admitted per second of backlogged time.

    Algorithm: each new snapshot of a replica closes the interval since its previous
    one; when the previous snapshot showed a non-empty queue (num_waiting > 0), the
    engine spent that interval taking from its queue as fast as it could, so the
    interval and the prompt tokens admitted in it (the growth of prefix_query_tokens,
    which counts every admitted sequence's prompt) are kept. The rate is their sums'
    ratio over the last DRAIN_WINDOW_S. An idle or lightly loaded replica (no queue)
    adds nothing, so its measured arrivals never pass for its capacity.
    Invariant: only intervals that end within DRAIN_WINDOW_S of the replica's newest
    snapshot are kept.
    Failure: rate() is None (unknown) with under MIN_BACKLOG_S of backlogged time; a
    replica that restarted under the same id (its counter went back) starts over.
    """

    def __init__(self) -> None:
        self.last: dict[str, ReplicaStats] = {}
        self.intervals: dict[str, deque[_Interval]] = {}

    def observe(self, stats: ReplicaStats) -> None:
        replica_id = stats.replica_id
        previous = self.last.get(replica_id)
        self.last[replica_id] = stats
        if previous is None or stats.timestamp_s <= previous.timestamp_s:
            return
        intervals = self.intervals.setdefault(replica_id, deque())
        num_tokens = stats.prefix_query_tokens - previous.prefix_query_tokens
        if num_tokens < 0:  # a new engine behind the same id
            intervals.clear()
            return
        if previous.num_waiting > 0:
            duration_s = stats.timestamp_s - previous.timestamp_s
            intervals.append(_Interval(stats.timestamp_s, duration_s, num_tokens))
        while intervals and intervals[0].end_s < stats.timestamp_s - DRAIN_WINDOW_S:
            intervals.popleft()

    def forget(self, replica_id: str) -> None:
        self.last.pop(replica_id, None)
        self.intervals.pop(replica_id, None)

    def rate(self, replica_id: str) -> float | None:
        """Prompt tokens per second of backlogged time; None while unknown."""
        intervals = self.intervals.get(replica_id)
        if not intervals:
            return None
        duration_s = sum(i.duration_s for i in intervals)
        if duration_s < MIN_BACKLOG_S:
            return None
        return sum(i.num_tokens for i in intervals) / duration_s


def expected_wait_s(
    queued_tokens: np.ndarray, rates: np.ndarray, num_held_tokens: int = 0
) -> np.ndarray:
    """Seconds a request entering each replica now would wait before its engine takes it.

    queued_tokens (per replica): prompt tokens queued ahead of it there; rates (per
    replica, tokens/s): DrainRates.rate, NaN where unknown; num_held_tokens: prompt
    tokens of the requests this router holds, which enter before it wherever they go,
    so they drain at the known replicas' summed rate. Where the rate is unknown the
    replica's own queue counts as no wait (an idle replica, or one that began to queue
    an instant ago: the next snapshots measure it); a measured rate of 0 with a queue is
    an unbounded wait (inf): the engine took nothing from it for MIN_BACKLOG_S.
    """
    known = ~np.isnan(rates)
    fleet_rate = float(rates[known].sum()) if known.any() else 0.0
    held_s = num_held_tokens / fleet_rate if fleet_rate > 0 else 0.0
    wait_s = np.zeros(len(rates))
    queued = known & (queued_tokens > 0)
    with np.errstate(divide="ignore"):
        wait_s[queued] = queued_tokens[queued] / rates[queued]
    return wait_s + held_s


def slot_wait_s(
    ahead: np.ndarray,
    slot_free_s: np.ndarray,
    age_s: np.ndarray,
    queued_tokens: np.ndarray,
    prefill_rates: np.ndarray,
) -> np.ndarray:
    """Seconds until a request entering each of these replicas (those that forecast their
    slots) now has its sequence slot and the prompts queued ahead of it are prefilled; 0
    where a slot is free for it.

    ahead: requests before it beyond the free slots (running + waiting + this router's
    unseen reservations - max_num_seqs; < 0: a slot is free); slot_free_s: router.fleet's
    forecast rows (seconds after the snapshot at which the running sequences end, soonest
    first, the last repeated); age_s: the snapshot's age. It takes the (ahead + 1)-th slot
    to free; past the forecast's end, at least the last. queued_tokens at prefill_rates
    (tokens/s, 0: unknown): the prompts ahead, which take the slots freeing first (a
    cohort's slots free together, and the prompts that take them get their first tokens
    in turn).
    """
    index = np.clip(ahead, 0, slot_free_s.shape[1] - 1)
    wait_s = slot_free_s[np.arange(len(ahead)), index] - age_s
    np.maximum(wait_s, 0.0, out=wait_s)
    wait_s += np.divide(
        queued_tokens, prefill_rates, out=np.zeros(len(ahead)), where=prefill_rates > 0
    )
    wait_s[ahead < 0] = 0.0
    return wait_s
