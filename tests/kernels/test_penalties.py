"""Penalty kernel vs its torch reference: bit-equal, through the state rows, at block edges."""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import BLOCK, apply_penalties, apply_penalties_ref


def case(num_rows: int, num_cols: int, seed: int, device, width: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    extra = 3  # rows past the penalized ones: left as they are
    base = torch.randn(num_rows + extra, width or num_cols, generator=gen) * 4
    logits = base[:, :num_cols]  # a row-strided view when width > num_cols
    capacity = num_rows + 5
    counts = torch.randint(0, 4, (capacity, num_cols), generator=gen, dtype=torch.int32)
    counts[torch.rand(capacity, num_cols, generator=gen) < 0.7] = 0  # mostly unseen
    prompt_mask = torch.rand(capacity, num_cols, generator=gen) < 0.2
    state_rows = torch.randperm(capacity, generator=gen)[:num_rows]
    counts[state_rows, 0] = 1  # each penalized row has a token out
    repetition = 0.5 + 1.5 * torch.rand(num_rows, generator=gen)
    frequency, presence = torch.rand(2, num_rows, generator=gen) * 2 - 1
    penalties = torch.stack([repetition, frequency, presence]).float()
    tensors = (logits, counts, prompt_mask, state_rows, penalties)
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("num_rows,num_cols", [(1, 7), (3, BLOCK), (4, 2 * BLOCK + 37)])
@pytest.mark.parametrize("repetition", [True, False])
def test_penalties_equal_the_reference(num_rows, num_cols, repetition, device):
    logits, counts, mask, state_rows, penalties = case(num_rows, num_cols, num_cols, device)
    if not repetition:
        penalties[0] = 1.0
    expected = apply_penalties_ref(logits.clone(), counts, mask, state_rows, penalties, repetition)
    before = logits.clone()

    assert apply_penalties(logits, counts, mask, state_rows, penalties, repetition) is logits

    assert torch.equal(logits.cpu(), expected.cpu())
    assert torch.equal(logits[num_rows:].cpu(), before[num_rows:].cpu())  # untouched
    assert not torch.equal(logits[:num_rows].cpu(), before[:num_rows].cpu())  # it did work


def test_row_strided_logits_and_no_rows(device):
    logits, counts, mask, state_rows, penalties = case(2, 300, 5, device, width=333)
    expected = apply_penalties_ref(logits.clone(), counts, mask, state_rows, penalties, True)
    apply_penalties(logits, counts, mask, state_rows, penalties, True)
    assert torch.equal(logits.cpu(), expected.cpu())

    none = state_rows[:0]
    same = logits.clone()
    apply_penalties(logits, counts, mask, none, penalties[:, :0], True)
    assert torch.equal(logits.cpu(), same.cpu())


def test_the_reference_applies_the_formulas():
    """One row by hand: repetition on a seen token (positive and negative logits), then
    frequency x count and presence on the tokens out so far."""
    logits = torch.tensor([[2.0, -2.0, 3.0, 1.0]])
    counts = torch.tensor([[0, 0, 0, 0], [2, 1, 0, 0]], dtype=torch.int32)
    mask = torch.tensor([[False] * 4, [False, False, True, False]])
    penalties = torch.tensor([[2.0], [0.5], [0.25]])
    apply_penalties_ref(logits, counts, mask, torch.tensor([1]), penalties, True)
    # token 0: seen twice: 2 / 2 - 0.5 * 2 - 0.25; token 1: -2 * 2 - 0.5 - 0.25;
    # token 2: in the prompt only: 3 / 2; token 3: unseen.
    assert logits.tolist() == [[-0.25, -4.75, 1.5, 1.0]]
