"""Penalties, logit_bias and min_tokens against torch references of their formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replica import SamplingParams
from tests.replica.test_engine_hf import hf_greedy, make_engine, save_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties' formulas applied to transformers' logits,
    counts taken over the output tokens (the prompt too, for repetition)."""
    ids, out = list(prompt), []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(logits))
        r = params.repetition_penalty
        seen = (counts > 0) | torch.isin(torch.arange(len(logits)), torch.tensor(prompt))
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        for token, bias in params.logit_bias:
            logits[token] += bias
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=1.4),
    dict(repetition_penalty=0.8, logit_bias=((3, 2.5), (50, -1.0))),
]


@pytest.mark.parametrize("emulate", [False, True])
def test_penalties_match_the_reference_over_many_steps(llama, emulate):
    """Each step's penalties count the token the step before sampled, which the host
    has not seen yet when it launches the step (a PLACEHOLDER)."""
    path, model = llama
    engine = make_engine(path, 16, emulate)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 61)), [9, 9, 9], [200, 201]]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **p) for p in PENALTIES]
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, p), p
    # The frequency penalty changes the greedy tokens (the test could fail).
    assert outs[0].token_ids != hf_greedy(model, prompts[0], 16, min_new_tokens=16)


def test_repetition_penalty_equals_transformers(llama):
    path, model = llama
    engine = make_engine(path, 16)
    prompt = [11, 12, 13, 11, 12, 13, 11]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                      repetition_penalty=1.6))  # fmt: skip
    # transformers' RepetitionPenaltyLogitsProcessor, through generate
    assert out.token_ids == hf_greedy(model, prompt, 16, repetition_penalty=1.6)
    assert out.token_ids != hf_greedy(model, prompt, 16)


def test_logit_bias_forces_a_token(llama):
    path, _ = llama
    engine = make_engine(path, 16)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1, logit_bias={"77": 100})
    (out,) = engine.generate([[1, 2, 3]], params)
    assert out.token_ids == [77] * 5


def test_logit_bias_outside_the_vocabulary_names_the_field(llama):
    path, _ = llama
    engine = make_engine(path, 16)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={384: 1.0}))
    assert not engine.has_unfinished()


def test_min_tokens_keeps_a_stop_token_from_ending_early(llama):
    path, model = llama
    engine = make_engine(path, 16)
    prompt = [4, 5, 6]
    first = hf_greedy(model, prompt, 1)[0]
    plain = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,))
    (out,) = engine.generate([prompt], plain)
    assert out.token_ids == [first] and out.finish_reason == "stop"
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,), min_tokens=4,
                          ignore_eos=True)  # fmt: skip
    (out,) = engine.generate([prompt], held)
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:3]


@pytest.mark.parametrize("emulate", [False, True])
def test_plain_rows_are_unchanged_by_extras_rows(llama, emulate):
    path, _ = llama
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(10, 70, 10)]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    extras = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3,
                            presence_penalty=1.0, repetition_penalty=1.2)  # fmt: skip
    alone = make_engine(path, 16, emulate).generate(prompts, plain)
    params = [plain if i % 2 == 0 else extras for i in range(len(prompts))]
    mixed = make_engine(path, 16, emulate).generate(prompts, params)
    for i, (a, m) in enumerate(zip(alone, mixed, strict=True)):
        if i % 2 == 0:
            assert m.token_ids == a.token_ids and m.logprobs is None
        else:
            assert len(m.logprobs) == len(m.token_ids)


def test_penalty_rows_are_freed_on_finish_and_abort(llama):
    path, _ = llama
    engine = make_engine(path, 16, max_num_seqs=4)
    processors = engine.runner.processors
    capacity = len(processors.counts)
    params = SamplingParams(max_tokens=3, temperature=0, frequency_penalty=0.5)
    for round_ in range(5):  # many more requests than rows
        engine.generate([[round_ + i, 7, 8] for i in range(4)], params)
    assert not processors.rows and len(processors.free_rows) == capacity
    engine.add_request("a", [1, 2, 3], dataclasses.replace(params, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert "a" in processors.rows
    engine.abort("a")
    assert not processors.rows and len(processors.free_rows) == capacity


def test_preemption_keeps_the_counts(llama):
    """A tiny pool preempts and recomputes sequences; their counts stay on the device."""
    path, model = llama
    engine = make_engine(path, 16, num_blocks=6, max_num_seqs=4)
    prompts = [list(range(3 + 7 * i, 25 + 7 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            frequency_penalty=0.8, repetition_penalty=1.3)  # fmt: skip
    outs = engine.generate(prompts, params)
    assert engine.stats().num_preempted_total > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, params)
    assert not engine.runner.processors.rows
