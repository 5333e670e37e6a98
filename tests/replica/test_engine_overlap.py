"""Steps two deep (EngineConfig.deep_overlap_rows): the same tokens, a step later."""

from __future__ import annotations

import pytest

from replica import SamplingParams
from replica.engine import merge_outputs
from replica.outputs import RequestOutput
from tests.replica.test_engine_hf import (
    HF_CONFIGS,
    assert_no_leak,
    hf_greedy,
    make_engine,
    random_prompts,
    save_checkpoint,
)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def stream(engine, prompts, max_tokens) -> tuple[dict[str, list[int]], list[list[RequestOutput]]]:
    """Each request's tokens, and each step()'s outputs, checked to be one per request."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = []
    while engine.has_unfinished():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs), "two outputs for one request"
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
        steps.append(outs)
        engine.check_invariants()
    assert_no_leak(engine)
    return tokens, steps


def test_two_deep_steps_give_hfs_tokens_a_step_later(checkpoint):
    """From deep_overlap_rows sampled rows a step, the host collects the step before last:
    the prompts' first tokens come out of the third step() rather than the second. When
    the batch shrinks below the threshold, one step() collects two steps, as one output
    per request. The tokens are transformers' either way."""
    path, hf_model = checkpoint
    prompts = random_prompts(5, [5, 17, 33, 40])
    max_tokens = [3, 6, 20, 20]  # four rows, then three, then two
    expected = {
        f"r{i}": hf_greedy(hf_model, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))
    }
    runs = {}
    for rows in (0, 3):  # 0: one step in flight throughout
        engine = make_engine(path, block_size=16, deep_overlap_rows=rows)
        tokens, steps = stream(engine, prompts, max_tokens)
        assert tokens == expected, f"deep_overlap_rows={rows}"
        runs[rows] = steps
    first = {rows: next(i for i, outs in enumerate(steps) if outs) for rows, steps in runs.items()}
    assert first == {0: 1, 3: 2}
    assert all(len(o.new_token_ids) == 1 for outs in runs[0] for o in outs)
    assert any(len(o.new_token_ids) == 2 for outs in runs[3] for o in outs), "no merged step"


def test_merged_outputs_join_tokens_and_keep_the_end():
    outs = [
        RequestOutput("a", [1]),
        RequestOutput("b", [2]),
        RequestOutput("a", [3], True, "stop", 4, 2),
        RequestOutput("c", [5]),
    ]
    merged = merge_outputs(outs)
    assert [(o.request_id, o.new_token_ids, o.finished) for o in merged] == [
        ("a", [1, 3], True),
        ("b", [2], False),
        ("c", [5], False),
    ]
    assert (merged[0].finish_reason, merged[0].num_prompt_tokens, merged[0].num_cached_tokens) == (
        "stop",
        4,
        2,
    )
