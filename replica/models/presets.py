"""Built-in model presets: Hugging Face config dicts, loaded with seeded random weights.

No machine here can download from a hub, so a preset gives a real architecture
and shape (for tests and benchmarks) without a checkpoint.
"""

from __future__ import annotations

from typing import Any

_GPT2_124M: dict[str, Any] = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "tie_word_embeddings": True,
}

_LLAMA_TINY: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

_QWEN3_0_6B: dict[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": _GPT2_124M,
    "gpt2-tiny": {
        **_GPT2_124M,
        "vocab_size": 512,
        "n_positions": 512,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "bos_token_id": 511,
        "eos_token_id": 511,
    },
    "llama-tiny": _LLAMA_TINY,
    "qwen3-tiny": {
        **_LLAMA_TINY,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": _QWEN3_0_6B,
}
