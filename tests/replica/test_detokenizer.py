"""Incremental detokenization and stop strings (replica.detokenizer), without Ray."""

from __future__ import annotations

import pytest

from replica import EngineConfig, LLMEngine, SamplingParams
from replica.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from tests.replica.tiny_chat_model import save_chat_model, train_tokenizer

TEXT = "The café serves 日本 coffee 🙂 every morning."


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_one_token_at_a_time_equals_the_full_decode(tokenizer) -> None:
    prompt = tokenizer.encode("Hello world,")
    ids = tokenizer.encode(TEXT)
    # The test means something only if some tokens are parts of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    # Decoding each token alone, as a naive stream would, breaks the characters.
    assert "".join(tokenizer.decode([i]) for i in ids) != TEXT


def test_several_tokens_at_once_and_an_incomplete_end(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [])
    text = detok.add(ids[:5]) + detok.add(ids[5:11]) + detok.add(ids[11:])
    assert text + detok.flush() == TEXT
    emoji = tokenizer.encode("🙂")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(emoji[:-1]) == ""  # held back: not a character yet
    assert detok.flush() == "\ufffd"  # the request ended mid-character: shown as decode does


def test_stop_matcher_holds_back_a_possible_stop_string() -> None:
    matcher = StopMatcher(["abc", "zz"])
    assert matcher.add("xa") == ("x", False)
    assert matcher.add("b") == ("", False)
    assert matcher.add("d") == ("abd", False)  # "abd" can no longer become "abc"
    assert matcher.add("z") == ("", False)
    assert matcher.add("q") == ("zq", False)
    assert matcher.add("ab") == ("", False)
    assert matcher.flush() == "ab"  # the request ended without a stop string


def test_stop_matcher_cuts_before_the_first_stop_string() -> None:
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.add("hel") == ("he", False)
    assert matcher.add("lo world") == ("l", True)  # "lo w" starts before "world"
    assert matcher.add("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    matcher = StopMatcher(["Hi"])
    assert matcher.add("Hi there") == ("", True)


def test_text_stream_stops_on_a_string_across_two_tokens(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # A stop string made of the last char of token k - 1 and the first of token k, whose
    # first occurrence in TEXT is there.
    k, stop = next(
        (k, pieces[k - 1][-1] + pieces[k][len(pieces[k - 1])])
        for k in range(1, len(ids))
        if pieces[k].isascii()
        and TEXT.find(pieces[k - 1][-1] + pieces[k][len(pieces[k - 1])]) == len(pieces[k - 1]) - 1
    )
    stream = TextStream(tokenizer, [], (stop,))
    shown = "".join(stream.add([i]).text for i in ids[:k])
    assert shown == pieces[k - 1][:-1]  # its last char may begin the stop string: held back
    delta = stream.add(ids[k:])
    assert delta.stopped and delta.num_token_ids == 1  # ends on the token completing it
    assert shown + delta.text == TEXT[: TEXT.index(stop)]


def test_text_stream_delta_keeps_the_tokens_up_to_the_stop(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    delta = TextStream(tokenizer, [], ("coffee",)).add(ids, finished=True)
    assert delta.stopped and delta.text == TEXT[: TEXT.index("coffee")]
    assert tokenizer.decode(ids[: delta.num_token_ids]).endswith("coffee")
    assert not tokenizer.decode(ids[: delta.num_token_ids - 1]).endswith("coffee")
    plain = TextStream(tokenizer, [], ("never",)).add(ids, finished=True)
    assert (plain.text, plain.num_token_ids, plain.stopped) == (TEXT, len(ids), False)


@pytest.mark.parametrize("stop", [[""], ["a"] * 5, [1], "", b"x"])
def test_bad_stop_is_named(stop) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_engine_generate_honors_stop(tmp_path) -> None:
    model, tokenizer, _ = save_chat_model(tmp_path)
    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_blocks=64, max_num_seqs=4))
    prompt = tokenizer.encode("Hello world, the café")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = engine.generate([prompt], greedy)[0]
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string of two letters across a token boundary (k - 1, k), first seen there.
    k, stop = next(
        (k, pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1])
        for k in range(1, len(pieces))
        if len(pieces[k]) > len(pieces[k - 1]) > 0
        and pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1].isalpha()
        and pieces[k].find(pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1])
        == len(pieces[k - 1]) - 1
    )
    with_stop = SamplingParams(**{**greedy.to_dict(), "stop": [stop]})
    stopped = engine.generate([prompt, prompt], [with_stop, greedy])
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == full.token_ids[: k + 1]
    assert stopped[1].token_ids == full.token_ids  # its neighbour ran on, unaffected
    engine.check_invariants()
    room = engine.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0))[0]
    assert room.finish_reason in ("stop", "length")
    assert len(room.token_ids) <= engine.max_model_len - len(prompt)

    preset = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=16))
    with pytest.raises(ValueError, match="stop"):
        preset.generate([[1, 2]], SamplingParams(stop=["x"]))
