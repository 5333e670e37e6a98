"""The fused model path (Triton norm / RoPE / activation kernels over concatenated
projections, the CUDA default) computes what the HF-exact torch path computes.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from replica.attention import AttentionMetadata, TorchAttention
from replica.models import load_model

PRESETS = ["gpt2-tiny", "llama-tiny", "qwen3-tiny"]
BLOCK_SIZE = 8


def prefill_meta(lengths: list[int], block_table: torch.Tensor) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return AttentionMetadata(
        is_decode=False, block_table=block_table, slot_mapping=torch.arange(len(lengths)),
        context_lens=torch.tensor(lengths), positions=positions, cu_seqlens_q=cu,
        start_positions=torch.zeros(len(lengths), dtype=torch.long), max_q_len=max(lengths),
    )  # fmt: skip


def decode_meta(lengths: list[int], block_table: torch.Tensor) -> AttentionMetadata:
    positions = torch.tensor(lengths)  # each sequence's next position
    return AttentionMetadata(
        is_decode=True, block_table=block_table, slot_mapping=torch.arange(len(lengths)),
        context_lens=positions + 1, positions=positions,
    )  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_path_matches_torch_path(preset):
    lengths = [5, 17, 9]
    backend = TorchAttention()
    logits = []
    for fused in (False, True):
        model, config = load_model(preset, torch.float32, torch.device("cpu"), 3, backend, fused)
        blocks_per_seq = 4
        block_table = torch.arange(len(lengths) * blocks_per_seq).view(len(lengths), -1)
        shape = (config.num_layers, 2, block_table.numel(), BLOCK_SIZE,
                 config.num_kv_heads, config.head_dim)  # fmt: skip
        kv_cache = torch.full(shape, float("nan"))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=gen)
        with torch.inference_mode():
            meta = prefill_meta(lengths, block_table)
            prefill = model.compute_logits(model(ids, meta.positions, kv_cache, meta))
            next_ids = prefill[torch.tensor(lengths).cumsum(0) - 1].argmax(-1)
            meta = decode_meta(lengths, block_table)
            decode = model.compute_logits(model(next_ids, meta.positions, kv_cache, meta))
        logits.append((prefill, decode))
    (p0, d0), (p1, d1) = logits
    torch.testing.assert_close(p1, p0, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(d1, d0, atol=2e-5, rtol=1e-4)
