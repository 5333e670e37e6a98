"""Models against Hugging Face: prefill, decode and chunked prefill over the paged cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from replica.attention import AttentionMetadata, TorchAttention
from replica.models import PRESETS, load_model, load_model_config, load_tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_BLOCKS_PER_SEQ = 8
VOCAB = 128
ATOL = 1e-4

_LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_gpt2() -> PreTrainedModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _hf_llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**_LLAMA_SHAPE, tie_word_embeddings=False))


def _hf_llama3_rope() -> PreTrainedModel:
    config = LlamaConfig(**_LLAMA_SHAPE, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _hf_qwen2() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**_LLAMA_SHAPE, tie_word_embeddings=False))


def _hf_qwen3() -> PreTrainedModel:
    # head_dim 32 != hidden_size / num_heads: the explicit head_dim must be honoured.
    config = Qwen3Config(**_LLAMA_SHAPE, head_dim=32, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config)


HF_BUILDERS = {
    "gpt2": _hf_gpt2,
    "llama": _hf_llama,
    "llama3-rope": _hf_llama3_rope,
    "qwen2": _hf_qwen2,
    "qwen3": _hf_qwen3,
}


def _randomise(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Perturb every parameter (norm weights and biases too) so a mis-loaded one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(HF_BUILDERS))
def checkpoint(request, tmp_path_factory) -> tuple[PreTrainedModel, str]:
    """(HF model, save_pretrained dir); the llama checkpoint is sharded."""
    torch.manual_seed(0)
    hf = _randomise(HF_BUILDERS[request.param](), seed=1)
    path = tmp_path_factory.mktemp(request.param)
    shard = "40KB" if request.param == "llama" else "1GB"
    hf.save_pretrained(path, max_shard_size=shard)
    return hf, str(path)


def _load(model: str, seed: int = 0):
    return load_model(model, torch.float32, torch.device("cpu"), seed, TorchAttention())


def _kv_cache(config) -> torch.Tensor:
    shape = (config.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    return torch.full(shape, float("nan"))  # poisoned: reading an unwritten slot shows


def _block_table(num_rows: int) -> torch.Tensor:
    """Distinct, non-contiguous blocks per row: row r owns blocks r, r + rows, r + 2*rows, ..."""
    table = torch.arange(num_rows * MAX_BLOCKS_PER_SEQ, dtype=torch.int32)
    return table.view(MAX_BLOCKS_PER_SEQ, num_rows).t().contiguous()


def prefill_meta(
    block_table: torch.Tensor, chunks: list[tuple[int, int, int]]
) -> AttentionMetadata:
    """chunks: (table row, start position, chunk length), packed in this order."""
    lens = [n for _, _, n in chunks]
    positions = torch.cat([torch.arange(s, s + n) for _, s, n in chunks])
    return AttentionMetadata(
        is_decode=False,
        block_table=block_table,
        slot_mapping=torch.tensor([r for r, _, _ in chunks], dtype=torch.int32),
        context_lens=torch.tensor([s + n for _, s, n in chunks], dtype=torch.int32),
        positions=positions,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        start_positions=torch.tensor([s for _, s, _ in chunks], dtype=torch.int32),
        max_q_len=max(lens),
    )


def decode_meta(
    block_table: torch.Tensor, rows: list[int], positions: list[int]
) -> AttentionMetadata:
    """int32 positions, as the GPU runner's persistent buffers hold them."""
    return AttentionMetadata(
        is_decode=True,
        block_table=block_table,
        slot_mapping=torch.tensor(rows, dtype=torch.int32),
        context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int32),
    )


