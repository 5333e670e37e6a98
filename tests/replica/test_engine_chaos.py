"""Every engine feature at once, on random schedules: requests arriving mid-decode, shared
and identical prompts (the prefix cache), a pool small enough to preempt, chunked prompts,
aborts, stop tokens, greedy rows beside sampled ones. Each greedy request must still get
transformers' tokens, each seeded one the tokens it gets alone, and nothing may be lost,
finished twice or leaked."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from replica import SamplingParams
from tests.replica.test_engine_hf import assert_no_leak, hf_greedy, make_engine, save_checkpoint

VOCAB = 380  # token ids drawn below this: the checkpoints' specials sit above it


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy", "stop" (greedy, a stop id it will meet), "seeded", "unseeded"
    arrival: int  # the step before which it is added
    abort_at: int | None  # the step before which it is aborted, if still in flight


def scenario(seed: int, hf_model) -> list[Req]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    systems = [ids(rng.randrange(17, 45)) for _ in range(2)]
    reqs = []
    for _ in range(14):
        if rng.random() < 0.5:  # a shared prefix; a suffix of 0 repeats a whole prompt
            prompt = systems[rng.randrange(2)] + ids(rng.choice([0, 1, 5, 12]))
        else:
            prompt = ids(rng.randrange(1, 50))
        kind = rng.choice(["greedy", "stop", "seeded", "unseeded"])
        max_tokens = rng.randrange(1, 17)
        if kind in ("greedy", "stop"):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            if kind == "stop":  # stop at a token its greedy run emits
                run = hf_greedy(hf_model, prompt, max_tokens)
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, stop_token_ids=[rng.choice(run)]
                )
        else:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=rng.choice([0.7, 1.0, 1.3]),
                top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.8]),
                seed=rng.randrange(1 << 20) if kind == "seeded" else None,
                ignore_eos=rng.random() < 0.5,
            )  # fmt: skip
        arrival = rng.randrange(0, 24)
        abort_at = arrival + rng.randrange(0, 10) if rng.random() < 0.2 else None
        reqs.append(Req(prompt, params, kind, arrival, abort_at))
    return reqs


def expected_greedy(hf_model, req: Req) -> list[int]:
    tokens = hf_greedy(hf_model, req.prompt, req.params.max_tokens)
    for i, t in enumerate(tokens):
        if t in req.params.stop_token_ids:
            return tokens[: i + 1]
    return tokens


ENGINES = [
    # a pool of 10 blocks for 6 sequences of up to 73 tokens: preemption; 24-token chunks
    dict(block_size=16, num_blocks=10, max_num_seqs=6, max_num_batched_tokens=24),
    # no mixed steps: every prompt chunk in the prefill forward
    dict(block_size=16, num_blocks=14, max_num_seqs=4, mixed_prefill_tokens=0),
    dict(block_size=32, num_blocks=6, max_num_seqs=8, max_num_batched_tokens=40),
]


@dataclass
class Run:
    tokens: list[list[int]]  # each request's tokens, as its outputs delivered them
    reasons: list[str | None]  # each request's finish reason (None: aborted before it)
    aborted: set[int]
    cached_tokens: int = 0  # prompt tokens the finished requests found in the prefix cache


def offer_bad_request(engine, rng: random.Random) -> None:
    """A request the engine must refuse with a ValueError naming the field, changing nothing:
    an id already in flight, a token outside the vocabulary, or too long a request."""
    four = SamplingParams(max_tokens=4)
    bad = [
        ("bad", [5, engine.model_config.vocab_size], four, r"prompt_token_ids\[1\]"),
        ("bad", [5] * 8, SamplingParams(max_tokens=engine.max_model_len), "max_tokens"),
    ]
    if engine.requests:
        in_flight = rng.choice(sorted(engine.requests))
        bad.append((in_flight, [5, 6], four, f"request_id '{in_flight}' is already in flight"))
    request_id, prompt, params, message = rng.choice(bad)
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, prompt, params)


def drive(engine, reqs: list[Req], seed: int = 0) -> Run:
    """Add, abort and step on the scenario's schedule, with a bad request offered now and
    then, checking the engine's invariants and the outputs' order (nothing after a
    request's end) at every step."""
    run = Run([[] for _ in reqs], [None] * len(reqs), set())
    rng = random.Random(seed)
    step = 0
    while step <= max(r.arrival for r in reqs) or engine.has_unfinished():
        if rng.random() < 0.2:
            offer_bad_request(engine, rng)
        for i, r in enumerate(reqs):
            if r.arrival == step:
                engine.add_request(f"r{i}", r.prompt, r.params)
            if r.abort_at == step and r.arrival <= step:
                in_flight = run.reasons[i] is None
                assert engine.abort(f"r{i}") == in_flight, f"r{i}: in flight or not"
                if in_flight:
                    run.aborted.add(i)
        for out in engine.step():
            i = int(out.request_id[1:])
            assert run.reasons[i] is None and i not in run.aborted, f"r{i}: output after its end"
            run.tokens[i] += out.new_token_ids
            if out.finished:
                run.reasons[i] = out.finish_reason
                run.cached_tokens += out.num_cached_tokens
        engine.check_invariants()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert_no_leak(engine)
    return run


def check_run(run: Run, reqs: list[Req], hf_model) -> None:
    """Every request not aborted finished once, by its limit or at its first stop token;
    the greedy ones with transformers' tokens."""
    eos = hf_model.config.eos_token_id
    for i, r in enumerate(reqs):
        if i in run.aborted:
            continue
        got, limit, reason = run.tokens[i], r.params.max_tokens, run.reasons[i]
        assert reason in ("length", "stop"), f"r{i} ({r.kind}) never finished"
        assert all(0 <= t < hf_model.config.vocab_size for t in got)
        stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else {eos})
        if reason == "length":
            assert len(got) == limit and not stops & set(got), f"r{i} ({r.kind})"
        else:
            assert len(got) <= limit and got[-1] in stops and not stops & set(got[:-1])
        if r.kind in ("greedy", "stop"):
            assert got == expected_greedy(hf_model, r), f"r{i} ({r.kind}), {len(r.prompt)} tokens"


