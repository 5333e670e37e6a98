"""EagerGraph: a CUDA graph's stand-in on the CPU, for tests of the graph path's host side.

With the model runner's emulate_graphs_on_cpu (tests), a "graph" is an EagerGraph: its
replay runs the forward again and copies the outputs to where the first call left them,
and the model runner takes the CUDA path's shapes (padded buckets) and samplers
(kernels.sampling, under the Triton interpreter). CI has no GPU; this way it covers
the host side of the graph path (which graph a step replays, what it stages, which
rows it reads back) that otherwise only the GPU tests reach.

A rerun reads whatever tensors the forward's Python reaches now, where a CUDA graph
reads the memory of its capture: a buffer rebound to a new tensor after capture (in
place of a copy into it) would go unseen by the graph and by a plain rerun alike. So an
EagerGraph logs the storages its forward reads from outside itself (a TorchDispatchMode
over every op) and a replay that reads one its capture did not raises StaleReadError.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class StaleReadError(AssertionError):
    """An EagerGraph's replay read a tensor its capture did not: a CUDA graph would have
    read the captured one."""


class _ReadLog(TorchDispatchMode):
    """The storages a call's ops read that the call did not make (tensors kept: no later
    allocation takes their address), and weak references to those it made, by storage
    address."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: dict[int, torch.Tensor] = {}
        self.made: dict[int, list[weakref.ref]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in _tensors(args, kwargs.values()):
            key = _storage_address(t)
            if key and key not in self.made:
                self.outside.setdefault(key, t)
        out = func(*args, **kwargs)
        for t in _tensors((out,)):
            key = _storage_address(t)
            if key and key not in self.outside:  # an in-place op returns what it was given
                self.made.setdefault(key, []).append(weakref.ref(t))
        return out

    def kept(self) -> dict[int, torch.Tensor]:
        """Of the storages the call made, those something still holds (its outputs, a
        buffer it allocated and kept), with a tensor of each. Its freed temporaries are
        left out: a buffer rebound later may take one's address."""
        kept = {}
        for key, refs in self.made.items():
            for ref in refs:
                tensor = ref()
                if tensor is not None:
                    kept[key] = tensor
                    break
        return kept


def _tensors(*groups: Any) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments or results: each one, or in a list or tuple
    (what aten ops take and return; a pytree walk cost the emulated tests ~1/3 more)."""
    for group in groups:
        for item in group:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, list | tuple):
                yield from (t for t in item if isinstance(t, torch.Tensor))


def _storage_address(t: Any) -> int:
    """A tensor's storage address (0 for no tensor, or one with no memory)."""
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0


class EagerGraph:
    """A CUDA graph's stand-in on the CPU: replay() runs fn again and copies what it
    returns into the tensors of its first call (a graph's outputs never move). A replay
    that reads a tensor the first call neither read nor made and kept raises
    StaleReadError."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        with _ReadLog() as log:
            self.out = fn()
        self._captured = {**log.outside, **log.kept()}  # what a replay may read

    def replay(self) -> None:
        with _ReadLog() as log:
            out = self.fn()
        stale = [t for key, t in log.outside.items() if key not in self._captured]
        if stale:
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in stale[:4])
            raise StaleReadError(
                f"a replay read {len(stale)} tensor(s) its capture did not ({shapes}): a"
                " CUDA graph reads the captured memory, so the step must copy into the"
                " captured buffers, not rebind them"
            )
        _copy_into(self.out, out)

    def pool(self) -> None:
        return None


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple | list):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    else:
        assert dst is None and src is None, f"a graph output of type {type(dst).__name__}"
