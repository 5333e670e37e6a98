"""An HTTP ingress replica's own overload: how late its event loop runs, and when to shed.

Admission (router/) refuses a request whose expected wait at the router and on the replica
is past RouterConfig.max_queue_wait_s, but it runs inside the ingress's handler: a request
that waits before the handler runs (in uvicorn, behind HAProxy, behind a loop busy writing
other requests' SSE events) is a queue admission cannot see. On one H200 (qwen3-0.6b, one
replica, two ingress replicas) offered 2x capacity, TTFT p50 went to 3.6 s and even the
503s took 1.86 s (p99): an ingress spends ~7.6 ms of CPU per short request and ~112 us
per streamed token (CPU box), so two of them cannot carry 460 requests/s of 64 tokens.

LoopLagMeter measures that wait where it happens: a timer on the loop fires every PERIOD_S
and notes how late each wake-up comes (the overshoot is about one pass of the
loop: the time every other ready callback took). Its reading is a time-weighted moving
average of the overshoots (time constant TAU_S), or the lateness of the wake-up now due
if that is larger already (a loop stuck on one long pass). It runs on the loop Serve runs
the handlers on (a user-code thread's), not on the replica's main loop, where uvicorn
parses requests and writes responses: that loop's work shows here only as it holds the
GIL. LoopLagShedder holds the
reading against ClusterConfig.ingress_max_loop_lag_s: past it, new completion and chat
requests are refused at the top of the handler, before their bodies are read, as an
OverloadedError (HTTP 503 with Retry-After). Requests already admitted, streams
included, go on: shedding new ones is what lets the loop catch up with them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from router.errors import OverloadedError

# 50 wake-ups a second, each an epoll return and a timer callback: 7.8 ms of CPU a second
# on the CPU box, 0.8% of a core (a task sleeping 10 ms took 18); a pass of 20 ms, a fifth
# of the default bound, is seen.
PERIOD_S = 0.02
# A single long pass (a GC of the whole heap, a burst of arrivals parsed together) moves
# the reading by 1 - exp(-pass / TAU_S) of itself: a 0.3-s stall to 0.14 s, which sheds
# for ~0.2 s; a loop over the bound for good crosses it within ~0.5 s.
TAU_S = 0.5


class LoopLagMeter:
    """How late the event loop it runs on serves a callback, in seconds.

    Started on first use (`start`, from the loop to measure); `lag_s()` is 0 until then.
    The clock is injected (`clock`, monotonic seconds) so the averaging is testable
    without sleeping (`observe`)."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        tau_s: float = TAU_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0 or not tau_s > 0:
            raise ValueError(f"period_s and tau_s must be > 0, got {period_s!r}, {tau_s!r}")
        self.period_s = period_s
        self.tau_s = tau_s
        self.clock = clock
        self.smoothed_lag_s = 0.0
        self.due_s: float | None = None  # when the pending wake-up is due
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start measuring the running loop (once; later calls do nothing)."""
        if self.timer is None:
            self._schedule(asyncio.get_running_loop(), self.clock())

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.due_s = None

    def _schedule(self, loop: asyncio.AbstractEventLoop, now_s: float) -> None:
        self.due_s = now_s + self.period_s
        self.timer = loop.call_later(self.period_s, self._wake, loop, now_s)

    def _wake(self, loop: asyncio.AbstractEventLoop, start_s: float) -> None:
        now_s = self.clock()
        self.observe(now_s - (start_s + self.period_s), now_s - start_s)
        self._schedule(loop, now_s)

    def observe(self, lag_s: float, interval_s: float) -> None:
        """One wake-up lag_s late, interval_s after the last: weighted by the time it
        covers, so a slow loop (few, long intervals) moves the average as fast as a
        quick one."""
        weight = 1.0 - math.exp(-max(0.0, interval_s) / self.tau_s)
        self.smoothed_lag_s += weight * (max(0.0, lag_s) - self.smoothed_lag_s)

    def lag_s(self) -> float:
        """The smoothed lag, or how overdue the pending wake-up is, whichever is larger:
        read from a callback on the measured loop, an overdue wake-up means the loop has
        been busy that long since it was due."""
        overdue_s = 0.0 if self.due_s is None else self.clock() - self.due_s
        return max(self.smoothed_lag_s, overdue_s)


class LoopLagShedder:
    """Refuses new requests while the loop's lag is past max_loop_lag_s (None: never).

    `start()` from the loop the handlers run on (the ingress's constructor: Serve runs
    a replica's constructor and handlers on one user-code loop), or else the first
    `check()` starts the meter. `check()`, called at the top of a handler, returns the
    OverloadedError to answer with, or None. Its Retry-After is how long the smoothed lag
    takes to decay back to the bound if the loop were idle from now on (tau * ln(lag /
    bound)), at least MIN_RETRY_AFTER_S: the soonest this replica could take the request."""

    MIN_RETRY_AFTER_S = 1.0

    def __init__(self, max_loop_lag_s: float | None, meter: LoopLagMeter | None = None) -> None:
        if max_loop_lag_s is not None and not max_loop_lag_s > 0:
            raise ValueError(f"max_loop_lag_s must be > 0 or None, got {max_loop_lag_s!r}")
        self.max_loop_lag_s = max_loop_lag_s
        self.meter = LoopLagMeter() if meter is None else meter

    def start(self) -> None:
        """Start measuring the running loop, unless shedding is off."""
        if self.max_loop_lag_s is not None:
            self.meter.start()

    def loop_lag_s(self) -> float | None:
        """The meter's reading (for /metrics); None when shedding is off (not measured)."""
        return None if self.max_loop_lag_s is None else self.meter.lag_s()

    def check(self) -> OverloadedError | None:
        if self.max_loop_lag_s is None:
            return None
        self.meter.start()
        lag_s = self.meter.lag_s()
        if lag_s <= self.max_loop_lag_s:
            return None
        decay_s = self.meter.tau_s * math.log(lag_s / self.max_loop_lag_s)
        reason = (
            f"this ingress replica's event loop runs {1e3 * lag_s:.0f} ms late, past "
            f"ingress_max_loop_lag_s ({1e3 * self.max_loop_lag_s:.0f} ms)"
        )
        return OverloadedError(max(self.MIN_RETRY_AFTER_S, decay_s), reason)
