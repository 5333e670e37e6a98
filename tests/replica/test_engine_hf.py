"""Greedy output equals transformers' generate(do_sample=False), token for token."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
import transformers

from replica import EngineConfig, LLMEngine, SamplingParams
from replica.options import EngineOptions
from replica.runner.graph_sampling import GraphSamplingInputs

MAX_NEW = 20

HF_CONFIGS = {
    "gpt2": transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=384, n_positions=256,
        bos_token_id=383, eos_token_id=383,
    ),
    "llama": transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=384, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    ),
    "qwen3": transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=384, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
}  # fmt: skip
HF_CLASSES = {
    "gpt2": transformers.GPT2LMHeadModel,
    "llama": transformers.LlamaForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


def save_checkpoint(name: str, directory, **config_overrides) -> tuple[str, torch.nn.Module]:
    """A save_pretrained directory of random weights (seeded), and its HF model."""
    config = HF_CONFIGS[name]
    if config_overrides:
        config = copy.deepcopy(config)
        for key, value in config_overrides.items():
            setattr(config, key, value)
    torch.manual_seed(1234)
    model = HF_CLASSES[name](config).eval()
    model.save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """A save_pretrained directory of random weights, and its HF model for reference."""
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def hf_greedy(model, prompt: list[int], max_new: int, **generate_kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=model.config.eos_token_id,
            **generate_kwargs,
        )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    eos = model.config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def make_engine(
    path: str, block_size: int, emulate_graphs_on_cpu: bool = False, **overrides
) -> LLMEngine:
    config = dict(model=path, device="cpu", dtype="float32", block_size=block_size,
                  num_blocks=64, max_num_seqs=8)  # fmt: skip
    return LLMEngine(EngineConfig(**(config | overrides)), emulate_graphs_on_cpu)


def assert_matches_hf(engine, hf_model, prompts, max_new=MAX_NEW):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(hf_model, prompt, max_new)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("stop" if len(expected) < max_new else "length")
    assert_no_leak(engine)
    return outs


def assert_no_leak(engine):
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks_total


def random_prompts(seed: int, lengths: list[int], vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_mixed_lengths_across_block_boundaries(checkpoint, block_size):
    path, hf_model = checkpoint
    engine = make_engine(path, block_size)
    prompts = random_prompts(block_size, [1, 7, block_size - 1, block_size, block_size + 1, 45])
    assert_matches_hf(engine, hf_model, prompts)


@pytest.mark.parametrize("block_size", [16, 32])
def test_shared_prefixes_hit_the_cache(checkpoint, block_size):
    path, hf_model = checkpoint
    engine = make_engine(path, block_size)
    system = random_prompts(7, [2 * block_size + 3])[0]
    suffixes = random_prompts(8, [1, 5, 11])
    first = assert_matches_hf(engine, hf_model, [system + suffixes[0]])
    assert first[0].num_cached_tokens == 0
    rest = assert_matches_hf(engine, hf_model, [system + s for s in suffixes[1:]])
    assert all(out.num_cached_tokens == 2 * block_size for out in rest)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 8])
def test_requests_arriving_together_share_the_prefix_in_flight(checkpoint, max_num_batched_tokens):
    """Requests that arrive with one whose prefix is still being computed (in one step,
    or over several chunks) wait for it and start on the cached blocks instead of
    computing and holding a copy; the tokens are unchanged."""
    path, hf_model = checkpoint
    engine = make_engine(path, 16, max_num_batched_tokens=max_num_batched_tokens)
    system = random_prompts(7, [3 * 16 + 5])[0]
    prompts = [system + s for s in random_prompts(8, [1, 5, 11, 3])]
    outs = assert_matches_hf(engine, hf_model, prompts)
    assert [out.num_cached_tokens for out in outs] == [0] + [3 * 16] * 3


def test_a_request_waiting_for_a_prefix_lets_others_pass(checkpoint):
    path, _ = checkpoint
    engine = make_engine(path, 16)
    system, other = random_prompts(9, [40, 40])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("first", system + [5], params)
    engine.add_request("same-prefix", system + [6], params)
    engine.add_request("other-prefix", other, params)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first", "other-prefix"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["same-prefix"]
    engine.step()  # "first"'s prefix blocks were registered when its step launched
    assert engine.requests["same-prefix"].num_cached_tokens == 2 * 16
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


@pytest.mark.parametrize("block_size", [16, 32])
def test_small_pool_forces_preemption(checkpoint, block_size):
    path, hf_model = checkpoint
    # 6 sequences of up to ~60 tokens in a pool that holds only a few at once.
    num_blocks = 6 if block_size == 16 else 4
    engine = make_engine(path, block_size, num_blocks=num_blocks)
    prompts = random_prompts(3, [30, 12, 25, 40, 9, 33])
    assert_matches_hf(engine, hf_model, prompts)
    assert engine.stats().num_preempted_total > 0


def test_chunked_prefill(checkpoint):
    path, hf_model = checkpoint
    engine = make_engine(path, 16, max_num_seqs=4, max_num_batched_tokens=4)
    prompts = random_prompts(5, [37, 5, 23])
    assert_matches_hf(engine, hf_model, prompts)


def run_staggered(engine, prompts, params, every: int = 2) -> list[list[int]]:
    """Add one request every `every` steps while the earlier ones decode; tokens per prompt."""
    tokens: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            i = pending.pop(0)
            engine.add_request(
                f"r{i}", prompts[i], params[i] if isinstance(params, list) else params
            )
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.new_token_ids
        steps += 1
    assert_no_leak(engine)
    return tokens


def count_prefill_forwards(engine, rows: list | None = None) -> list[int]:
    """Each call of the runner's separate prefill forward appends its count of prompt
    chunks; rows, if given, gets each call's (prompt chunks, decode sequences)."""
    calls, run_prefill = [], engine.runner._run_prefill

    def counted(seqs, lens):
        prompts = sum(s.num_computed_tokens < s.num_prompt_tokens for s in seqs)
        calls.append(prompts)
        if rows is not None:
            rows.append((prompts, len(seqs) - prompts))
        return run_prefill(seqs, lens)

    engine.runner._run_prefill = counted
    return calls


