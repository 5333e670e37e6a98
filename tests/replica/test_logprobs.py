"""Logprobs and prompt logprobs equal log_softmax of transformers' logits (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from replica import SamplingParams
from tests.replica.test_engine_hf import hf_greedy, make_engine, save_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    """log_softmax of transformers' logits at every position of token_ids."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_logprobs(out, hf_lp: torch.Tensor, k: int) -> None:
    """Each output token's Logprobs against hf_lp (over prompt + output)."""
    start = len(out.prompt_token_ids) - 1
    assert len(out.logprobs) == len(out.token_ids)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = hf_lp[start + j]
        assert lp.token_id == token
        assert abs(lp.logprob - row[token].item()) < TOL
        top = row.topk(k)
        assert list(lp.top_ids) == top.indices.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=TOL)


def check_prompt_logprobs(out, hf_lp: torch.Tensor, k: int) -> None:
    prompt = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        lp, row = entries[p], hf_lp[p - 1]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - row[prompt[p]].item()) < TOL
        assert list(lp.top_ids) == row.topk(k).indices.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), row.topk(k).values, atol=TOL)


ENGINES = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=8, mixed_prefill_tokens=0),  # prefill forwards
    "mixed": dict(max_num_batched_tokens=8, mixed_prefill_tokens=8),  # chunks as decode rows
    "graphs": dict(emulate=True),
}


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_greedy_logprobs_and_prompt_logprobs_match_hf(llama, kind):
    path, model = llama
    overrides = dict(ENGINES[kind])
    engine = make_engine(path, 16, overrides.pop("emulate", False), **overrides)
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], [100]]
    params = [
        SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3),
        SamplingParams(max_tokens=6, temperature=0),  # a plain row in the same steps
        SamplingParams(max_tokens=4, temperature=0, logprobs=0, prompt_logprobs=0),
    ]
    outs = engine.generate(prompts, params)
    for out, p in zip(outs, params, strict=True):
        assert out.token_ids == hf_greedy(model, out.prompt_token_ids, p.max_tokens)
        if p.logprobs is None:
            assert out.logprobs is None and out.prompt_logprobs is None
            continue
        hf_lp = hf_logprobs(model, out.prompt_token_ids + out.token_ids)
        check_logprobs(out, hf_lp, p.logprobs)
        check_prompt_logprobs(out, hf_lp, p.prompt_logprobs)
    assert outs[2].prompt_logprobs == [None]  # one prompt token: no prompt logprobs


def test_sampled_logprobs_are_the_models_before_temperature_and_penalties(llama):
    path, model = llama
    engine = make_engine(path, 16)
    params = SamplingParams(
        max_tokens=8, temperature=1.5, top_k=20, seed=3, logprobs=2, frequency_penalty=1.0,
        logit_bias=((5, 3.0),),
    )  # fmt: skip
    (out,) = engine.generate([[11, 12, 13, 14]], params)
    check_logprobs(out, hf_logprobs(model, out.prompt_token_ids + out.token_ids), 2)


def test_prompt_logprobs_with_a_cached_prefix_and_streamed_outputs(llama):
    """A prompt whose blocks are cached is still computed whole; step outputs carry the
    prompt logprobs on the first token and one Logprobs per token."""
    path, model = llama
    engine = make_engine(path, 8)
    prompt = list(range(20, 45))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # caches it
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1,
                                                   prompt_logprobs=2))  # fmt: skip
    tokens, logprobs, prompt_lps = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs
            if out.prompt_logprobs is not None:
                assert not prompt_lps and len(tokens) == 1  # with the first token, once
                prompt_lps = out.prompt_logprobs
    hf_lp = hf_logprobs(model, prompt + tokens)
    assert [lp.token_id for lp in logprobs] == tokens
    assert len(prompt_lps) == len(prompt)
    for p in range(1, len(prompt)):
        assert abs(prompt_lps[p].logprob - hf_lp[p - 1, prompt[p]].item()) < TOL


def test_preempted_prompt_logprobs_requests_match_hf(llama):
    path, model = llama
    engine = make_engine(path, 16, num_blocks=6, max_num_batched_tokens=16)
    prompts = [list(range(3 + i, 33 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)  # fmt: skip
    outs = engine.generate(prompts, params)
    assert engine.stats().num_preempted_total > 0
    for out in outs:
        hf_lp = hf_logprobs(model, out.prompt_token_ids + out.token_ids)
        check_logprobs(out, hf_lp, 2)
        check_prompt_logprobs(out, hf_lp, 1)
    assert not engine.runner.prompt_logprobs.parts  # nothing left behind
