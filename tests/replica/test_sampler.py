"""The sampler: greedy, temperature, top-k, top-p and per-request seeds, on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

from replica.runner.graph_sampling import GRAPH_KINDS, GraphSamplingInputs
from replica.runner.sampling_batch import SamplingBatch, sample, sample_fused
from replica.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _batch(params: list[SamplingParams], vocab: int, seeds: dict[int, int] | None = None):
    gens = [None] * len(params)
    for row, seed in (seeds or {}).items():
        gens[row] = torch.Generator().manual_seed(seed)
    return SamplingBatch.build(params, gens, vocab, CPU)


def _draw(logits: torch.Tensor, params: SamplingParams, rows: int, seed: int = 0) -> torch.Tensor:
    """rows independent draws from one row of logits (unseeded rows, one default generator)."""
    batch = _batch([params] * rows, logits.shape[-1])
    return sample(logits.expand(rows, -1).clone(), batch, torch.Generator().manual_seed(seed))


def test_build_packs_each_rows_values_and_clamps_top_k_to_the_vocabulary():
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=10**12),  # past the vocabulary: no filter
    ]
    batch = _batch(params, vocab=7)
    assert batch.temperatures.tolist() == [0.5, 0.0, 1.5]
    assert batch.top_ks.dtype == torch.int64 and batch.top_ks.tolist() == [3, 7, 7]
    assert batch.top_ps.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert (batch.all_greedy, batch.any_top_k, batch.any_top_p) == (False, True, True)
    assert _batch([SamplingParams(temperature=0.0)] * 2, vocab=7).all_greedy


def test_greedy_rows_take_the_first_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    params.append(SamplingParams(temperature=1.0, top_k=1))  # top_k=1 is the argmax too
    for seed in range(5):
        tokens = sample(logits, _batch(params, 4), torch.Generator().manual_seed(seed))
        assert tokens.tolist() == [1, 0, 3]


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0, 1.8]])
    tokens = _draw(logits, SamplingParams(temperature=2.0, top_k=3), rows=4000)
    assert set(tokens.tolist()) == {1, 3, 5}


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.5, {0}), (0.51, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_that_reaches_p(top_p, kept):
    """Probabilities 0.5, 0.3, 0.15, 0.05: a token is kept while the mass before it is
    under top_p, so the token that crosses top_p is kept."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    tokens = _draw(logits, SamplingParams(temperature=1.0, top_p=top_p), rows=4000)
    assert set(tokens.tolist()) == kept


def test_top_k_applies_before_top_p():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_k 2 renormalises to 4/7, 3/7: top_p 0.6 then needs both
    tokens = _draw(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), rows=4000)
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.7, -2.0]])
    rows = 40_000
    tokens = _draw(logits, SamplingParams(temperature=temperature), rows, seed=3)
    freq = torch.bincount(tokens, minlength=5).double() / rows
    want = torch.softmax(logits[0].double() / temperature, dim=0)
    # 5 sigma of a binomial proportion at 40K draws
    tol = 5 * (want * (1 - want) / rows).sqrt()
    assert ((freq - want).abs() <= tol).all(), (freq.tolist(), want.tolist())


def test_seeded_rows_do_not_depend_on_their_neighbours():
    vocab = 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 22, 33)]

    def draws(order: list[int], neighbours: int, steps: int = 8) -> dict[int, list[int]]:
        """Seeded rows of logits[order], with unseeded rows before them, over steps."""
        gens = {i: torch.Generator().manual_seed(params[i].seed) for i in order}
        got: dict[int, list[int]] = {i: [] for i in order}
        default = torch.Generator().manual_seed(neighbours)
        for _ in range(steps):
            rows = [SamplingParams(temperature=1.0)] * neighbours + [params[i] for i in order]
            row_gens = [None] * neighbours + [gens[i] for i in order]
            batch = SamplingBatch.build(rows, row_gens, vocab, CPU)
            step_logits = torch.cat([logits[3 : 3 + neighbours], logits[order]])
            tokens = sample(step_logits, batch, default)[neighbours:].tolist()
            for i, t in zip(order, tokens, strict=True):
                got[i].append(t)
        return got

    alone = draws([0, 1, 2], neighbours=0)
    assert draws([2, 0, 1], neighbours=3) == alone
    assert draws([1], neighbours=2)[1] == alone[1]
    assert len({tuple(v) for v in alone.values()}) == 3  # each seed its own stream


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_build_does_not_wait_for_work_queued_before_it():
    """The runner builds a step's sampling batch after queueing its forward: a blocking
    copy of the rows' parameters held the host until the device had finished that
    forward, so the host could not prepare the next step meanwhile."""
    device = torch.device("cuda")
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9)] * 256
    SamplingBatch.build(params, [None] * 256, 1000, device)  # pinned memory's first use
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # clock cycles: ~1 s of device time
    start = time.perf_counter()
    batch = SamplingBatch.build(params, [None] * 256, 1000, device)
    held_s = time.perf_counter() - start
    assert held_s < 0.25, f"the build waited {held_s:.3f} s for the queued work"
    assert batch.top_ks.tolist() == [20] * 256  # the values, once the copy has run
    assert batch.temperatures.tolist() == pytest.approx([0.8] * 256)


