"""StepOutputs, and the engine's drain that fills it: each sampled token checked against
its request's stop tokens and max_len over columns, whatever mix of stop settings,
aborts and preemptions a batch holds."""

from __future__ import annotations

import pytest

from replica import EngineConfig, LLMEngine, RequestOutput, SamplingParams, StepOutputs
from tests.replica.test_engine_hf import assert_no_leak, random_prompts


def test_step_outputs_are_request_outputs_by_row():
    outs = StepOutputs(("a", "b", "c"), [7, 8, 9], {1: ("stop", 4, 2)})
    expected = [
        RequestOutput("a", [7]),
        RequestOutput("b", [8], True, "stop", 4, 2),
        RequestOutput("c", [9]),
    ]
    assert len(outs) == 3 and list(outs) == expected and outs == expected
    assert outs[-2] == expected[1] and outs[1:] == expected[1:]
    assert outs != expected[:2] and StepOutputs() == [] and not StepOutputs()
    with pytest.raises(IndexError):
        outs[3]


def expected_run(reference: list[int], params: SamplingParams, eos: int | None) -> tuple:
    """What a request gets, given the tokens it generates when nothing stops it."""
    stops = set(params.stop_token_ids) | (
        {eos} if eos is not None and not params.ignore_eos else set()
    )
    tokens = reference[: params.max_tokens]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def engine(**overrides) -> LLMEngine:
    config = dict(model="gpt2-tiny", device="cpu", block_size=16, num_blocks=128, max_num_seqs=8)
    return LLMEngine(EngineConfig(**(config | overrides)))


# 7 blocks: a pool that preempts; 8 tokens a step: chunked prompts, some ending one token
# short, so that a decode row samples a request's first token
@pytest.mark.parametrize("num_blocks, max_num_batched_tokens", [(128, 2048), (7, 2048), (7, 8)])
def test_every_mix_of_stop_settings_ends_where_its_request_asks(num_blocks, max_num_batched_tokens):
    prompts = random_prompts(5, [9, 20, 14, 31, 5, 17, 26, 11])
    reference_engine = engine()
    eos = reference_engine.model_config.eos_token_id
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    references = [out.token_ids for out in reference_engine.generate(prompts, free)]
    params = []
    for i, ref in enumerate(references):
        kind = i % 4
        if kind == 0:  # one stop token, eos ignored: the stop column alone
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[ref[3 + i]]))  # fmt: skip
        elif kind == 1:  # several stop tokens: checked in Python
            absent = next(t for t in range(1000) if t not in ref)
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[absent, ref[5 + i]]))  # fmt: skip
        elif kind == 2:  # no stop token: max_len alone
            params.append(SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True))
        else:  # eos (the model's), if it ever samples it
            params.append(SamplingParams(max_tokens=20, temperature=0.0))
    expected = [expected_run(r, p, eos) for r, p in zip(references, params, strict=True)]
    served = engine(num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens)
    for i in range(4):  # half now, half joining the decode steps
        served.add_request(f"r{i}", prompts[i], params[i])
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    ends: dict[str, RequestOutput] = {}
    steps = 0
    while served.has_unfinished() or steps < 4:
        assert steps < 200, "requests never ended"
        outs = served.step()
        assert list(outs.request_ids) == [o.request_id for o in outs]
        for out in outs:
            assert len(out.new_token_ids) == 1 and out.request_id not in ends
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = out
        steps += 1
        if steps == 3:
            for i in range(4, len(prompts)):
                served.add_request(f"r{i}", prompts[i], params[i])
        served.check_invariants()
    for i, (want, reason) in enumerate(expected):
        end = ends[f"r{i}"]
        assert (tokens[f"r{i}"], end.finish_reason) == (want, reason), f"request r{i}"
        assert end.num_prompt_tokens == len(prompts[i])
    if num_blocks == 7:
        assert served.stats().num_preempted_total > 0
    assert_no_leak(served)


def test_an_abort_between_launch_and_drain_drops_only_that_row():
    prompts = random_prompts(8, [12, 12, 12])
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    references = [out.token_ids for out in engine().generate(prompts, free)]
    served = engine()
    for i, prompt in enumerate(prompts):
        served.add_request(f"r{i}", prompt, free)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(4):
        for out in served.step():
            tokens[out.request_id] += out.new_token_ids
    assert served.abort("r1")  # its token of the step in flight is never handed out
    for _ in range(100):
        outs = served.step()
        assert "r1" not in outs.request_ids
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
        if not served.has_unfinished():
            break
    assert tokens["r0"] == references[0] and tokens["r2"] == references[2]
    assert tokens["r1"] == references[1][: len(tokens["r1"])] and len(tokens["r1"]) < 10
    assert_no_leak(served)


def test_a_reused_slot_checks_its_new_requests_length():
    """A request whose prompt chunk stops one token short of its end has its first token
    sampled by a decode row: that row is checked against its own max_len, not that of the
    longer request that held the slot before (which would never stop it)."""
    served = engine(max_num_seqs=2, max_num_batched_tokens=8)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(4, [3, 4, 9, 9])  # 9 tokens: a chunk of 8, then a decode row
    for i, (prompt, params) in enumerate(zip(prompts, [long, long, short, short], strict=True)):
        served.add_request(f"r{i}", prompt, params)
    counts = {f"r{i}": 0 for i in range(4)}
    for _ in range(200):
        for out in served.step():
            counts[out.request_id] += 1
        if not served.has_unfinished():
            break
    assert counts == {"r0": 30, "r1": 30, "r2": 3, "r3": 3}
    assert_no_leak(served)
