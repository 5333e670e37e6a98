"""bench.engine's sampling options: the engine's requests and HF's peer sample alike."""

from __future__ import annotations

import pytest

from bench.engine_run import GREEDY, Sampling, random_prompts, run_engine
from replica import EngineConfig, LLMEngine


def test_greedy_by_default_for_both():
    params = GREEDY.params(0, 8)
    assert params.greedy and params.max_tokens == 8 and params.ignore_eos
    assert GREEDY.hf_kwargs() == {"do_sample": False}
    assert str(GREEDY) == "greedy"


def test_sampling_reaches_each_request_and_the_peer():
    sampling = Sampling(temperature=0.8, top_k=50, top_p=0.9, seeded=True)
    first, other = sampling.params(0, 16), sampling.params(3, 16)
    assert (first.temperature, first.top_k, first.top_p, first.max_tokens) == (0.8, 50, 0.9, 16)
    assert (first.seed, other.seed) == (0, 3)
    assert Sampling(temperature=0.8).params(3, 16).seed is None
    assert sampling.hf_kwargs() == {"do_sample": True, "temperature": 0.8, "top_k": 50,
                                    "top_p": 0.9}  # fmt: skip
    assert str(sampling) == "T=0.8 top_k=50 top_p=0.9 seeded"


def test_a_sampled_run_emits_every_token():
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", max_num_seqs=4))
    prompts = random_prompts(4, 6, engine.model_config.vocab_size, 1)
    run = run_engine(engine, prompts, 5, Sampling(temperature=1.0, top_p=0.9, seeded=True))
    assert run.output_tokens == 4 * 5 and run.decode_tokens == 4 * 4


def test_calls_count_as_decode_by_the_step_they_collect():
    """The decode calls account for every decode step's tokens, and no call that collects
    a prompt step (or nothing) counts among them."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", max_num_seqs=4))
    prompts = random_prompts(4, 6, engine.model_config.vocab_size, 2)
    run = run_engine(engine, prompts, 6, GREEDY)
    assert run.output_tokens == 4 * 6 and run.decode_tokens == 4 * 5
    # A prompt step and five decode steps in seven calls: the first collects nothing, the
    # second the prompt step, each later one a decode step (the last launches nothing).
    assert len(run.decode_phases_s) == 5


def test_repeat_reports_the_median_run_and_every_run(tmp_path, monkeypatch, capsys):
    """--repeat N: N runs per batch size on prompts of their own (no prefix-cache hits
    between them); the row is the median run, and the JSON keeps every run's rate."""
    import json
    import sys

    from bench import engine as bench_engine

    seen: list[list[list[int]]] = []
    real_run = bench_engine.run_engine

    def recording_run(engine, prompts, *args, **kwargs):
        seen.append(prompts)
        return real_run(engine, prompts, *args, **kwargs)

    monkeypatch.setattr(bench_engine, "run_engine", recording_run)
    out = tmp_path / "engine.json"
    argv = ["engine", "--batch", "3", "--prompt-len", "20", "--max-new", "4", "--repeat", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    bench_engine.main()
    timed = seen[1:]  # after the warm-up run
    assert len(timed) == 3 and len({tuple(map(tuple, p)) for p in timed}) == 3
    (row,) = json.loads(out.read_text())["rows"]
    rates = row["tok/s runs"]
    assert len(rates) == 3 and row["tok/s"] == sorted(rates)[1] and row["HF tok/s runs"] == []
    assert "batch 3 runs (the table: the medians): tok/s" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "0"])
    with pytest.raises(SystemExit, match="--repeat"):
        bench_engine.main()