def _fused(logits: torch.Tensor, params: list[SamplingParams], positions=None, step_key=5):
    """sample_fused's tokens: natively on a GPU, else under the interpreter."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    positions = positions or [10] * len(params)
    batch = SamplingBatch.build(
        params, [None] * len(params), logits.shape[1], device, positions=positions,
        step_key=step_key,
    )  # fmt: skip
    return sample_fused(logits.to(device), batch).cpu()


@pytest.mark.parametrize("kinds", ["mixed", "all top-k", "no top-k"])
def test_fused_sampler_routes_rows_to_their_launch(kinds):
    """kernels.sampling: greedy rows take the first argmax, top-k rows stay within their k,
    whichever launches the batch needs."""
    gen = torch.Generator().manual_seed(1)
    vocab = 90
    logits = torch.randn(6, vocab, generator=gen) * 2
    # (row 1 of "mixed" is greedy with a top_k: still the whole vocabulary's argmax)
    top_k = {"mixed": [4, 5, 0, 9, 0, 1], "all top-k": [4, 2, 7, 9, 3, 1], "no top-k": [0] * 6}
    temps = [1.0, 0.0, 0.7, 1.2, 1.0, 0.9] if kinds != "all top-k" else [1.0] * 6
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=0.9, seed=i)
        for i, (t, k) in enumerate(zip(temps, top_k[kinds], strict=True))
    ]
    for position in range(8):
        tokens = _fused(logits, params, positions=[position] * 6).tolist()
        for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
            if p.greedy:
                assert token == logits[row].argmax()
            elif p.top_k > 0:
                assert token in logits[row].topk(p.top_k).indices.tolist()


def test_fused_sampler_seeded_rows_ignore_neighbours_and_step_keys():
    gen = torch.Generator().manual_seed(2)
    vocab = 70
    logits = torch.randn(4, vocab, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    free = SamplingParams(temperature=1.0)
    alone = _fused(logits[:1], [seeded], positions=[17], step_key=1)
    crowd = _fused(logits[[3, 1, 0]], [free, free, seeded], positions=[3, 4, 17], step_key=2)
    assert alone.tolist()[0] == crowd.tolist()[2]
    draws = {int(_fused(logits[:1], [seeded], positions=[p]).item()) for p in range(20)}
    assert len(draws) > 1  # the position moves the counter


@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_graph_inputs_sample_as_sample_fused_and_leave_other_rows_greedy(kind):
    """GraphSamplingInputs (what a decode step's sampling graph reads): the sampled rows
    [first, first + n) of a padded forward draw sample_fused's tokens for the same
    params, positions and step key, in each kind of graph (temperature alone, top-p,
    top-k rows among them); the rows before and after them take the argmax."""
    top_k, top_p = kind
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(3)
    vocab, rows, first = 75, 8, 2
    logits = torch.randn(rows, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.9, top_p=0.7 if top_p else 1.0, seed=40,
                       top_k=5 if top_k else 0),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0, top_k=3 if top_k else 0, top_p=0.5),  # greedy
        SamplingParams(temperature=0.6, top_p=0.5 if top_p else 1.0, top_k=40 if top_k else 0),
    ]  # fmt: skip
    positions = [9, 4, 30, 12]
    inputs = GraphSamplingInputs(16, vocab, device)
    top_k_row = SamplingParams(temperature=1.0, top_k=70)  # below the vocabulary: a filter
    assert inputs.upload(params + [top_k_row], positions + [5], 77, rows, 0) == (True, True)
    greedy_row = SamplingParams(temperature=0.0, top_k=70)  # a greedy row filters nothing
    assert inputs.upload(params + [greedy_row], positions + [5], 77, rows, 0) == kind
    off_row = SamplingParams(temperature=1.0, top_k=-1)  # -1: off, as 0
    assert inputs.upload(params + [off_row], positions + [5], 77, rows, 0) == kind
    assert inputs.upload(params, positions, 77, rows, first) == kind
    tokens = inputs.sample(logits.to(device), *kind).cpu()
    sampled = slice(first, first + len(params))
    want = _fused(logits[sampled], params, positions=positions, step_key=77)
    assert tokens[sampled].tolist() == want.tolist()
    others = [r for r in range(rows) if not first <= r < first + len(params)]
    assert tokens[others].tolist() == logits[others].argmax(dim=1).tolist()
    inputs.upload(params[:1], positions[:1], 77, 1, 0)  # a smaller graph's rows
    one_row = logits[first : first + 1].to(device)
    assert inputs.sample(one_row, *kind).cpu().tolist() == want[:1].tolist()
    unseeded = params[1:]  # every row on the step's key: upload's common case
    sampled = slice(first, first + len(unseeded))
    for step_key in range(78, 84):  # several keys: a wrong counter base shows in some
        assert inputs.upload(unseeded, positions[1:], step_key, rows, first) == kind
        tokens = inputs.sample(logits.to(device), *kind).cpu()
        want = _fused(logits[sampled], unseeded, positions=positions[1:], step_key=step_key)
        assert tokens[sampled].tolist() == want.tolist()


def test_graph_inputs_stage_into_a_callers_buffers():
    """With the caller's buffers (the model runner's decode-inputs region), stage writes
    the very bytes upload would copy, and nothing reaches the device until the caller
    copies; buffers too short for max_rows are refused, naming them."""
    device = torch.device("cpu")
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=5), SamplingParams(temperature=1.1)]
    own = GraphSamplingInputs(32, 100, device)
    length = GraphSamplingInputs.buffer_length(32)
    packed = torch.zeros(length, dtype=torch.int64)
    staging = [torch.zeros(length, dtype=torch.int64) for _ in range(2)]
    shared = GraphSamplingInputs(32, 100, device, packed, staging)
    assert own.upload(params, [7, 8], 99, 24, 3, parity=1) == (False, True)
    assert shared.stage(params, [7, 8], 99, 24, 3, parity=1) == (False, True)
    assert (packed == 0).all() and (staging[0] == 0).all()
    packed.copy_(staging[1])
    assert packed.tolist() == own.packed.tolist()
    with pytest.raises(ValueError, match="packed, staging"):
        GraphSamplingInputs(64, 100, device, packed, staging)
