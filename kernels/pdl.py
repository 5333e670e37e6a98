"""Programmatic dependent launch (PDL): the decode step's kernels overlap their launches.

A decode step of a small model is a chain of ~100 short kernels, and each one
pays a launch and a ramp (its programs start only after the previous grid has
drained) that is a large share of its few microseconds. On Hopper and later a
kernel launched with PDL may start while its predecessor still runs: every
kernel in the chain allows its dependents to launch as soon as all of its own
programs have started (griddepcontrol.launch_dependents), and waits on the
device (griddepcontrol.wait) for its predecessor to finish, with its writes
visible, before it touches memory. Since every kernel waits before its first
load or store, ordering is the plain stream order: a grid runs its memory work
after its predecessor completed, which completed after its own predecessor.
Kernels not launched this way (cuBLAS, torch) end the overlap and nothing else.

Every Triton kernel of the decode step takes a PDL constexpr and starts with
`pdl_prologue(PDL)`; its launcher takes a `pdl: bool = True` keyword and passes
`**pdl_launch(device, pdl)`, which sets the constexpr and the launch attribute together.
The default is on because PDL is the fast path and every caller in the decode chain
benefits; the engine passes EngineOptions.pdl (False for A/B runs, bench --no-pdl), and
pdl_launch turns it off wherever the device cannot (before Hopper, the interpreter).
A kernel may move the trigger later (`pdl_prologue(PDL, TRIGGER_LATER=True)`, then
`pdl_trigger`): fewer of the following
kernels' programs are then resident and waiting while it runs (kernels.linear.overlap_mode
says where that was faster).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device, pdl: bool = True) -> bool:
    """Whether a launch asked for PDL (pdl) gets it on device: Hopper or later, not under
    the interpreter."""
    return pdl and _capable(device)


def pdl_launch(device: torch.device, pdl: bool) -> dict:
    """Keyword arguments of a Triton launch on device: the kernel's PDL constexpr and,
    when it is set, the launch attribute (the two must agree)."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device, pdl) else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr, TRIGGER_LATER: tl.constexpr = False):
    """TRIGGER_LATER: the next kernel launches only once every program has passed
    pdl_trigger, which the kernel calls further on, not from here."""
    if PDL:
        if not TRIGGER_LATER:
            gdc_launch_dependents()  # the next kernel may launch once all our programs started
        gdc_wait()  # our predecessor has finished and its writes are visible


@triton.jit
def pdl_trigger(PDL: tl.constexpr, TRIGGER_LATER: tl.constexpr):
    """The later trigger of a kernel whose pdl_prologue had TRIGGER_LATER."""
    if PDL:
        if TRIGGER_LATER:
            gdc_launch_dependents()
