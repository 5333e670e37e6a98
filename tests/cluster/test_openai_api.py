"""The OpenAI front door, driven by the official `openai` package against a real local
Serve app of a tiny Qwen3 whose tokenizer (a byte-level BPE) and chat template the test
builds; greedy output is checked against transformers' generate."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from cluster import Client, ClusterConfig, build_app
from cluster.client import chat_prompt_ids
from cluster.ingress import IGNORED_FIELDS_HEADER
from cluster.openai_api import ChatCompletionRequest, CompletionRequest, parse
from replica import SamplingParams
from tests.cluster.local_ray import local_serve
from tests.replica.tiny_chat_model import save_chat_model, train_tokenizer

APP_NAME = "kvfleet-openai"
MODEL_NAME = "tiny-chat"
PARTS = [{"type": "text", "text": "hello there, "}, {"type": "text", "text": "fox"}]
MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant."},
    {"role": "user", "content": PARTS},
]


@dataclass(frozen=True)
class App:
    base_url: str
    model_path: str
    tokenizer: object
    model: torch.nn.Module
    client: Client

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def greedy(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        """transformers' greedy tokens after prompt_ids (float32, CPU)."""
        eos = {"eos_token_id": None} if ignore_eos else {}
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                **eos,
            )
        return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[App]:
    from ray import serve

    model_path, tokenizer, model = save_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    config = ClusterConfig(
        model=model_path,
        served_model_name=MODEL_NAME,
        num_replicas=1,
        num_blocks=128,
        max_num_seqs=8,
        device="cpu",
        http=True,
        app_name=APP_NAME,
    )
    with local_serve(num_cpus=4) as base_url:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        yield App(base_url, model_path, tokenizer, model, Client(APP_NAME))


def _stop_across_tokens(tokenizer, token_ids: list[int]) -> tuple[int, str]:
    """(k, a two-letter stop string spanning tokens k - 1 and k, first seen there)."""
    pieces = [
        tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True)
        for i in range(len(token_ids))
    ]
    for k in range(1, len(pieces)):
        n = len(pieces[k - 1])
        stop = pieces[k][n - 1 : n + 1]
        if n > 0 and len(stop) == 2 and stop.isalpha() and pieces[k].find(stop) == n - 1:
            return k, stop
    raise AssertionError(f"no letter pair across a token boundary in {pieces[-1]!r}")


# --- without Ray -----------------------------------------------------------------------


def test_request_schemas() -> None:
    body = parse(CompletionRequest, {"prompt": "hi", "bogus": 1, "echo": False, "logprobs": None})
    assert body.ignored_fields == ["bogus"]
    body.check_supported()
    assert body.sampling_params(None).max_tokens is None
    assert parse(CompletionRequest, {"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert parse(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    for bad, field in (
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stop": [1]}, "stop[0]"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({}, "prompt"),
    ):
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            parse(CompletionRequest, bad)
    full = {
        "prompt": "x", "n": 2, "best_of": 3, "logprobs": 2, "echo": True, "seed": 1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {"7": 5, "3": -1.5}, "min_tokens": 2, "max_tokens": 4,
    }  # fmt: skip
    params = parse(CompletionRequest, full).engine_params()
    assert (params.n, params.logprobs, params.prompt_logprobs) == (3, 2, 2)
    assert params.logit_bias == ((3, -1.5), (7, 5.0)) and params.min_tokens == 2
    assert (params.presence_penalty, params.repetition_penalty) == (0.5, 1.2)
    # best_of alone asks the engine for the logprobs its ranking needs.
    ranked = parse(CompletionRequest, {"prompt": "x", "best_of": 2}).engine_params()
    assert (ranked.n, ranked.logprobs, ranked.prompt_logprobs) == (2, 0, None)
    chat = parse(ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3})
    assert chat.engine_params().logprobs == 3
    for bad, field in (
        ({"suffix": "x"}, "suffix"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ):
        with pytest.raises(ValueError, match=field):
            body = parse(CompletionRequest, {"prompt": "x"} | bad)
            body.check_supported()
            body.engine_params()
    with pytest.raises(ValueError, match="top_logprobs"):
        parse(ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 2}).check_supported()
    with pytest.raises(ValueError, match="prompt"):
        parse(CompletionRequest, {"prompt": [[1], "x"]}).prompts()
    chat = parse(ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 3})
    assert chat.chat_messages()[1] == {"role": "user", "content": "hello there, fox"}
    assert chat.max_new_tokens == 3
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        parse(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})


