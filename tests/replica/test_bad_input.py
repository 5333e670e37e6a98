"""Bad input at the engine's entry: a ValueError naming the field, and nothing else changes.

Each bad request is offered while a good one is mid-generation; the good one must still
produce exactly the tokens it produces alone, and the block manager stays consistent.
"""

from __future__ import annotations

import math

import pytest

from replica import EngineConfig, LLMEngine, SamplingParams

GOOD_PROMPT = [464, 329, 318, 40, 88]
GOOD = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        model="gpt2-tiny", device="cpu", num_blocks=32, max_num_seqs=4, max_model_len=128
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def expected(engine: LLMEngine) -> list[int]:
    return engine.generate([GOOD_PROMPT], GOOD)[0].token_ids


BAD_PROMPTS = [
    ([], "prompt_token_ids must not be empty"),
    ([1] * MAX_MODEL_LEN, "max_model_len"),
    ([1] * 200, "max_model_len"),
    ([1, -1], r"prompt_token_ids\[1\]"),
    ([1, 512], r"prompt_token_ids\[1\]"),  # gpt2-tiny's vocabulary is 512
    ([5] * 100 + [512], r"prompt_token_ids\[100\]"),  # the fast check fails, the loop names it
    ([5] * 100 + [True], r"prompt_token_ids\[100\]"),
    ([1, 10**30], r"prompt_token_ids\[1\]"),
    ([1, True], r"prompt_token_ids\[1\]"),
    ([1, 2.0], r"prompt_token_ids\[1\]"),
    ([1, "2"], r"prompt_token_ids\[1\]"),
    ([1, None], r"prompt_token_ids\[1\]"),
    ("hello", "prompt_token_ids"),
    (b"\x01\x02", "prompt_token_ids"),
    (None, "prompt_token_ids"),
    (7, "prompt_token_ids"),
]

BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"top_k": "3"}, "top_k"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"bogus": 1}, "bogus"),
    ({"max_tokens": 8, "beam_width": 2}, "beam_width"),
]


def _good_request_survives(engine: LLMEngine, expected: list[int], offer_bad) -> None:
    """Start a good request, offer the bad input between steps, finish the good one."""
    engine.add_request("good", GOOD_PROMPT, GOOD)
    tokens: list[int] = []
    finished = False
    for step in range(200):
        if step == 1:
            offer_bad()
            engine.check_invariants()
        for out in engine.step():
            assert out.request_id == "good"
            tokens += out.new_token_ids
            finished = out.finished
        if finished:
            break
    assert tokens == expected
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks_total
    assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(("prompt", "match"), BAD_PROMPTS)
def test_bad_prompt_is_a_named_value_error(
    engine: LLMEngine, expected: list[int], prompt: object, match: str
) -> None:
    def offer_bad() -> None:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, GOOD)  # type: ignore[arg-type]

    _good_request_survives(engine, expected, offer_bad)


@pytest.mark.parametrize(("fields", "match"), BAD_PARAMS)
def test_bad_sampling_params_are_named_value_errors(
    engine: LLMEngine, expected: list[int], fields: dict, match: str
) -> None:
    def offer_bad() -> None:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", [1, 2, 3], SamplingParams.from_dict(fields))

    _good_request_survives(engine, expected, offer_bad)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens"),
    [(100, 29), (1, MAX_MODEL_LEN), (1, 10**9)],
)
def test_max_tokens_beyond_the_context_is_named(
    engine: LLMEngine, expected: list[int], prompt_len: int, max_tokens: int
) -> None:
    def offer_bad() -> None:
        with pytest.raises(ValueError, match="max_tokens"):
            engine.add_request("bad", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))

    _good_request_survives(engine, expected, offer_bad)


def test_request_needing_more_blocks_than_the_cache_is_named() -> None:
    small = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=4, max_num_seqs=2))
    with pytest.raises(ValueError, match="max_tokens: .* KV blocks"):
        small.add_request("big", [1] * 60, SamplingParams(max_tokens=20))
    assert not small.has_unfinished()


def test_misc_request_errors_are_named(engine: LLMEngine, expected: list[int]) -> None:
    def offer_bad() -> None:
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request("", [1, 2], GOOD)
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(7, [1, 2], GOOD)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="already in flight"):
            engine.add_request("good", [1, 2], GOOD)
        with pytest.raises(ValueError, match="params"):
            engine.add_request("bad", [1, 2], {"max_tokens": 4})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="sampling params must be an object"):
            SamplingParams.from_dict([("max_tokens", 4)])  # type: ignore[arg-type]
        assert engine.abort("never-added") is False

    _good_request_survives(engine, expected, offer_bad)


@pytest.mark.parametrize(
    "fields", [{"seed": 2**64}, {"seed": -1}, {"top_k": 2**63}, {"stop_token_ids": [2**63]}]
)
def test_out_of_int64_sampling_values_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, temperature=1.0, **fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mixed_prefill_tokens": -1}, "mixed_prefill_tokens"),
        ({"mixed_prefill_tokens": 2.5}, "mixed_prefill_tokens"),
        ({"mixed_prefill_tokens": True}, "mixed_prefill_tokens"),
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"enable_cuda_graphs": "yes"}, "enable_cuda_graphs"),
    ],
)
def test_bad_engine_config_fields_are_named(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="gpt2-tiny", **fields)


def test_generate_is_all_or_nothing(engine: LLMEngine, expected: list[int]) -> None:
    """A bad prompt among good ones: a ValueError naming it, and none of them queued."""
    with pytest.raises(ValueError, match=r"prompts\[2\]: prompt_token_ids\[1\]"):
        engine.generate([GOOD_PROMPT, GOOD_PROMPT, [1, -1], GOOD_PROMPT], GOOD)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match=r"prompts\[1\]: max_tokens"):
        engine.generate([GOOD_PROMPT, [1] * 100], SamplingParams(max_tokens=100))
    assert not engine.has_unfinished()
    engine.check_invariants()
    assert engine.generate([GOOD_PROMPT], GOOD)[0].token_ids == expected


def test_generate_refuses_to_run_beside_add_request(engine: LLMEngine, expected: list[int]) -> None:
    """generate's steps would take another request's outputs: it refuses, and that request
    still gets every token from step()."""

    def offer_bad() -> None:
        with pytest.raises(RuntimeError, match="idle engine: 1 requests"):
            engine.generate([GOOD_PROMPT], GOOD)

    _good_request_survives(engine, expected, offer_bad)
