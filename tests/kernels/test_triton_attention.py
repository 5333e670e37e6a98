"""TritonAttention vs TorchAttention on small decode and prefill passes (cache included)."""

from __future__ import annotations

import pytest
import torch

from replica.attention import AttentionMetadata, TorchAttention
from replica.triton_attention import TritonAttention
from tests.kernels.kernel_helpers import TOL, bits, random_block_table, shuffled_slots

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_BLOCKS = 4, 2, 64, 16, 4


def _inputs(num_tokens: int, dtype, gen, device):
    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, HEAD_DIM, generator=gen).to(dtype).to(device)

    return rand(NUM_HEADS), rand(NUM_KV_HEADS), rand(NUM_KV_HEADS)


def _caches(num_seqs: int, dtype, gen, device):
    num_blocks = (num_seqs + 1) * MAX_BLOCKS
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k_cache, v_cache, num_blocks


def _compare(meta, q, k, v, k_cache, v_cache, dtype) -> None:
    scale = HEAD_DIM**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expect = TorchAttention().forward(q, k, v, k_ref, v_ref, meta, scale)
    got = TritonAttention().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))
    torch.testing.assert_close(got.float(), expect.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_pass(dtype, device):
    gen = torch.Generator().manual_seed(6)
    num_seqs = 3
    k_cache, v_cache, num_blocks = _caches(num_seqs, dtype, gen, device)
    positions = torch.tensor([0, BLOCK_SIZE, 3 * BLOCK_SIZE + 2], dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        is_decode=True,
        block_table=random_block_table(num_seqs, MAX_BLOCKS, num_blocks, gen, device),
        slot_mapping=shuffled_slots(num_seqs, gen, device),
        context_lens=positions + 1,
        positions=positions,
    )
    _compare(meta, *_inputs(num_seqs, dtype, gen, device), k_cache, v_cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_pass_with_prompt_chunk_rows(dtype, device):
    """A mixed step: rows of one sequence's prompt chunk (each reads the chunk's earlier
    tokens, appended in the same pass) beside a decode row and a fresh one-block chunk."""
    gen = torch.Generator().manual_seed(8)
    num_seqs = 3
    k_cache, v_cache, num_blocks = _caches(num_seqs, dtype, gen, device)
    slots = shuffled_slots(num_seqs, gen, device)
    row_seq = [0] * 6 + [1] + [2] * 5
    positions = list(range(BLOCK_SIZE - 3, BLOCK_SIZE + 3)) + [2 * BLOCK_SIZE + 1] + list(range(5))
    positions = torch.tensor(positions, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        is_decode=True,
        block_table=random_block_table(num_seqs, MAX_BLOCKS, num_blocks, gen, device),
        slot_mapping=slots[torch.tensor(row_seq, device=device)],
        context_lens=positions + 1,
        positions=positions,
        append_first=True,
    )
    _compare(meta, *_inputs(len(row_seq), dtype, gen, device), k_cache, v_cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_pass(dtype, device):
    gen = torch.Generator().manual_seed(7)
    q_lens, starts = [5, 17, 1], [0, 3, BLOCK_SIZE]  # fresh, prefix hit, one-token chunk
    num_seqs = len(q_lens)
    k_cache, v_cache, num_blocks = _caches(num_seqs, dtype, gen, device)
    start_positions = torch.tensor(starts, dtype=torch.int32, device=device)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32, device=device)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    cu[1:] = q_lens_t.cumsum(0)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)]).to(device)
    meta = AttentionMetadata(
        is_decode=False,
        block_table=random_block_table(num_seqs, MAX_BLOCKS, num_blocks, gen, device),
        slot_mapping=shuffled_slots(num_seqs, gen, device),
        context_lens=start_positions + q_lens_t,
        positions=positions,
        cu_seqlens_q=cu,
        start_positions=start_positions,
        max_q_len=max(q_lens),
    )
    _compare(meta, *_inputs(sum(q_lens), dtype, gen, device), k_cache, v_cache, dtype)


@pytest.mark.gpu
def test_decode_pass_replays_in_cuda_graph(device):
    """The decode branch captures into a CUDA graph and stays exact on replay with new indices."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(8)
    num_seqs = 4
    k_cache, v_cache, num_blocks = _caches(num_seqs, dtype, gen, device)
    block_table = random_block_table(num_seqs, MAX_BLOCKS, num_blocks, gen, device)
    slot_mapping = shuffled_slots(num_seqs, gen, device)
    positions = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    context_lens = positions + 1
    meta = AttentionMetadata(True, block_table, slot_mapping, context_lens, positions)
    q, k, v = _inputs(num_seqs, dtype, gen, device)
    backend, scale = TritonAttention(), HEAD_DIM**-0.5
    backend.forward(q, k, v, k_cache, v_cache, meta, scale)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    for step in (5, 2 * BLOCK_SIZE, MAX_BLOCKS * BLOCK_SIZE - num_seqs):
        positions.copy_(torch.arange(step, step + num_seqs, device=device))
        context_lens.copy_(positions + 1)
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        expect = TorchAttention().forward(q, k, v, k_ref, v_ref, meta, scale)
        graph.replay()
        torch.testing.assert_close(out.float(), expect.float(), **TOL[dtype])
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