def test_served_model_name() -> None:
    assert ClusterConfig(model="gpt2-tiny").model_name == "gpt2-tiny"
    assert ClusterConfig(model="/models/qwen3-0.6b/").model_name == "qwen3-0.6b"
    assert ClusterConfig(model="gpt2-tiny", served_model_name="x").model_name == "x"
    with pytest.raises(ValueError, match="served_model_name"):
        ClusterConfig(served_model_name="")


def test_chat_prompt_needs_a_tokenizer_and_a_template() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        chat_prompt_ids(None, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="chat_template"):
        chat_prompt_ids(train_tokenizer(chat_template=None), [{"role": "user", "content": "x"}])


# --- a real Serve app --------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_completions_text_tokens_and_a_list(app: App) -> None:
    oai = app.openai()
    prompts = ["Hello world, the", "The quick brown"]
    ids = [app.tokenizer.encode(p) for p in prompts]
    expected = [app.tokenizer.decode(app.greedy(i, 8), skip_special_tokens=True) for i in ids]
    done = oai.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=8, temperature=0)
    assert done.model == MODEL_NAME
    assert done.choices[0].text == expected[0]
    assert done.usage.prompt_tokens == len(ids[0])
    by_ids = oai.completions.create(
        model=app.model_path, prompt=ids[0], max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == expected[0]
    for batch in (prompts, ids):
        both = oai.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=8, temperature=0)
        assert [(c.index, c.text) for c in both.choices] == [(0, expected[0]), (1, expected[1])]
        assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    streamed = {0: "", 1: ""}
    for chunk in oai.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0, stream=True
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert list(streamed.values()) == expected


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_stop_string_across_tokens_streamed_and_not(app: App) -> None:
    oai = app.openai()
    prompt = app.tokenizer.encode("A café in Paris")
    full = app.greedy(prompt, 32, ignore_eos=True)
    k, stop = _stop_across_tokens(app.tokenizer, full)
    text = app.tokenizer.decode(full, skip_special_tokens=True)
    expected = text[: text.index(stop)]
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0}
    request |= {"stop": [stop, "never seen"], "extra_body": {"ignore_eos": True}}
    done = oai.completions.create(**request)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, "stop")
    assert done.usage.completion_tokens == k + 1  # up to the token completing the stop

    chunks = list(oai.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    # The request was aborted on its replica at the stop string: its blocks are free.
    deadline_s = time.monotonic() + 10
    while (s := app.client.stats()[0]).num_running or s.kv_usage:
        assert time.monotonic() < deadline_s, s
        time.sleep(0.1)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_stream_usage(app: App) -> None:
    oai = app.openai()
    chunks = list(
        oai.completions.create(
            model=MODEL_NAME, prompt="Hello world", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == len(app.tokenizer.encode("Hello world"))
    assert all(c.usage is None for c in deltas)
    body = {"prompt": "Hello world", "max_tokens": 4, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"continuous_usage_stats": True}
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = [
                json.loads(line.removeprefix("data: "))
                for line in response.iter_lines()
                if line.startswith("data: {")
            ]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 4


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_chat_equals_transformers_streamed_and_not(app: App) -> None:
    oai = app.openai()
    prompt_ids = chat_prompt_ids(
        app.tokenizer,
        [{"role": m["role"], "content": m["content"]} if isinstance(m["content"], str)
         else {"role": m["role"], "content": "hello there, fox"} for m in MESSAGES],
    )  # fmt: skip
    new_ids = app.greedy(prompt_ids, 12)
    expected = app.tokenizer.decode(new_ids, skip_special_tokens=True)
    done = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, temperature=0
    )
    choice = done.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert done.usage.prompt_tokens == len(prompt_ids)
    assert done.usage.completion_tokens == len(new_ids)
    assert choice.finish_reason == ("stop" if len(new_ids) < 12 else "length")

    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, finish, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected
    assert finish.choices[0].finish_reason == choice.finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == len(new_ids)
    # The Python Client's chat: the same template, the same tokens.
    plain = [{"role": "system", "content": MESSAGES[0]["content"]}]
    plain.append({"role": "user", "content": "hello there, fox"})
    by_client = app.client.chat(plain, SamplingParams(max_tokens=12, temperature=0.0))
    assert by_client.token_ids == new_ids and by_client.text == expected


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_serving_surface(app: App) -> None:
    oai = app.openai()
    with pytest.raises(openai.BadRequestError, match="model"):
        oai.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, suffix="y")
    # Fields at their defaults are accepted, as clients send them.
    oai.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=2, echo=False, presence_penalty=0,
        frequency_penalty=0, logit_bias={}, best_of=1, n=1, user="someone",
    )  # fmt: skip
    (card,) = oai.models.list().data
    assert card.id == MODEL_NAME and card.model_extra["max_model_len"] == 256
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        response = http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "bogus": 1, "zeta": {}}
        )
        assert response.status_code == 200, response.text
        assert response.headers[IGNORED_FIELDS_HEADER] == "bogus, zeta"
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": "2"})
        assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]

        tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert tokens["tokens"] == app.tokenizer.encode("Hello world")
        assert tokens["count"] == len(tokens["tokens"])
        chat = http.post("/tokenize", json={"messages": MESSAGES[:1]}).json()
        assert chat["tokens"] == chat_prompt_ids(app.tokenizer, [dict(MESSAGES[0])])
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert text["prompt"] == "Hello world"
        bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
        assert bad.status_code == 400 and "tokens[1]" in bad.json()["error"]["message"]
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200


