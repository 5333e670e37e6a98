"""A launched step's sampled tokens on their way to the host: the pinned staging they are
copied into (TokenStaging) and the handle that waits for them (StepHandle).

Sampled tokens stay on the device too (the runner's token_buf), so the next step reads
a token the host has not seen yet; the host's copy only feeds the engine's bookkeeping.
Invariant: the staging alternates between two copies by the step's parity, as the
runner's other staging buffers do, so a step's tokens are never overwritten while its
copy may still be pending: the runner's launch() refuses a step whose parity's last
step was never waited on.
"""

from __future__ import annotations

import torch

from replica.outputs import Logprobs
from replica.runner.logprobs import StepLogprobs


class StepHandle:
    """A launched step's sampled tokens, on their way to the host."""

    def __init__(self, host_tokens: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host_tokens = host_tokens  # [num_sampled], pinned on CUDA
        self.event = event
        self.tokens: list[int] | None = None
        # Logprobs of the rows that ask them, copied under the same event (a step with
        # extras rows only: replica.runner.logprobs).
        self.extras: StepLogprobs | None = None

    def running(self) -> bool:
        """Whether the device has yet to finish the step (never on the CPU, where the step
        ran within its launch)."""
        return self.tokens is None and self.event is not None and not self.event.query()

    def wait(self) -> list[int]:
        if self.tokens is None:
            if self.event is not None:
                self.event.synchronize()
            self.tokens = self.host_tokens.tolist()
        return self.tokens

    def logprobs(self) -> tuple[dict[int, Logprobs], dict[int, list[Logprobs | None]]]:
        """(row -> its token's Logprobs, row -> its request's prompt logprobs, on the row
        of its first output token), for the rows that ask; both empty on most steps."""
        if self.extras is None:
            return {}, {}
        return self.extras.outputs(self.wait())


class TokenStaging:
    """The host staging of a step's sampled tokens, two copies, and the copies into it.

    cache_views: keep the views of a greedy forward's outputs (only where those outputs
    are a graph's, which never move).
    """

    def __init__(self, max_num_seqs: int, device: torch.device, cache_views: bool) -> None:
        self.on_cpu = device.type == "cpu"
        pin = device.type == "cuda"
        self.host = torch.zeros((2, max_num_seqs), dtype=torch.int64, pin_memory=pin)
        # One event per parity marks a step's tokens on the host: a step's handle is waited
        # on before the step after next records its parity's event again (LLMEngine.step).
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else []
        self.cache_views = cache_views
        self._greedy_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def greedy_to_host(
        self, greedy: torch.Tensor, mixed: bool, first: int, num_rows: int, parity: int
    ) -> StepHandle:
        """A greedy decode forward's sampled rows first..num_rows of its argmax to the host.
        A graph's outputs never move, so their views are made once (a view is a few us
        of the host's time, which on a slow host sets a 256-row step's pace)."""
        if num_rows == first:
            return StepHandle(self.host[parity, :0], None)
        key = (mixed, len(greedy), first, num_rows, parity)  # len: the graph's size
        views = self._greedy_views.get(key)
        if views is None:
            views = greedy[first:num_rows], self.host[parity, : num_rows - first]
            if self.cache_views:
                self._greedy_views[key] = views
        return self.to_host(*views, parity)

    def to_host(self, tokens: torch.Tensor, host: torch.Tensor, parity: int) -> StepHandle:
        """Copy a step's tokens to their host staging; the handle waits for the copy."""
        if self.on_cpu:
            host.copy_(tokens)
            return StepHandle(host, None)
        host.copy_(tokens, non_blocking=True)
        event = self.events[parity]
        event.record()
        return StepHandle(host, event)
