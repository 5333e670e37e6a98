"""kernels.sampling against its torch reference, and the reference's distribution."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernels.sampling as sampling
from kernels.reference import philox_uint32_ref, philox_words_ref, sample_tokens_ref


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    """64-logit lane passes, so that every row spans several chunks and a ragged end."""
    monkeypatch.setattr(sampling, "BLOCK", 64)
    monkeypatch.setattr(sampling, "FINISH_BLOCK", 128)


@triton.jit
def _randint_kernel(key_ptr, out_ptr, base, N: tl.constexpr):
    i = tl.arange(0, N)
    bits = tl.randint(tl.load(key_ptr), base + i.to(tl.int64))
    tl.store(out_ptr + i, bits.to(tl.int64) & 0xFFFFFFFF)
    words = tl.randint4x(tl.load(key_ptr), base + i.to(tl.int64))
    for w in tl.static_range(4):
        tl.store(out_ptr + (w + 1) * N + i, words[w].to(tl.int64) & 0xFFFFFFFF)


@pytest.mark.parametrize("key, base", [(0, 0), (123456789012345, (5 << 32) + 77), (2**62 + 3, 9)])
def test_philox_reference_is_tritons_randint(key, base, device):
    keys = torch.tensor([key], dtype=torch.int64, device=device)
    out = torch.zeros(5, 64, dtype=torch.int64, device=device)
    _randint_kernel[(1,)](keys, out, base, N=64)
    counters = base + torch.arange(64)
    assert torch.equal(out[0].cpu(), philox_uint32_ref(keys.cpu(), counters))
    assert torch.equal(out[1:].cpu(), torch.stack(philox_words_ref(keys.cpu(), counters)))


def _params(n: int, gen: torch.Generator, vocab: int, greedy_every: int = 4):
    """Temperatures (greedy every greedy_every rows), top_ks (off, small, over the
    vocabulary), top_ps (some 1), Philox keys and bases."""
    temps = torch.rand(n, generator=gen) * 1.5 + 0.3
    temps[::greedy_every] = 0.0
    top_ks = torch.tensor([0, 1, 5, 40, vocab, vocab + 3, 0, 17])[torch.arange(n) % 8]
    top_ps = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0, torch.rand(n, generator=gen))
    keys = torch.randint(0, 2**62, (n,), generator=gen)
    bases = torch.randint(0, 2**20, (n,), generator=gen) << 32
    return temps, top_ks, top_ps.clamp(min=0.01), keys, bases


def _both(logits, temps, top_ks, top_ps, keys, bases, device, **flags):
    """(kernel, reference) tokens for the same inputs."""
    n = temps.shape[0]
    on = lambda t: t.to(device)  # noqa: E731
    out = torch.full((n,), -1, dtype=torch.int64, device=device)
    args = [on(t) for t in (temps, top_ks, top_ps, keys, bases)]
    sampling.sample_tokens(on(logits), *args, out, **flags)
    ref = torch.full((n,), -1, dtype=torch.int64)
    sample_tokens_ref(logits, temps, top_ks, top_ps, keys, bases, ref)
    return out.cpu(), ref


def _in_top_k(logits: torch.Tensor, top_ks: torch.Tensor, tokens: torch.Tensor) -> bool:
    """Every token at or above its row's k-th largest logit (rows with a top_k)."""
    for row, (k, t) in enumerate(zip(top_ks.tolist(), tokens.tolist(), strict=True)):
        x = logits[row].float()
        if 0 < k < x.numel() and x[t] < x.topk(k).values[-1]:
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_reference_over_whole_rows(dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 12, 203  # four 64-logit chunks, the last ragged
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    logits[0, 7] = logits[0, 150] = logits[0].max() + 1  # a greedy row with a tie
    temps, top_ks, top_ps, keys, bases = _params(n, gen, vocab)
    got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
    assert torch.equal(got, want)
    assert got[0] == 7  # the first of the tied maxima
    greedy = temps == 0
    assert torch.equal(got[greedy], logits.float().argmax(dim=1)[greedy])
    assert _in_top_k(logits, torch.where(greedy, 0, top_ks), got)


@pytest.mark.parametrize("split_rounds", [1, 2, 3])
@pytest.mark.parametrize("target_programs", [1, 40, 4096])
def test_kernel_matches_reference_over_chunkings(split_rounds, target_programs, monkeypatch,
                                                 device):  # fmt: skip
    """A row in one chunk or spread over several (ragged last), and rows decided in a
    split round or left to the finishing program: every way gives the reference's tokens."""
    monkeypatch.setattr(sampling, "SPLIT_ROUNDS", split_rounds)
    monkeypatch.setattr(sampling, "ONE_ROUND_LOGITS", 0)  # not one round for its few logits
    monkeypatch.setattr(sampling, "TARGET_PROGRAMS", target_programs)
    gen = torch.Generator().manual_seed(split_rounds * 100 + target_programs)
    n, vocab = 10, 333
    logits = torch.randn(n, vocab, generator=gen) * 2
    temps, top_ks, top_ps, keys, bases = _params(n, gen, vocab, greedy_every=5)
    top_ps[1::3] = 0.05  # rows likely to need several rounds
    got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
    assert torch.equal(got, want)


def test_flags_off_take_every_top_p_as_one_and_every_top_k_as_off(device):
    """any_top_p=False, any_top_k=False (the caller knows no row has them): no softmax
    sum, no mass rounds, no floor launches. A row with either anyway samples the whole
    vocabulary, as the reference does without them."""
    gen = torch.Generator().manual_seed(12)
    n, vocab = 6, 260
    logits = torch.randn(n, vocab, generator=gen) * 2
    temps, _, _, keys, bases = _params(n, gen, vocab, greedy_every=4)
    top_ps, top_ks = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    top_ps[3], top_ks[5] = 0.05, 2
    plain = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    for flags, (ps, ks) in (({"any_top_p": False}, (plain[0], top_ks)),
                            ({"any_top_k": False}, (top_ps, plain[1]))):  # fmt: skip
        got, _ = _both(logits, temps, top_ks, top_ps, keys, bases, device, **flags)
        _, want = _both(logits, temps, ks, ps, keys, bases, device)
        assert torch.equal(got, want)
        _, filtered = _both(logits, temps, top_ks, top_ps, keys, bases, device)
        assert not torch.equal(filtered, want)  # the case tells the two apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_top_k_keeps_ties_at_the_kth_logit_across_signs_and_zeros(dtype, device):
    """The floor is the k-th largest logit, found through the logits' ordered bit keys:
    negative logits, -0 and +0 (equal), and ties at the k-th value (all kept, as
    transformers' TopKLogitsWarper keeps them)."""
    gen = torch.Generator().manual_seed(4)
    n, vocab = 8, 150
    logits = (torch.randn(n, vocab, generator=gen) - 4).to(dtype)  # mostly negative
    logits[0, :6] = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, -0.0]).to(dtype)  # k=2: 4 kept
    logits[1, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0]).to(dtype)  # k=3: the four zeros
    logits[1, 4:] = -1
    top_ks = torch.tensor([2, 3, 1, 7, 149, 50, 2, 3])
    draws = 8  # each row 8 times in one launch, each copy its own Philox base
    logits, top_ks = logits.repeat(draws, 1), top_ks.repeat(draws)
    temps, top_ps = torch.ones(n * draws), torch.ones(n * draws)
    keys = (torch.arange(n) + 5).repeat(draws)
    bases = torch.arange(draws).repeat_interleave(n) << 32
    got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
    assert torch.equal(got, want)
    assert _in_top_k(logits, top_ks, got)
    draws = got.view(draws, n)
    assert set(draws[:, 0].tolist()) <= {0, 1, 2, 3} and len(set(draws[:, 0].tolist())) > 2
    assert set(draws[:, 1].tolist()) <= {0, 1, 2, 3} and len(set(draws[:, 1].tolist())) > 1
    assert (draws[:, 2] == logits[2].float().argmax()).all()  # top_k = 1, no tie


