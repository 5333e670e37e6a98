"""Typed errors the router raises to callers."""

from __future__ import annotations


class OverloadedError(Exception):
    """No replica can admit the request now; retry after retry_after_s seconds.

    Raised by admission on the "reject" overload mode, and on the "hold" mode
    once the bounded wait (RouterConfig.max_hold_s) is spent. Its args are plain
    (a float and a str) so it pickles across Ray processes unchanged.
    """

    def __init__(self, retry_after_s: float, reason: str = "all replicas are overloaded") -> None:
        super().__init__(retry_after_s, reason)
        self.retry_after_s = float(retry_after_s)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason}; retry after {self.retry_after_s:.3f}s"
