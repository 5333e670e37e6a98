"""The bucketed (CUDA-graph) prefill pass: padded PrefillInputs through TritonAttention.

Padding tokens and padding sequences must not change the real rows' outputs or any
K/V outside the null block; real rows must equal the exact-shape torch reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import prefill_attention
from replica.attention import TorchAttention
from replica.runner.prefill_inputs import PrefillInputs, prefill_token_buckets
from replica.sampling_params import SamplingParams
from replica.sequence import PLACEHOLDER, Sequence
from replica.triton_attention import TritonAttention
from tests.kernels.kernel_helpers import TOL, bits, random_block_table

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_BLOCKS, MAX_SEQS = 4, 2, 64, 16, 6, 8


def _seqs(chunks: list[tuple[int, int, int]]) -> tuple[list[Sequence], list[int]]:
    """chunks: (computed tokens, chunk length, prompt length) per sequence."""
    seqs = []
    for i, (start, _, prompt_len) in enumerate(chunks):
        seq = Sequence(f"r{i}", list(range(100 + i, 100 + i + prompt_len)), SamplingParams())
        seq.num_computed_tokens = start
        seq.slot = (3 * i + 1) % MAX_SEQS
        seqs.append(seq)
    return seqs, [n for _, n, _ in chunks]


def test_token_buckets():
    assert prefill_token_buckets(8192) == [
        16,
        32,
        64,
        128,
        256,
        512,
        1024,
        *range(2048, 8193, 1024),
    ]
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(16) == [16]


def test_fill_layout():
    # fresh prompt done; chunk that stops short; prefix hit that completes its prompt.
    seqs, lens = _seqs([(0, 5, 5), (0, 16, 40), (16, 3, 19)])
    inputs = PrefillInputs(
        64, MAX_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float16, MAX_SEQS,
        torch.device("cpu"), True,
    )  # fmt: skip
    step = inputs.fill(seqs, lens, parity=1)
    assert step.bucket.num_tokens == 32 and step.bucket.num_seqs == MAX_SEQS
    assert [s.request_id for s in step.done] == ["r0", "r2"]
    v = inputs.device_views(step.bucket)
    assert v["ids"][:24].tolist() == [*range(100, 105), *range(101, 117), 118, 119, 120]
    assert v["ids"][24:].eq(0).all()
    assert v["positions"][:24].tolist() == [*range(5), *range(16), 16, 17, 18]
    assert v["token_slots"][:24].tolist() == [1] * 5 + [4] * 16 + [7] * 3
    assert v["token_slots"][24:].eq(MAX_SEQS).all()
    assert v["cu_seqlens"].tolist() == [0, 5, 21, 24, 24, 24, 24, 24, 24]
    assert v["context_lens"][:3].tolist() == [5, 16, 19]
    assert v["last_rows"][:2].tolist() == [4, 23] and v["done_slots"][:2].tolist() == [1, 7]
    work = v["work"].tolist()
    # Group 2: chunks of up to 8 tokens go on the short list, the longest context first.
    assert inputs.short_q == 8 and v["short_work"].shape == (MAX_SEQS, 2)
    assert work[:1] == [[1, 0]] and all(w == [-1, -1] for w in work[1:])
    short = v["short_work"].tolist()
    assert short[:2] == [[2, 0], [0, 0]] and all(w == [-1, -1] for w in short[2:])
    # head_dim 64 over fp16 has no long tile: no long list, whatever the contexts.
    assert inputs.long_q == 0 and v["long_work"].shape == (0, 2)
    assert inputs.metadata(step.bucket, torch.zeros(1, 1)).prefill_long_work is None


def test_fill_ids_from_prompts_and_generated_tokens():
    """A chunk within its prompt is read from the prompt's int64 copy; one past it (a
    recomputed sequence, a decode row whose token is a PLACEHOLDER) from token_ids."""
    seqs, _ = _seqs([(0, 4, 4), (2, 6, 5), (0, 3, 3), (3, 1, 3)])
    seqs[1].token_ids += [7, 8, 9]  # preempted after 3 sampled tokens: recomputed whole
    seqs[3].token_ids.append(PLACEHOLDER)  # a decode row riding in the prefill forward
    lens = [4, 6, 3, 1]
    inputs = PrefillInputs(
        64, MAX_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float16, MAX_SEQS,
        torch.device("cpu"), True,
    )  # fmt: skip
    inputs.fill(*_seqs([(0, 30, 30)]), parity=0)  # a longer step first: its ids are cleared
    step = inputs.fill(seqs, lens, parity=0)
    ids = inputs.device_views(step.bucket)["ids"]
    assert ids[:14].tolist() == [100, 101, 102, 103, 103, 104, 105, 7, 8, 9, 102, 103, 104, -1]
    assert ids[14:].eq(0).all()
    assert [s.request_id for s in step.done] == ["r0", "r1", "r2", "r3"]


def test_fill_long_list():
    """head_dim 128: chunks past LONG_CONTEXT keys go on the long list, in 64-token
    blocks (128 rows over GQA 2); a decode row stays short whatever its context."""
    seqs, lens = _seqs([(0, 40, 40), (2000, 60, 2100), (2500, 1, 2501), (0, 20, 20)])
    inputs = PrefillInputs(
        2048, MAX_SEQS, NUM_HEADS, NUM_KV_HEADS, 128, torch.bfloat16, MAX_SEQS,
        torch.device("cpu"), True,
    )  # fmt: skip
    assert inputs.long_q == 64
    step = inputs.fill(seqs, lens, parity=0)
    v = inputs.device_views(step.bucket)
    # 121 tokens: bucket 128, 8 sequences; the long list holds 128 / 64 blocks + a partial
    # block for each of up to 8 chunks.
    assert step.bucket.num_long_work == 2 + 8 and v["long_work"].shape == (10, 2)
    assert v["long_work"].tolist()[:2] == [[1, 0], [-1, -1]]
    assert v["work"].tolist()[:3] == [[0, 1], [0, 0], [3, 0]]
    assert v["short_work"].tolist()[:2] == [[2, 0], [-1, -1]]
    meta = inputs.metadata(step.bucket, torch.zeros(1, 1))
    assert meta.prefill_long_work is not None and meta.prefill_long_work.shape == (10, 2)
    # A step without long chunks gets a bucket (a CUDA graph) without the list: no empty
    # long programs. Both are captured for every token bucket.
    plain = inputs.fill(seqs[:1] + seqs[2:], [40, 1, 20], parity=1).bucket
    assert plain.num_tokens == 64 and plain.num_long_work == 0
    assert inputs.metadata(plain, torch.zeros(1, 1)).prefill_long_work is None
    assert plain in inputs.buckets() and step.bucket in inputs.buckets()
    assert len(inputs.buckets()) == 2 * len(inputs.token_buckets)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float16, 64),
                                            (torch.float16, 128)])  # fmt: skip
def test_bucketed_pass_matches_exact_reference(dtype, head_dim, device, monkeypatch):
    """head_dim 128, with LONG_CONTEXT lowered to 20: the chunk of 23 keys runs in the
    long launch, the rest as before."""
    monkeypatch.setattr(prefill_attention, "LONG_CONTEXT", 20)
    gen = torch.Generator().manual_seed(11)
    seqs, lens = _seqs([(0, 5, 5), (0, 17, 30), (3, 20, 23), (16, 1, 17)])
    num_tokens = sum(lens)
    null_block = MAX_SEQS * MAX_BLOCKS
    num_blocks = null_block + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    table = random_block_table(MAX_SEQS, MAX_BLOCKS, null_block, gen, device)[:MAX_SEQS]
    block_table = torch.cat([table, table.new_full((1, MAX_BLOCKS), null_block)])

    padded, exact = (
        PrefillInputs(64, MAX_SEQS, NUM_HEADS, NUM_KV_HEADS, head_dim, dtype, MAX_SEQS, device, p)
        for p in (True, False)
    )
    step = padded.fill(seqs, lens, parity=0)
    exact_step = exact.fill(seqs, lens, parity=0)
    bucket_tokens = step.bucket.num_tokens
    assert bucket_tokens == 64 > num_tokens and exact_step.bucket.num_tokens == num_tokens
    long_work = padded.device_views(step.bucket)["long_work"][:, 0].tolist()
    assert [s for s in long_work if s >= 0] == ([2] if head_dim == 128 else [])

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(bucket_tokens, heads, head_dim, generator=gen).to(dtype).to(device)

    q, k, v = rand(NUM_HEADS), rand(NUM_KV_HEADS), rand(NUM_KV_HEADS)
    scale = head_dim**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    meta_ref = exact.metadata(exact_step.bucket, block_table)
    expect = TorchAttention().forward(
        q[:num_tokens], k[:num_tokens], v[:num_tokens], k_ref, v_ref, meta_ref, scale
    )
    got = TritonAttention().forward(
        q, k, v, k_cache, v_cache, padded.metadata(step.bucket, block_table), scale
    )
    torch.testing.assert_close(got[:num_tokens].float(), expect.float(), **TOL[dtype])
    # Padding tokens wrote only the null block; every other K/V is the reference's.
    real = torch.arange(num_blocks, device=device) != null_block
    assert torch.equal(bits(k_cache[real]), bits(k_ref[real]))
    assert torch.equal(bits(v_cache[real]), bits(v_ref[real]))
    assert np.array_equal(
        padded.device_views(step.bucket)["done_slots"][:3].cpu().numpy(), [1, 7, 2]
    )


def test_fill_padding_covers_the_largest_bucket():
    seqs, lens = _seqs([(0, 5, 5), (2040, 16, 2100)])  # the second chunk is a long one
    inputs = PrefillInputs(
        64, MAX_SEQS, NUM_HEADS, NUM_KV_HEADS, 128, torch.float16, MAX_SEQS,
        torch.device("cpu"), True,
    )  # fmt: skip
    assert inputs.fill(seqs, lens, parity=0).bucket.num_long_work
    inputs.fill_padding(parity=0)
    v = inputs.device_views(inputs.bucket(64, 0, long=True))
    assert v["ids"].eq(0).all() and v["positions"].eq(0).all()
    assert v["token_slots"].eq(MAX_SEQS).all() and v["seq_slots"].eq(MAX_SEQS).all()
    assert v["cu_seqlens"].eq(0).all() and v["context_lens"].eq(0).all()
    assert v["work"].eq(-1).all() and v["long_work"].numel() and v["long_work"].eq(-1).all()
