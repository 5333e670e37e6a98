"""StepHandle: a launched step's sampled tokens, on their way to the host."""

from __future__ import annotations

import torch


class StepHandle:
    """A launched step's sampled tokens, on their way to the host."""

    def __init__(self, host_tokens: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host_tokens = host_tokens  # [num_sampled], pinned on CUDA
        self.event = event
        self.tokens: list[int] | None = None

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