def test_chunking_spreads_rows_over_whole_blocks(monkeypatch):
    monkeypatch.setattr(sampling, "TARGET_PROGRAMS", 1024)
    monkeypatch.setattr(sampling, "MAX_CHUNKS", 16)
    assert sampling.chunking(1, 64 * 40 + 1) == (64 * 3, 14)  # 41 blocks in at most 16 chunks
    assert sampling.chunking(256, 64 * 40) == (64 * 10, 4)  # 1024 programs / 256 rows
    assert sampling.chunking(2048, 64 * 40) == (64 * 40, 1)
    assert sampling.chunking(4, 20) == (64, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_past_their_candidates_bisect_the_whole_row(dtype, monkeypatch, device):
    """Rows whose gathered logits overflow CANDIDATES (a chunk of -inf drags the bound
    down to -inf; a large k; a flat row) find their floor over the whole row instead."""
    monkeypatch.setattr(sampling, "CANDIDATES", 16)
    # 250 logits: two bisection passes (the second ragged) and three whole chunks and a
    # short one; 300 took a third pass, ~40% of the test's interpreted time. Seed 9 keeps
    # every row past CANDIDATES (row 4 gathers 24).
    gen = torch.Generator().manual_seed(9)
    n, vocab = 6, 250
    logits = torch.randn(n, vocab, generator=gen)
    logits[0, :100] = float("-inf")  # bound -inf: every finite logit gathered
    logits[2] = 0.5  # flat: every logit at the bound, all tied at the floor
    logits[3, ::7] = 3.0  # ties at the floor, k = 20 of 36
    logits[4, :10] = 5 + torch.arange(10.0)  # the top ten in one chunk
    top_ks = torch.tensor([5, 60, 7, 20, 3, 180])  # rows 1 and 5: k past CANDIDATES
    draws = 8  # each row 8 times, hot (T = 5: a floor too low would show)
    logits, top_ks = logits.repeat(draws, 1).to(dtype), top_ks.repeat(draws)
    temps, top_ps = torch.full((n * draws,), 5.0), torch.ones(n * draws)
    keys = (torch.arange(n) + 3).repeat(draws)
    bases = torch.arange(draws).repeat_interleave(n) << 32
    got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
    assert torch.equal(got, want)
    assert _in_top_k(logits, top_ks, got)


def test_a_row_draws_by_its_key_and_base_not_its_place(device):
    """Seeded requests: the same key and base give the same token in any row of any batch."""
    gen = torch.Generator().manual_seed(9)
    vocab = 100
    row = torch.randn(1, vocab, generator=gen)
    others = torch.randn(5, vocab, generator=gen)
    tokens = []
    for place in (0, 3, 5):
        logits = torch.cat([others[:place], row, others[place:]])
        temps = torch.full((6,), 0.9)
        top_ks = torch.zeros(6, dtype=torch.int64)
        top_ps = torch.full((6,), 0.8)
        keys = torch.randint(0, 2**62, (6,), generator=gen)
        bases = torch.randint(0, 2**20, (6,), generator=gen) << 32
        keys[place], bases[place] = 424242, 17 << 32
        got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
        assert torch.equal(got, want)
        tokens.append(int(got[place]))
    assert len(set(tokens)) == 1


def test_a_tiny_top_p_keeps_only_the_most_likely_token(device):
    """A near-flat row with top_p under the top token's share: rounds of rejection until the
    race reaches the top token (the pivot rises past every rejected one)."""
    gen = torch.Generator().manual_seed(2)
    n, vocab = 6, 180
    logits = torch.randn(n, vocab, generator=gen) * 0.01
    temps = torch.ones(n)
    top_ks = torch.zeros(n, dtype=torch.int64)
    top_ps = torch.full((n,), 1e-4)
    keys = torch.arange(n) + 11
    bases = torch.zeros(n, dtype=torch.int64)
    got, want = _both(logits, temps, top_ks, top_ps, keys, bases, device)
    assert torch.equal(got, want)
    assert torch.equal(got, logits.argmax(dim=1))


def _frequencies(logits: torch.Tensor, rows: int, **kw) -> torch.Tensor:
    n_vocab = logits.shape[1]
    temps = torch.full((rows,), kw.get("temperature", 1.0))
    top_ks = torch.full((rows,), kw.get("top_k", 0), dtype=torch.int64)
    top_ps = torch.full((rows,), kw.get("top_p", 1.0))
    keys = torch.full((rows,), 77, dtype=torch.int64)
    bases = torch.arange(rows) << 32  # independent draws: one counter range each
    out = torch.empty(rows, dtype=torch.int64)
    sample_tokens_ref(logits.expand(rows, -1), temps, top_ks, top_ps, keys, bases, out)
    return torch.bincount(out, minlength=n_vocab).double() / rows


@pytest.mark.parametrize(
    "kw, support",
    [
        ({"temperature": 0.7}, None),
        ({"temperature": 1.0, "top_p": 0.65}, [0, 1]),  # kept while the mass before < 0.65
        ({"temperature": 1.0, "top_p": 0.75}, [0, 1, 2]),  # 0.5 + 0.2 < 0.75: the third too
        ({"temperature": 1.0, "top_k": 3}, [0, 1, 2]),
        ({"temperature": 1.0, "top_k": 3, "top_p": 0.6}, [0, 1]),  # 0.5 / 0.85 < 0.6
    ],
)
def test_reference_samples_the_renormalised_filtered_softmax(kw, support):
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log()[None, :]
    rows = 30_000
    freq = _frequencies(logits, rows, **kw)
    want = torch.softmax(logits[0].double() / kw["temperature"], dim=0)
    if support is not None:
        keep = torch.zeros(5, dtype=torch.bool)
        keep[support] = True
        want = torch.where(keep, want, 0.0)
        want /= want.sum()
    tol = 5 * (want * (1 - want) / rows).sqrt() + 1e-12  # 5 sigma
    assert ((freq - want).abs() <= tol).all(), (freq.tolist(), want.tolist())


def test_split_rounds_one_for_few_logits_else_the_modules():
    """A top-p launch of few rows over a vocabulary splits round 0 alone (the rest, rare, in
    the finishing launch); a larger one splits SPLIT_ROUNDS; without a top_p, one."""
    assert sampling.num_split_rounds(1, 50257, True) == 1
    assert sampling.num_split_rounds(4, 50257, True) == 1
    assert sampling.num_split_rounds(8, 50257, True) == sampling.SPLIT_ROUNDS == 2
    assert sampling.num_split_rounds(1, 151936, True) == 1
    assert sampling.num_split_rounds(2, 151936, True) == 2
    assert sampling.num_split_rounds(256, 151936, False) == 1