def _run(model, ids: list[int], meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor(ids, dtype=meta.positions.dtype)
    with torch.no_grad():
        hidden = model(input_ids, meta.positions, kv_cache, meta)
        return model.compute_logits(hidden)  # [T, vocab]


def _hf_logits(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def test_prefill_then_decode_matches_hf(checkpoint) -> None:
    hf, path = checkpoint
    model, config = _load(path)
    assert config.vocab_size == VOCAB
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    rows = [2, 0, 1]  # table rows deliberately not in batch order
    table = _block_table(3)
    kv_cache = _kv_cache(config)

    meta = prefill_meta(table, [(r, 0, len(p)) for r, p in zip(rows, prompts)])
    logits = _run(model, sum(prompts, []), meta, kv_cache)
    offset = 0
    for prompt in prompts:
        ours = logits[offset : offset + len(prompt)]
        torch.testing.assert_close(ours, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
        offset += len(prompt)

    seqs = [list(p) for p in prompts]
    last = logits[meta.cu_seqlens_q[1:].long() - 1]
    for _ in range(4):
        for seq, row_logits in zip(seqs, last):
            seq.append(int(row_logits.argmax()))
        positions = [len(s) - 1 for s in seqs]
        meta = decode_meta(table, rows, positions)
        last = _run(model, [s[-1] for s in seqs], meta, kv_cache)
        for seq, ours in zip(seqs, last):
            expected = _hf_logits(hf, seq)[-1]
            torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
            assert int(ours.argmax()) == int(expected.argmax())


def test_chunked_prefill_matches_hf(checkpoint) -> None:
    hf, path = checkpoint
    model, config = _load(path)
    gen = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(0, VOCAB, (13,), generator=gen).tolist()
    short_prompt = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
    table = _block_table(2)
    kv_cache = _kv_cache(config)
    first = 6  # not a multiple of BLOCK_SIZE: the second chunk starts mid-block

    meta = prefill_meta(table, [(1, 0, first)])
    logits_1 = _run(model, long_prompt[:first], meta, kv_cache)
    # Second chunk packed together with a fresh prompt of another sequence.
    meta = prefill_meta(table, [(0, 0, len(short_prompt)), (1, first, len(long_prompt) - first)])
    logits_2 = _run(model, short_prompt + long_prompt[first:], meta, kv_cache)

    expected_long = _hf_logits(hf, long_prompt)
    torch.testing.assert_close(logits_1, expected_long[:first], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        logits_2[len(short_prompt) :], expected_long[first:], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        logits_2[: len(short_prompt)], _hf_logits(hf, short_prompt), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen3-tiny"])
def test_preset_runs_and_is_seeded(preset: str) -> None:
    model, config = _load(preset, seed=7)
    table = _block_table(1)
    ids = [1, 2, 3, 4, 5]
    meta = prefill_meta(table, [(0, 0, len(ids))])
    kv_cache = torch.zeros(
        config.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim
    )
    logits = _run(model, ids, meta, kv_cache)
    assert logits.shape == (len(ids), config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert logits.std() > 0

    same, _ = _load(preset, seed=7)
    other, _ = _load(preset, seed=8)
    for (name, p), q, r in zip(
        model.state_dict().items(), same.state_dict().values(), other.state_dict().values()
    ):
        assert torch.equal(p, q), name
        if "norm" not in name and "ln_" not in name and not name.endswith("bias"):
            assert not torch.equal(p, r), name


def test_preset_configs() -> None:
    assert set(PRESETS) >= {"gpt2", "gpt2-tiny", "llama-tiny", "qwen3-tiny", "qwen3-0.6b"}
    gpt2 = load_model_config("gpt2")
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.num_heads, gpt2.vocab_size) == (
        12, 768, 12, 50257,
    )  # fmt: skip
    assert gpt2.eos_token_id == 50256 and gpt2.max_position_embeddings == 1024
    qwen = load_model_config("qwen3-0.6b")
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (28, 16, 8, 128)
    assert qwen.eos_token_id == 151645 and qwen.tie_word_embeddings and qwen.qk_norm
    assert qwen.rope is not None and qwen.rope.theta == 1e6
    assert qwen.kv_bytes_per_token(torch.bfloat16) == 2 * 28 * 8 * 128 * 2
    assert load_tokenizer("gpt2-tiny") is None


@pytest.mark.parametrize("name", ["no-such-preset", "/no/such/dir"])
def test_bad_model_name_raises(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        load_model_config(name)
    with pytest.raises(ValueError, match=name):
        _load(name)


def _save_tiny_llama(path: Path, **overrides) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**_LLAMA_SHAPE, **overrides})).save_pretrained(path)


def test_missing_weight_raises(tmp_path: Path) -> None:
    _save_tiny_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight") as err:
        _load(str(tmp_path))
    assert "model.extra.weight" in str(err.value)


def test_unsupported_checkpoints_raise(tmp_path: Path) -> None:
    _save_tiny_llama(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        load_model_config(str(tmp_path / "yarn"))

    _save_tiny_llama(tmp_path / "arch")
    config_path = tmp_path / "arch" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model_config(str(tmp_path / "arch"))
    assert load_tokenizer(str(tmp_path / "arch")) is None


def test_load_tokenizer_from_directory(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer is not None
    assert tokenizer("hello world")["input_ids"] == [1, 2]
