"""An HTTP ingress replica's own overload: how late its event loop runs, and when to shed.

Admission (router/) refuses a request whose expected wait at the router and on the replica
is past RouterConfig.max_queue_wait_s, but it runs inside the ingress's handler: a request
that waits before the handler runs (in uvicorn, behind HAProxy, behind a loop busy writing
other requests' SSE events) is a queue admission cannot see. On one H200 (qwen3-0.6b, one
replica, two ingress replicas) offered 2x capacity, TTFT p50 went to 3.6 s and even the
503s took 1.86 s (p99): an ingress spends ~7.6 ms of CPU per short request and ~112 us
per streamed token (CPU box), so two of them cannot carry 460 requests/s of 64 tokens.

LoopLagMeter measures that wait where it happens: a timer on the loop fires every PERIOD_S
and notes how late each wake-up comes (the overshoot is about one pass of the loop: the
time every other ready callback took) and how much CPU the process used meanwhile. It
runs on the loop Serve runs the handlers on (a user-code thread's), not on the replica's
main loop, where uvicorn parses requests and writes responses: that loop's work shows here
as it holds the GIL. LoopLagShedder refuses new completion and chat requests at the top of
the handler, before their bodies are read, as an OverloadedError (HTTP 503 with
Retry-After), while both hold over the last WINDOW wake-ups:

- their median lateness is past ClusterConfig.ingress_max_loop_lag_s: a loop over the
  bound for good is late on every wake-up, while one long pass (a GC of the whole heap,
  the first request's imports) is late on one, which the median ignores;
- the process ran at least BUSY_CORES: the lateness is its own work. A loop late while its
  process gets little CPU waits for the host's other processes (on a 2-core host running
  the replicas, 112 ms at the first request of an idle app), and refusing its requests
  would not make it faster.

Requests already admitted, streams included, go on: shedding new ones is what lets the
loop catch up with them.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Callable

from router.errors import OverloadedError

# 50 wake-ups a second, each an epoll return and a timer callback: 7.8 ms of CPU a second
# on the CPU box, 0.8% of a core (a task sleeping 10 ms took 18); a pass of 20 ms, a fifth
# of the default bound, is seen.
PERIOD_S = 0.02
# The wake-ups a reading covers: 0.1 s of an idle loop; a loop whose every pass is past
# the default bound (0.1 s) is read as over it within ~0.4 s, while two stalls among five
# wake-ups are not.
WINDOW = 5
# A loop the process runs for half a core or more is busy with work of its own: an
# ingress shedding on the H200 (qwen3, 5x capacity) ran 0.80 cores, one serving at
# capacity 0.36, and the GIL holds a Python process near one.
BUSY_CORES = 0.5


class LoopLagMeter:
    """How late the event loop it runs on serves a callback, and the CPU its process uses.

    Started on first use (`start`, from the loop to measure); both readings are 0 until
    WINDOW wake-ups have been seen. The clocks are injected (`clock`, monotonic seconds;
    `cpu_clock`, the process's CPU seconds) so the readings are testable without sleeping
    (`observe`)."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        window: int = WINDOW,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        if not period_s > 0 or window < 1:
            raise ValueError(f"period_s must be > 0 and window >= 1, got {period_s!r}, {window!r}")
        self.period_s = period_s
        self.window = window
        self.clock = clock
        self.cpu_clock = cpu_clock
        # (lateness, wall, CPU) of the last `window` wake-ups, after the one before them
        # (its lateness unused): the window's CPU share needs where it began.
        self.wakes: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=window + 1
        )
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start measuring the running loop (once; later calls do nothing)."""
        if self.timer is None:
            now_s = self.clock()
            self.wakes.append((0.0, now_s, self.cpu_clock()))
            self._schedule(asyncio.get_running_loop(), now_s)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _schedule(self, loop: asyncio.AbstractEventLoop, now_s: float) -> None:
        self.timer = loop.call_later(self.period_s, self._wake, loop, now_s + self.period_s)

    def _wake(self, loop: asyncio.AbstractEventLoop, due_s: float) -> None:
        now_s = self.clock()
        self.observe(now_s - due_s, now_s, self.cpu_clock())
        self._schedule(loop, now_s)

    def observe(self, lag_s: float, now_s: float, cpu_s: float) -> None:
        """One wake-up lag_s late (early counts as on time), at now_s with the process's
        CPU clock at cpu_s."""
        self.wakes.append((max(0.0, lag_s), now_s, cpu_s))

    def full(self) -> bool:
        return len(self.wakes) > self.window

    def lag_s(self) -> float:
        """The median lateness of the last `window` wake-ups."""
        if not self.full():
            return 0.0
        return statistics.median(lag for lag, _, _ in list(self.wakes)[1:])

    def busy_cores(self) -> float:
        """The process's CPU seconds per second over the last `window` wake-ups."""
        if not self.full():
            return 0.0
        (_, start_s, start_cpu_s), (_, end_s, end_cpu_s) = self.wakes[0], self.wakes[-1]
        return (end_cpu_s - start_cpu_s) / max(end_s - start_s, 1e-9)


class LoopLagShedder:
    """Refuses new requests while the loop's lag is past max_loop_lag_s (None: never) and
    the process is busy (min_busy_cores of CPU or more: the lag is its own work).

    `start()` from the loop the handlers run on (the ingress's constructor: Serve runs
    a replica's constructor and handlers on one user-code loop), or else the first
    `check()` starts the meter. `check()`, called at the top of a handler, returns the
    OverloadedError to answer with, or None. Its Retry-After is RETRY_AFTER_S: a loop
    that has caught up reads under the bound after WINDOW prompt wake-ups (0.1 s), so the
    soonest a retry could be taken is the header's smallest whole number of seconds."""

    RETRY_AFTER_S = 1.0

    def __init__(
        self,
        max_loop_lag_s: float | None,
        meter: LoopLagMeter | None = None,
        min_busy_cores: float = BUSY_CORES,
    ) -> None:
        if max_loop_lag_s is not None and not max_loop_lag_s > 0:
            raise ValueError(f"max_loop_lag_s must be > 0 or None, got {max_loop_lag_s!r}")
        if not min_busy_cores >= 0:
            raise ValueError(f"min_busy_cores must be >= 0, got {min_busy_cores!r}")
        self.max_loop_lag_s = max_loop_lag_s
        self.min_busy_cores = min_busy_cores
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
        cores = self.meter.busy_cores()
        if cores < self.min_busy_cores:
            return None  # late waiting for the host's CPU, not for its own work
        reason = (
            f"this ingress replica's event loop runs {1e3 * lag_s:.0f} ms late, past "
            f"ingress_max_loop_lag_s ({1e3 * self.max_loop_lag_s:.0f} ms), while busy "
            f"({cores:.2f} cores)"
        )
        return OverloadedError(self.RETRY_AFTER_S, reason)
