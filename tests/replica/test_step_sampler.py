"""StepSampler (a step's rows to tokens) and the CUDA-graph sizes a step pads to."""

from __future__ import annotations

import pytest
import torch

from replica.runner.graphs import graph_batch_sizes, padded_size
from replica.runner.sampling import StepSampler, all_greedy
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence

VOCAB = 50


def _seq(request_id: str, **params) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=4, **params), eos_token_id=0)


def test_graph_sizes_and_the_size_a_step_pads_to() -> None:
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-1] == 256 and graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(40)
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9, 33, 40)] == [1, 4, 8, 16, 40, 40]
    assert padded_size([], 7) == 7  # no graphs (the CPU): the exact rows
    with pytest.raises(AssertionError, match="41 rows exceed"):
        padded_size(sizes, 41)


def test_greedy_rows_are_each_forwards_argmax_into_token_buf() -> None:
    sampler = StepSampler(torch.device("cpu"), VOCAB, seed=0)
    seqs = [_seq(r, temperature=0.0) for r in "abc"]
    assert all_greedy(seqs) and not all_greedy([*seqs, _seq("d", temperature=0.7)])
    batch = sampler.batch(seqs)
    assert batch.all_greedy
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    token_buf = torch.full((8,), -1, dtype=torch.int64)
    decode_argmax = torch.tensor([7])  # a decode forward's rows come argmaxed already
    tokens = sampler.sample(
        [logits[:2], logits[2:]],
        [torch.tensor([5, 1]), torch.tensor([3])],
        [None, decode_argmax],
        batch,
        token_buf,
    )
    expect = logits[:2].argmax(dim=-1)
    assert tokens.tolist() == [*expect.tolist(), 7]
    assert token_buf[[5, 1]].tolist() == expect.tolist()  # the prefill rows, written here
    assert token_buf[3] == -1  # the decode forward wrote its own rows


def test_seeded_rows_draw_from_their_own_generator_until_released() -> None:
    def draw(sampler: StepSampler, seqs: list[Sequence]) -> list[int]:
        logits = torch.zeros(len(seqs), VOCAB)  # uniform: the draw is the generator's alone
        token_buf = torch.zeros(len(seqs), dtype=torch.int64)
        slots = [torch.arange(len(seqs))]
        tokens = sampler.sample([logits], slots, [None], sampler.batch(seqs), token_buf)
        assert token_buf.tolist() == tokens.tolist()
        return tokens.tolist()

    cpu = torch.device("cpu")
    first = StepSampler(cpu, VOCAB, seed=0)
    other = StepSampler(cpu, VOCAB, seed=1)
    seeded = _seq("s", temperature=1.0, seed=42)
    runs = [[draw(s, [seeded, _seq(f"u{i}", temperature=1.0)])[0] for i in range(6)]
            for s in (first, other)]  # fmt: skip
    assert runs[0] == runs[1]  # the seeded row ignores the engine's seed and its neighbour
    assert set(first.request_generators) == {"s"}
    first.release("s")
    assert first.request_generators == {}
    assert draw(first, [seeded])[0] == runs[0][0]  # a fresh generator: its first draw again
