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
`pdl_prologue(PDL)`; its launcher passes `**pdl_launch(device)`, which sets the
constexpr and the launch attribute together. ENABLE_PDL is the switch for A/B runs
(bench --no-pdl).

A kernel may also read, before its wait, what nothing in the step writes: a projection's
weights. `pdl_prologue_prefetching` has each program ask for its share of such a buffer
to be brought into L2 (prefetch.global.L2, a 128-byte line per lane) between the two
instructions, so the weight stream starts while the predecessor still runs, and the
kernel's own loads after the wait hit L2. A prefetch is a hint: it changes no result.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLE_PDL = True


@functools.cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """PDL on this device: Hopper or later, not under the interpreter, ENABLE_PDL set."""
    return ENABLE_PDL and _capable(device)


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch on device: the kernel's PDL constexpr and,
    when it is set, the launch attribute (the two must agree)."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}


@triton.jit
def _prefetch_l2(ptr, num_bytes, LINES: tl.constexpr = 256):
    """This program's share (by its linear id in the grid) of the bytes [ptr, ptr +
    num_bytes) into L2, LINES 128-byte lines at a time."""
    pid = tl.program_id(0) + tl.num_programs(0) * (
        tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)
    )
    num_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    num_lines = tl.cdiv(num_bytes, 128)
    per_program = tl.cdiv(num_lines, num_programs)
    first = pid * per_program
    end = tl.minimum(first + per_program, num_lines)
    base = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    for start in range(first, end, LINES):
        lines = start + tl.arange(0, LINES)
        lines = tl.where(lines < end, lines, first)  # a line again, not one past the end
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [base + lines.to(tl.int64) * 128],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def pdl_prologue_prefetching(PDL: tl.constexpr, const_ptr, num_bytes):
    """pdl_prologue, this program's share of [const_ptr, const_ptr + num_bytes) asked
    into L2 before the wait. Nothing that runs before the kernel in the step may write
    those bytes (weights); num_bytes 0 prefetches nothing."""
    if PDL:
        gdc_launch_dependents()
        _prefetch_l2(const_ptr, num_bytes)
        gdc_wait()


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the next kernel may launch once all our programs started
        gdc_wait()  # our predecessor has finished and its writes are visible
