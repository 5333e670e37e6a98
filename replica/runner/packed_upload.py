"""PackedUpload: a step's small host arrays to the device in one copy, from pinned staging.

A step's side inputs (the extras rows' indices, penalties, logit_bias entries, sampling
parameters) are a handful of small arrays whose sizes change every step. Each its own
copy would cost a launch and a page-locked allocation apiece (`.pin_memory()` allocates
every time); here they are packed, each at a 16-byte boundary (the alignment Triton's
compiled kernels assume), into a persistent pinned staging buffer and copied once into a
persistent device buffer, whose views the step reads. Two staging copies alternate by
the step's parity, as the runner's other staging buffers do, so a step's bytes are never
overwritten while its copy may still be pending.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16


class PackedUpload:
    """One device buffer serves every step: the next step's copy into it is queued on
    the same stream behind every launch that reads this step's views. A step that needs
    more bytes than held replaces the buffers (doubling); views still queued keep the old
    device buffer alive, and the caching host allocator holds the old pinned one until
    its pending copy is done."""

    def __init__(self, device: torch.device, capacity_bytes: int = 4096) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self._allocate(capacity_bytes)

    def _allocate(self, capacity_bytes: int) -> None:
        self.capacity = -(-capacity_bytes // _ALIGN) * _ALIGN
        self.staging = torch.zeros((2, self.capacity), dtype=torch.uint8, pin_memory=self.pin)
        self.staging_np = self.staging.numpy()
        self.device_bytes = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)

    def upload(self, parity: int, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """arrays (int64, int32, float32 or bool numpy arrays) on the device, in one copy
        not waited for (the step's forward is queued ahead of it); on the CPU, the arrays
        themselves."""
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // _ALIGN) * _ALIGN
        if end > self.capacity:
            self._allocate(max(end, 2 * self.capacity))
        host = self.staging_np[parity]
        for a, at in zip(arrays, offsets, strict=True):
            host[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.device_bytes[:end].copy_(self.staging[parity, :end], non_blocking=True)
        return [
            self.device_bytes[at : at + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, at in zip(arrays, offsets, strict=True)
        ]


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}