def compared(run: Run, reqs: list[Req]) -> list[list[int] | None]:
    """The tokens that must not depend on the run: greedy and seeded requests'."""
    return [
        None if i in run.aborted or r.kind == "unseeded" else run.tokens[i]
        for i, r in enumerate(reqs)
    ]


@pytest.mark.parametrize("case", range(len(ENGINES)))
def test_random_schedules_lose_nothing_and_keep_every_requests_tokens(checkpoint, case):
    path, hf_model = checkpoint
    reqs = scenario(case, hf_model)
    engine = make_engine(path, **ENGINES[case])
    run = drive(engine, reqs, seed=case)
    check_run(run, reqs, hf_model)
    # What the schedules exercise: stops met, aborts in flight, cache hits, preemption.
    assert sum(r.kind == "stop" and run.reasons[i] == "stop" for i, r in enumerate(reqs)) > 0
    assert len(run.aborted) > 0 and run.cached_tokens > 0
    assert engine.stats().num_preempted_total > 0 or case != 0  # case 0's pool is too small
    alone = make_engine(path, **ENGINES[case])
    for i, r in enumerate(reqs):  # a seed's draws depend on the request alone
        if r.kind == "seeded" and i not in run.aborted:
            out = alone.generate([r.prompt], r.params)[0]
            assert run.tokens[i] == out.token_ids, f"r{i}: seeded, {len(r.prompt)} tokens"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", range(len(ENGINES)))
def test_gpu_random_schedules_float32_is_hfs_and_graphs_change_no_token(checkpoint, case):
    """On the GPU: in float32 every greedy request gets transformers' tokens; in float16 and
    bfloat16 greedy and seeded requests get the same tokens with CUDA graphs on and off."""
    path, hf_model = checkpoint
    reqs = scenario(case, hf_model)
    engine = make_engine(path, device="cuda", **ENGINES[case])
    check_run(drive(engine, reqs, seed=case), reqs, hf_model)
    for dtype in ("float16", "bfloat16"):
        runs = []
        for graphs in (True, False):
            config = ENGINES[case] | dict(device="cuda", dtype=dtype, enable_cuda_graphs=graphs)
            engine = make_engine(path, **config)
            assert engine.runner.use_cuda_graphs == graphs
            runs.append(drive(engine, reqs, seed=case))
        assert runs[0].aborted == runs[1].aborted
        assert compared(runs[0], reqs) == compared(runs[1], reqs), dtype