def _hf_logprobs(app: App, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of token_ids (float32)."""
    with torch.no_grad():
        logits = app.model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_logprobs_and_echo_equal_transformers(app: App) -> None:
    oai = app.openai()
    prompt = app.tokenizer.encode("Hello there, fox")
    kw = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    done = oai.completions.create(prompt=prompt, echo=True, **kw)
    choice = done.choices[0]
    new_ids = choice.model_extra["token_ids"]
    ids = prompt + new_ids
    expected = _hf_logprobs(app, ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.tokens[0] == app.tokenizer.decode(ids[:1])
    for k in range(1, len(ids)):
        assert abs(lp.token_logprobs[k] - expected[k - 1, ids[k]].item()) < 1e-4
        top = expected[k - 1].topk(3)
        top_texts = [app.tokenizer.decode([t]) for t in top.indices.tolist()]
        assert list(lp.top_logprobs[k]) == top_texts or len(set(top_texts)) < 3
        for got, want in zip(lp.top_logprobs[k].values(), top.values.tolist(), strict=False):
            assert abs(got - want) < 1e-4
    assert choice.text.startswith("Hello there, fox")
    assert lp.text_offset[1] == len(lp.tokens[0])
    # Streamed: the same new tokens' logprobs, delta by delta.
    streamed = []
    for event in oai.completions.create(prompt=prompt, stream=True, **kw):
        streamed += event.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs[len(prompt) :], abs=1e-6)
    # Chat's shape: content entries with top_logprobs.
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    chat_ids = chat_prompt_ids(app.tokenizer, [dict(m) for m in MESSAGES[:1]] + [
        {"role": "user", "content": "hello there, fox"}])  # fmt: skip
    out_ids = app.greedy(chat_ids, 4, ignore_eos=True)[: len(content)]
    expected = _hf_logprobs(app, chat_ids + out_ids)
    for k, entry in enumerate(content):
        want = expected[len(chat_ids) - 1 + k, out_ids[k]].item()
        assert abs(entry.logprob - want) < 1e-4 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_n_samples_share_one_prefill_and_best_of(app: App) -> None:
    oai = app.openai()
    prompt = app.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    kw = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "seed": 7,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    hits_before = sum(s.prefix_hit_tokens for s in app.client.stats())
    first = oai.completions.create(n=3, **kw)
    texts = [c.model_extra["token_ids"] for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({tuple(t) for t in texts}) == 3  # three distinct samples
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 18
    # The forked samples did not compute the prompt: the replica counts it as cached.
    deadline_s = time.monotonic() + 30  # the stats are fresh to within their period
    while (hits := sum(s.prefix_hit_tokens for s in app.client.stats()) - hits_before) < 2 * (
        len(prompt) - 1
    ) and time.monotonic() < deadline_s:
        time.sleep(0.2)
    assert hits >= 2 * (len(prompt) - 1)
    again = oai.completions.create(n=3, **kw)
    assert [c.model_extra["token_ids"] for c in again.choices] == texts  # reproducible
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for event in oai.completions.create(n=3, stream=True, **kw):
        for c in event.choices:
            streamed[c.index] += c.model_extra["token_ids"]
    assert list(streamed.values()) == texts
    # The Python Client: the same samples, with their logprobs.
    params = SamplingParams(max_tokens=6, seed=7, ignore_eos=True, n=3, logprobs=1)
    samples = app.client.samples(prompt, params)
    assert [c.token_ids for c in samples] == texts and [c.index for c in samples] == [0, 1, 2]
    assert all(len(c.logprobs) == 6 and len(c.logprobs[0].top_ids) == 1 for c in samples)
    with pytest.raises(ValueError, match="n"):
        app.client.generate(prompt, params)
    # A stop string that ends sample 0 early leaves the others running to their end.
    free = app.client.samples(prompt, SamplingParams(max_tokens=12, seed=5, n=2, ignore_eos=True))
    text0, text1 = free[0].text, free[1].text
    stop = next(text0[i : i + 2] for i in range(1, len(text0) - 1) if text0[i : i + 2] not in text1)
    stopped = app.client.samples(
        prompt, SamplingParams(max_tokens=12, seed=5, n=2, ignore_eos=True, stop=[stop])
    )
    assert stopped[0].finish_reason == "stop" and text0.startswith(stopped[0].text)
    assert (stopped[1].token_ids, stopped[1].finish_reason) == (free[1].token_ids, "length")
    # best_of: the most likely of 3 samples, with its logprobs when asked.
    best = oai.completions.create(best_of=3, n=1, logprobs=0, **kw)
    (choice,) = best.choices
    assert choice.model_extra["token_ids"] in texts
    # Chat with n: a choice per sample, streamed too.
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, n=2, seed=3, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    seen = set()
    for event in oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, n=2, seed=3, stream=True
    ):
        seen |= {c.index for c in event.choices}
    assert seen == {0, 1}


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_penalties_bias_and_min_tokens(app: App) -> None:
    oai = app.openai()
    prompt = app.tokenizer.encode("Hello there")
    kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = oai.completions.create(**kw).choices[0].model_extra["token_ids"]
    forced = oai.completions.create(logit_bias={"17": 100}, **kw)
    assert forced.choices[0].model_extra["token_ids"] == [17] * 6
    # A strong frequency penalty never repeats a token greedy decoding would repeat.
    penalized = oai.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw)
    ids = penalized.choices[0].model_extra["token_ids"]
    if len(set(plain)) < len(plain):
        assert ids != plain
    extra = {"repetition_penalty": 1.5}  # vLLM's fields, beyond the openai package's
    repeated = oai.completions.create(extra_body=extra, **kw).choices[0]
    assert len(repeated.model_extra["token_ids"]) <= 6
    # min_tokens holds back the stop token the bias pushes: the request runs to min_tokens.
    eos = app.tokenizer.eos_token_id
    kw_eos = kw | {"logit_bias": {str(eos): 100}, "max_tokens": 8}
    assert oai.completions.create(**kw_eos).usage.completion_tokens == 1
    held = oai.completions.create(extra_body={"min_tokens": 5}, **kw_eos)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    # Bad values are 400s naming the field while a stream keeps being served.
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        with http.stream(
            "POST", "/v1/completions",
            json={"prompt": prompt, "max_tokens": 24, "stream": True, "ignore_eos": True},
        ) as stream:  # fmt: skip
            for bad, field in (
                ({"logit_bias": {"10000000": 1}}, "logit_bias"),
                ({"presence_penalty": 9}, "presence_penalty"),
                ({"n": 0}, "n"),
                ({"logprobs": 99}, "logprobs"),
                ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
            ):
                response = http.post("/v1/completions", json={"prompt": prompt} | bad)
                assert response.status_code == 400, (bad, response.text)
                assert field in response.json()["error"]["message"]
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 24
