"""Triton penalties: repetition, frequency and presence over a step's penalized rows, in one pass.

The logits processors (replica.runner.logits_processors) apply, to row i < P of a step's
extras logits [E, vocab] (float32, in place), with its request's counts row
s = state_rows[i] (output-token counts, int32) and prompt_mask row (prompt tokens):

    seen = counts[s] > 0
    repetition r: where(seen | prompt_mask[s], where(x > 0, x / r, x * r), x)
    then x - frequency * counts[s] - presence * seen

In torch that is ~12 launches (two row gathers, the casts, each product, two wheres, two
subtractions) and as many passes over [P, vocab]: on an H200 with qwen3's 151,936-column
rows and 26 penalized rows a step, ~0.15 ms of device time and ~0.1 ms of host launches.
Here it is one launch, one program per (row, BLOCK columns), reading the counts and the
prompt mask through the state row (no gathered copies). The arithmetic is torch's, in
the same order, with fused multiply-adds off and IEEE division, so the result equals the
torch reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import apply_penalties_ref  # noqa: F401  (the torch reference)

BLOCK = 2048


@triton.jit
def _penalties_kernel(
    x_ptr, counts_ptr, mask_ptr, state_ptr, pen_ptr, num_rows, num_cols,
    stride_x, stride_counts, stride_mask, stride_pen,
    REPETITION: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_cols
    state = tl.load(state_ptr + row)
    x_at = x_ptr + row.to(tl.int64) * stride_x + cols
    x = tl.load(x_at, mask=inside, other=0.0)
    counts = tl.load(counts_ptr + state * stride_counts + cols, mask=inside, other=0)
    seen = counts > 0
    frequency = tl.load(pen_ptr + stride_pen + row)
    presence = tl.load(pen_ptr + 2 * stride_pen + row)
    if REPETITION:
        repetition = tl.load(pen_ptr + row)
        prompt = tl.load(mask_ptr + state * stride_mask + cols, mask=inside, other=0) != 0
        # div_rn: IEEE division, as torch's; Triton's `/` is the approximate one on CUDA.
        penalized = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
        x = tl.where(seen | prompt, penalized, x)
    x = x - frequency * counts.to(tl.float32)
    x = x - presence * seen.to(tl.float32)
    tl.store(x_at, x, mask=inside)


def apply_penalties(
    logits: torch.Tensor,  # [E, vocab] float32, columns contiguous; rows 0..P-1 change
    counts: torch.Tensor,  # [R, vocab] int32 output-token counts
    prompt_mask: torch.Tensor,  # [R, vocab] bool: prompt tokens (repetition)
    state_rows: torch.Tensor,  # [P] int64: each penalized row's counts / prompt_mask row
    penalties: torch.Tensor,  # [3, P] float32: repetition, frequency, presence
    any_repetition: bool,  # False: every repetition is 1 (the prompt mask is not read)
) -> torch.Tensor:
    """The penalties over logits' first P rows, in place (the module docstring's
    formulas); returns logits. Reads nothing on the host, so the launch never waits."""
    num_rows = state_rows.shape[0]
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "logits: float32 rows"
    assert counts.dtype == torch.int32 and counts.stride(1) == 1, "counts: int32 rows"
    assert penalties.shape == (3, num_rows) and penalties.dtype == torch.float32
    if num_rows == 0:
        return logits
    num_cols = logits.shape[1]
    mask = prompt_mask.view(torch.uint8)
    grid = (num_rows, triton.cdiv(num_cols, BLOCK))
    _penalties_kernel[grid](
        logits, counts, mask, state_rows, penalties, num_rows, num_cols,
        logits.stride(0), counts.stride(0), mask.stride(0), penalties.stride(0),
        REPETITION=any_repetition, BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False,  # torch rounds the product, then subtracts: so must we
    )  # fmt: skip
    return logits
