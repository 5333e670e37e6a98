"""An engine with an fp8 KV cache (kv_cache_dtype="fp8").

Its greedy tokens must equal transformers' generate on the same checkpoint with the
cache's rounding applied where HF stores K/V: each layer's new keys and values
rounded to e4m3 (kernels.reference.quantize_kv_ref) as they enter HF's cache, the
current token's included, since kvfleet's attention reads every K/V from its cache.
So the whole path is checked (append, prefill and decode attention, prefix hits,
preemption, chunks) against an independent model, not against itself.
"""

from __future__ import annotations

import pytest
import transformers

from kernels.reference import FP8_KV_DTYPE, quantize_kv_ref
from replica import EngineConfig, LLMEngine, SamplingParams
from tests.replica.test_engine_hf import (
    HF_CONFIGS,
    MAX_NEW,
    assert_no_leak,
    hf_greedy,
    make_engine,
    random_prompts,
    save_checkpoint,
)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """test_engine_hf's checkpoints with weights drawn 5x wider (initializer_range 0.1):
    at 0.02 attention is so flat that gpt2's greedy tokens never feel the rounding."""
    directory = tmp_path_factory.mktemp(f"{request.param}-wide")
    return save_checkpoint(request.param, directory, initializer_range=0.1)


def hf_greedy_fp8_kv(model, prompt: list[int], max_new: int) -> list[int]:
    """hf_greedy with every K/V rounded to e4m3 on its way into HF's cache."""
    cache = transformers.DynamicCache(config=model.config)
    store = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        key_states = quantize_kv_ref(key_states, FP8_KV_DTYPE).to(key_states.dtype)
        value_states = quantize_kv_ref(value_states, FP8_KV_DTYPE).to(value_states.dtype)
        return store(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = update
    return hf_greedy(model, prompt, max_new, past_key_values=cache)


def assert_matches_hf_fp8(engine, hf_model, prompts) -> int:
    """Greedy equality with the fp8-rounded HF; returns how many prompts' tokens differ
    from unrounded HF's (the rounding's visible effect)."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    changed = 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy_fp8_kv(hf_model, prompt, MAX_NEW)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        changed += expected != hf_greedy(hf_model, prompt, MAX_NEW)
    assert_no_leak(engine)
    return changed


def fp8_engine(path: str, block_size: int = 16, **overrides) -> LLMEngine:
    engine = make_engine(path, block_size, kv_cache_dtype="fp8", **overrides)
    assert engine.runner.kv_cache.dtype == FP8_KV_DTYPE
    return engine


def test_matches_hf_with_fp8_rounding(checkpoint):
    """Mixed lengths across block boundaries; the rounding must change some tokens, or
    the equality would not tell an fp8 cache from a float32 one."""
    path, hf_model = checkpoint
    prompts = random_prompts(1, [1, 15, 16, 17, 40, 90, 33, 64])
    changed = assert_matches_hf_fp8(fp8_engine(path), hf_model, prompts)
    assert changed > 0, "fp8 rounding changed no prompt's greedy tokens"


def test_prefix_hits_preemption_and_chunks_with_fp8(checkpoint):
    """Blocks reused from the prefix cache, sequences preempted and recomputed, and
    prompts prefilled in chunks read the same e4m3 values as one straight pass."""
    path, hf_model = checkpoint
    shared = random_prompts(2, [48])[0]
    prompts = [shared + tail for tail in random_prompts(3, [5, 17, 30])] + [shared]
    prompts += random_prompts(4, [70, 70, 70])
    engine = fp8_engine(path, num_blocks=24, max_num_batched_tokens=32)
    assert_matches_hf_fp8(engine, hf_model, prompts)
    assert engine.stats().prefix_hit_tokens > 0
    assert engine.stats().num_preempted_total > 0


def test_fp8_cache_holds_more_blocks_in_the_same_memory(checkpoint):
    path, _ = checkpoint
    sized = dict(num_blocks=None, cpu_kv_cache_gb=2**-10, max_model_len=128, max_num_seqs=64)
    wide, fp8 = make_engine(path, 16, **sized), fp8_engine(path, **sized)
    assert wide.runner.kv_bytes_per_block() == 4 * fp8.runner.kv_bytes_per_block()  # float32
    assert fp8.stats().num_blocks_total == 4 * wide.stats().num_blocks_total


@pytest.mark.parametrize("value", ["int8", "fp16", "", None])
def test_bad_kv_cache_dtype_names_the_field(value):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_fp8_graphs_on_and_off_give_identical_tokens(checkpoint, dtype):
    path, _ = checkpoint
    prompts = random_prompts(5, [3, 17, 40, 64, 9])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=path, device="cuda", dtype=dtype, num_blocks=64, max_num_seqs=8,
                kv_cache_dtype="fp8", enable_cuda_graphs=graphs,
            )
        )  # fmt: skip
        runs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_gpu_fp8_float32_matches_cpu(checkpoint):
    """The Triton kernels' e4m3 rounding and reads equal the torch path's in float32."""
    path, hf_model = checkpoint
    prompts = random_prompts(6, [3, 17, 40, 64])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    gpu = LLMEngine(
        EngineConfig(model=path, device="cuda", dtype="float32", num_blocks=64, max_num_seqs=8,
                     kv_cache_dtype="fp8")
    )  # fmt: skip
    cpu = fp8_engine(path)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]
    for prompt, out in zip(prompts, cpu.generate(prompts, params), strict=True):
        assert out.token_ids == hf_greedy_fp8_kv(hf_model, prompt, MAX_NEW)
