"""ModelConfig: the shape and numerics of one model, read from a checkpoint or a preset.

`load_model_config` parses the Hugging Face config through `transformers` (so
legacy keys such as top-level `rope_theta`/`rope_scaling` are normalised the way
HF normalises them) and keeps only what the models here implement. Anything the
models would silently get wrong (sliding windows, unknown RoPE scaling, GPT-2
layer-index scaling) raises ValueError instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from replica.models.presets import PRESETS

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    intermediate_size: int
    norm_eps: float
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope: RopeConfig | None = None  # None for learned positions (GPT-2)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def is_preset(model: str) -> bool:
    return model in PRESETS


def load_model_config(model: str) -> ModelConfig:
    """Preset name or save_pretrained directory -> ModelConfig; ValueError otherwise."""
    return model_config_from_hf(load_hf_config(model))


def load_hf_config(model: str) -> PretrainedConfig:
    if is_preset(model):
        preset = dict(PRESETS[model])
        return CONFIG_MAPPING[preset.pop("model_type")](**preset)
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    return AutoConfig.from_pretrained(model)


def model_config_from_hf(hf: PretrainedConfig) -> ModelConfig:
    architectures = hf.architectures or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architectures {architectures}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch == "GPT2LMHeadModel":
        return _gpt2_config(hf)
    return _llama_family_config(hf, arch)


def _eos_fields(hf: PretrainedConfig) -> dict:
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return {"eos_token_id": eos_ids[0] if eos_ids else None, "eos_token_ids": eos_ids}


def _dtype_name(hf: PretrainedConfig) -> str | None:
    dtype = getattr(hf, "dtype", None)
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _gpt2_config(hf: PretrainedConfig) -> ModelConfig:
    if hf.scale_attn_by_inverse_layer_idx or not hf.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than head_dim**-0.5 is not supported")
    if hf.add_cross_attention:
        raise ValueError("GPT-2 cross attention is not supported")
    if hf.activation_function != "gelu_new":
        raise ValueError(f"GPT-2 activation {hf.activation_function!r} is not supported")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=hf.vocab_size,
        hidden_size=hf.n_embd,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        num_kv_heads=hf.n_head,
        head_dim=hf.n_embd // hf.n_head,
        max_position_embeddings=hf.n_positions,
        intermediate_size=hf.n_inner if hf.n_inner is not None else 4 * hf.n_embd,
        norm_eps=hf.layer_norm_epsilon,
        torch_dtype=_dtype_name(hf),
        tie_word_embeddings=True,
        qkv_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        **_eos_fields(hf),
    )


def _llama_family_config(hf: PretrainedConfig, arch: str) -> ModelConfig:
    if hf.hidden_act != "silu":
        raise ValueError(f"{arch} activation {hf.hidden_act!r} is not supported")
    layer_types = getattr(hf, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{arch} sliding-window attention is not supported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attention_bias = getattr(hf, "attention_bias", False)
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        intermediate_size=hf.intermediate_size,
        norm_eps=hf.rms_norm_eps,
        torch_dtype=_dtype_name(hf),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_proj_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        rope=_rope_config(hf),
        **_eos_fields(hf),
    )


def _rope_config(hf: PretrainedConfig) -> RopeConfig:
    params = dict(hf.rope_parameters or {})
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling: dict = {}
    if rope_type in ("linear", "llama3"):
        scaling["factor"] = float(params["factor"])
    if rope_type == "llama3":
        scaling["low_freq_factor"] = float(params["low_freq_factor"])
        scaling["high_freq_factor"] = float(params["high_freq_factor"])
        scaling["original_max_position_embeddings"] = int(
            params["original_max_position_embeddings"]
        )
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type, **scaling)