def test_requests_joining_decode_steps_ride_in_them(checkpoint):
    """Short prompts arriving while others decode run as rows of the decode forward (no
    prefill forward at all), chunks of a longer prompt too; the tokens are HF's."""
    path, hf_model = checkpoint
    engine = make_engine(path, 16, max_num_batched_tokens=12)
    prompts = random_prompts(13, [5, 16, 1, 9, 31, 12, 4])
    prompts.append(prompts[1][:7] + [7, 8, 9])  # part cached: its chunk starts at a block's end
    prompts.append(random_prompts(14, [40])[0])  # chunked: 12-token chunks, minus the decodes
    calls = count_prefill_forwards(engine)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    tokens = run_staggered(engine, prompts, params)
    assert calls == []
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(hf_model, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mixed_steps_on_and_off_give_the_same_tokens(checkpoint, temperature):
    path, _ = checkpoint
    prompts = random_prompts(15, [3, 20, 8, 33, 1, 14, 26, 6])
    params = [
        SamplingParams(max_tokens=12, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results, prefills = [], []
    for mixed in (32, 0):
        engine = make_engine(path, 16, mixed_prefill_tokens=mixed)
        prefills.append(count_prefill_forwards(engine))
        results.append(run_staggered(engine, prompts, params, every=3))
    assert results[0] == results[1]
    assert prefills[0] == [1]  # only the 33-token prompt, past the mixed budget
    assert prefills[1] == [1] * len(prompts)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_rows_in_the_prefill_forward_give_the_same_tokens(checkpoint, temperature):
    """Steps with prompt chunks past mixed_prefill_tokens run their decode sequences as
    one-token chunks of the prefill forward (EngineOptions.decode_in_prefill): the tokens
    are those of a decode forward after the prefill, greedy (HF's) and seeded sampling."""
    path, hf_model = checkpoint
    prompts = random_prompts(16, [3, 20, 8, 33, 1, 14, 26, 6, 40])
    params = [
        SamplingParams(max_tokens=12, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results, rows = [], []
    for on in (True, False):
        options = EngineOptions(decode_in_prefill=on)
        engine = make_engine(path, 16, mixed_prefill_tokens=0, options=options)
        assert engine.runner.decode_in_prefill is on
        rows.append([])
        count_prefill_forwards(engine, rows[-1])
        results.append(run_staggered(engine, prompts, params, every=3))
    assert results[0] == results[1]
    assert [p for p, _ in rows[0]] == [p for p, _ in rows[1]] == [1] * len(prompts)
    assert sum(d for _, d in rows[0]) > 0 and all(d == 0 for _, d in rows[1])
    if temperature == 0.0:
        assert results[0] == [hf_greedy(hf_model, p, 12) for p in prompts]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="drives the CUDA sampler on a CPU engine (the interpreter)"
)
def test_fused_sampling_draws_by_seed_and_position_whatever_the_batch(checkpoint):
    """The CUDA sampler (kernels.sampling, here under the interpreter): a seeded request's
    tokens come from its seed and its positions alone, so they are the same arriving with
    the others or one at a time; greedy requests beside sampled ones stay HF's greedy."""
    path, hf_model = checkpoint
    prompts = random_prompts(17, [3, 20, 8, 33, 1, 14])
    kinds = [
        {"temperature": 0.9, "top_k": 12},  # the top-k launch
        {"temperature": 1.1, "top_p": 0.8},  # the whole-vocabulary launch
        {"temperature": 0.0},
    ]
    params = [
        SamplingParams(max_tokens=10, seed=100 + i, ignore_eos=True, **kinds[i % 3])
        for i in range(len(prompts))
    ]
    results = []
    for every in (1, 3):
        engine = make_engine(path, 16)
        engine.runner.sampler.fused = True
        results.append(run_staggered(engine, prompts, params, every=every))
    alone = make_engine(path, 16)
    alone.runner.sampler.fused = True
    results.append([o.token_ids for o in alone.generate(prompts, params)])
    assert results[0] == results[1] == results[2]
    for i in range(2, len(prompts), 3):
        assert results[0][i] == hf_greedy(hf_model, prompts[i], 10)
    assert len({tuple(t) for t in results[0]}) == len(prompts)


@pytest.mark.parametrize("fused", [False, True])
def test_a_requests_seed_moves_only_its_own_tokens(checkpoint, fused):
    """Same requests, same steps, one seed changed: that request's tokens change and no
    other's, with either sampler (the steps' shapes do not change, so neither do the other
    rows' logits, on the GPU too)."""
    path, _ = checkpoint
    prompts = random_prompts(18, [5, 12, 9, 30])

    def run(first_seed: int) -> list[list[int]]:
        top_ks = [20, 0, 20, 0]  # the top-k launch and the whole-vocabulary one
        seeds = [first_seed, 1, 2, 3]
        params = [
            SamplingParams(max_tokens=12, top_p=0.9, top_k=k, seed=s, ignore_eos=True)
            for k, s in zip(top_ks, seeds, strict=True)
        ]
        # The CUDA sampler: natively on a GPU, else on a CPU engine under the interpreter.
        device = "cuda" if fused and torch.cuda.is_available() else "cpu"
        engine = make_engine(path, 16, device=device)
        engine.runner.sampler.fused = fused
        return [o.token_ids for o in engine.generate(prompts, params)]

    base, moved = run(1000), run(2000)
    assert base == run(1000)
    assert moved[0] != base[0] and moved[1:] == base[1:]


def test_streaming_interface_and_abort_free_blocks(checkpoint):
    path, hf_model = checkpoint
    engine = make_engine(path, 16)
    prompts = random_prompts(11, [9, 20])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    engine.add_request("keep", prompts[0], params)
    engine.add_request("drop", prompts[1], params)
    tokens: list[int] = []
    finished = None
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "keep":
                tokens += out.new_token_ids
                finished = out.finish_reason if out.finished else None
        steps += 1
        if steps == 3:
            assert engine.abort("drop")
            engine.check_invariants()
    assert not engine.abort("drop")
    assert tokens == hf_greedy(hf_model, prompts[0], MAX_NEW) and finished is not None
    assert_no_leak(engine)


def test_tokens_per_s_counts_the_last_two_seconds(checkpoint):
    path, _ = checkpoint
    engine = make_engine(path, 16)
    # The engine's clock stands still while it generates: on a loaded 2-core host the steps
    # took over 2 s of wall time, and the first ones' tokens left the window.
    now = time.monotonic()
    engine.clock = lambda: now  # not time.monotonic: that is every thread's clock
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate(random_prompts(5, [9, 20]), params)
    num_tokens = sum(len(o.token_ids) for o in outs)
    assert num_tokens == 12
    assert engine.stats().tokens_per_s == num_tokens / 2.0  # the window is 2 s
    later = now + 2.5  # every step's tokens leave the window
    engine.clock = lambda: later
    assert engine.stats(with_hashes=False).tokens_per_s == 0.0
    assert engine.stats().tokens_per_s == 0.0  # and stay out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _device_busy_around_a_step(engine) -> tuple[bool, bool]:
    """device_busy() right after a step() whose launch queues behind ~0.3 s of device
    work (on the CPU, none), and again once its tokens are on the host."""
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(600_000_000)  # on the stream the engine launches on
    engine.step()
    busy = engine.device_busy()
    engine.in_flight.handle.wait()
    return busy, engine.device_busy()


def test_device_busy_is_false_on_the_cpu(checkpoint):
    path, _ = checkpoint
    assert _device_busy_around_a_step(make_engine(path, 16)) == (False, False)


@pytest.mark.gpu
@needs_cuda
def test_device_busy_while_the_device_runs_the_step_in_flight(checkpoint):
    path, _ = checkpoint
    assert _device_busy_around_a_step(make_engine(path, 16, device="cuda")) == (True, False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_float32_matches_cpu_and_hf(checkpoint):
    path, hf_model = checkpoint
    prompts = random_prompts(21, [1, 15, 16, 17, 45, 3, 30])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    cpu = make_engine(path, 16).generate(prompts, params)
    gpu_engine = make_engine(path, 16, device="cuda")
    assert [o.token_ids for o in gpu_engine.generate(prompts, params)] == [o.token_ids for o in cpu]
    assert_matches_hf(gpu_engine, hf_model, prompts)
    small = make_engine(path, 16, device="cuda", num_blocks=6, max_num_batched_tokens=8)
    assert_matches_hf(small, hf_model, prompts)  # preemption and chunked prefill on the GPU
    assert small.stats().num_preempted_total > 0
    # Requests joining running ones: their prompts ride in the decode steps (mixed graphs).
    staggered = run_staggered(make_engine(path, 16, device="cuda"), prompts, params)
    assert staggered == [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_graphs_on_and_off_give_identical_tokens(checkpoint, dtype):
    path, _ = checkpoint
    prompts = random_prompts(5, [3, 9, 17, 33, 40, 12, 5, 16, 70, 2, 21])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = []
    for graphs in (True, False):
        engine = make_engine(
            path, 16, device="cuda", dtype=dtype, enable_cuda_graphs=graphs, max_num_seqs=24
        )
        assert engine.runner.use_cuda_graphs == graphs
        results.append([o.token_ids for o in engine.generate(prompts, params)])
        assert_no_leak(engine)
        results.append(run_staggered(engine, prompts, params))  # mixed steps
    assert results[:2] == results[2:]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_graphs_give_the_eager_launches_tokens(checkpoint, dtype, monkeypatch):
    """Seeded sampled requests, top-k ones among them: with CUDA graphs a decode (or mixed)
    step samples in a graph replayed after its forward's; without, through sample_fused's
    launches. Same shapes, same tokens, whether the requests arrive together or join
    running ones."""
    params = [
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8 if i % 2 else 1.0,
                       top_k=20 if i % 3 == 0 else 0, seed=50 + i, ignore_eos=True)
        for i in range(8)
    ]  # fmt: skip
    kinds = sampling_graphs_on_and_off(checkpoint[0], dtype, params, monkeypatch)
    assert {(True, True), (False, True)} <= kinds  # with top-k, without


@pytest.mark.gpu
@needs_cuda
def test_temperature_alone_samples_in_its_own_graph(checkpoint, monkeypatch):
    """Steps whose rows have no top_p and no top_k replay the two-launch graph (no softmax
    sum, no mass rounds): the same tokens as sample_fused's launches."""
    params = [
        SamplingParams(max_tokens=30, temperature=0.5 + 0.1 * i, seed=70 + i, ignore_eos=True)
        for i in range(8)
    ]
    kinds = sampling_graphs_on_and_off(checkpoint[0], "bfloat16", params, monkeypatch)
    assert kinds == {(False, False)}


def sampling_graphs_on_and_off(path, dtype, params, monkeypatch, device="cuda", **sizes) -> set:
    """Tokens with sampling graphs and without (sample_fused) for params (one a prompt),
    all at once and staggered (mixed steps): asserted equal. The graph kinds taken.
    sizes: the engines' max_num_seqs (24 by default) and mixed_prefill_tokens."""
    prompts = random_prompts(7, [3, 9, 17, 33, 40, 12, 5, 16])
    firsts, graphs_taken = [], []
    stage = GraphSamplingInputs.stage

    def recording_stage(self, *args):
        firsts.append(args[4])
        graphs_taken.append(stage(self, *args))
        return graphs_taken[-1]

    monkeypatch.setattr(GraphSamplingInputs, "stage", recording_stage)
    results = []
    for graphs in (True, False):
        engine = make_engine(
            path, 16, device=device, dtype=dtype, enable_cuda_graphs=graphs,
            **({"max_num_seqs": 24} | sizes),
        )  # fmt: skip
        results.append([o.token_ids for o in engine.generate(prompts, params)])
        results.append(run_staggered(engine, prompts, params))  # mixed steps
        assert_no_leak(engine)
        if graphs:  # the graphs sampled decode steps and mixed ones (rows after chunks)
            assert firsts.count(0) > 10 and any(f > 0 for f in firsts)
            graphed = len(firsts)
    assert len(firsts) == graphed  # without graphs, sample_fused's launches
    assert results[:2] == results[2:]
    return set(graphs_taken)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pdl_on_and_off_give_identical_tokens(checkpoint, dtype):
    """Programmatic dependent launch changes when kernels start, never what they compute:
    a kernel that touched memory before its predecessor finished would change tokens."""
    path, _ = checkpoint
    prompts = random_prompts(6, [3, 9, 17, 33, 40, 12, 5, 16, 70, 2, 21])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = []
    for enabled in (True, False):
        options = EngineOptions(pdl=enabled)
        engine = make_engine(path, 16, device="cuda", dtype=dtype, max_num_seqs=24, options=options)
        assert engine.runner.backend.pdl is enabled  # the models' kernels take it from options
        results.append([o.token_ids for o in engine.generate(prompts, params)])
    assert results[0] == results[1]


@pytest.mark.gpu
@needs_cuda
def test_gpu_long_chunks_in_their_own_launch_match_hf(checkpoint, monkeypatch):
    """Chunks over long contexts run on the long list, in wider programs of their own. The
    tiny checkpoints (head_dim 16) get a long tile and LONG_CONTEXT 32 here, so their
    prompts reach it: greedy tokens equal HF's in float32, with CUDA graphs and without,
    whole prompts and chunked ones (later chunks over cached prefixes)."""
    from kernels import prefill_attention as pa

    path, hf_model = checkpoint
    monkeypatch.setattr(pa, "LONG_CONTEXT", 32)
    tiles = pa.prefill_tiles(16, torch.float32)
    long_tile = pa.PrefillTile(128, 32, 4, 2)
    monkeypatch.setitem(pa._TILES, (16, False), pa.PrefillTiles(tiles.main, long_tile, tiles.short))
    prompts = random_prompts(23, [3, 40, 70, 33, 17, 45, 31, 64])
    chunked = {"max_num_batched_tokens": 24, "mixed_prefill_tokens": 0}  # no decode-step rows
    for overrides in ({}, {"enable_cuda_graphs": False}, chunked):
        engine = make_engine(path, 16, device="cuda", **overrides)
        assert engine.runner.prefill.long_q in (64, 128)  # 128 rows: GQA 2 (llama, qwen3) or 1
        fill, long_steps = engine.runner.prefill.fill, []

        def counting_fill(*args, fill=fill, long_steps=long_steps, **kwargs):
            step = fill(*args, **kwargs)
            long_steps.append(step.bucket.num_long_work > 0)
            return step

        engine.runner.prefill.fill = counting_fill
        assert_matches_hf(engine, hf_model, prompts)
        assert any(long_steps), overrides
