"""Frozen, validated configs for one replica: engine, cache and scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from replica.config_flags import from_mapping
from replica.options import EngineOptions
from replica.validate import (
    is_bool,
    is_int,
    non_empty_str,
    non_negative_int,
    number_in,
    one_of,
    positive_float,
    positive_int,
)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    max_blocks_per_seq: int = 0

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        positive_int("num_blocks", self.num_blocks)
        positive_int("max_blocks_per_seq", self.max_blocks_per_seq)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # prefill tokens (plus decodes) per step

    def __post_init__(self) -> None:
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_model_len", self.max_model_len)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica needs; the user-facing knob set.

    Each field documents itself (metadata["help"]): those texts are the flags' help
    (replica.config_flags) of every CLI that builds an engine. from_dict takes a YAML-like
    mapping, with `options` flat (`pdl: false`) or as a mapping of its own.
    """

    model: str = field(
        default="gpt2-tiny",
        metadata={
            "help": "a Hugging Face save_pretrained directory (config.json + safetensors) or "
            "a preset name with seeded random weights (replica.models.PRESETS: gpt2, "
            "gpt2-tiny, llama-tiny, ...)"
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "auto: cuda when a CUDA device is available, else cpu",
            "choices": DEVICES,
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights' and activations' dtype; auto: float32 on CPU, on CUDA the "
            "checkpoint's half type (float16 if it is one, else bfloat16)",
            "choices": DTYPES,
        },
    )
    block_size: int = field(
        default=16, metadata={"help": "tokens per KV-cache block", "choices": BLOCK_SIZES}
    )
    num_blocks: int | None = field(
        default=None,
        metadata={
            "help": "KV-cache blocks; none: sized from free device memory "
            "(gpu_memory_utilization on CUDA, cpu_kv_cache_gb on CPU)"
        },
    )
    max_num_seqs: int = field(
        default=256, metadata={"help": "sequences running at once (a decode step's batch at most)"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "longest prompt plus output, in tokens; none: the model's own limit"},
    )
    max_num_batched_tokens: int = field(
        default=8192,
        metadata={"help": "prompt tokens (plus the decodes) one step may run: the prefill chunk"},
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "reuse the KV blocks of a prompt prefix that is already cached"},
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seeds a preset model's random weights and sampling of requests without "
            "a seed of their own"
        },
    )
    prefix_salt: str = field(
        default="",
        repr=False,
        metadata={
            "help": "mixed into every prefix-cache block hash (replica.hashing.root_hash), so "
            "hashes cannot be computed from a guessed prompt outside the deployment; the "
            "router must hash with the same salt (a cluster sets both). A cluster app "
            "draws a random one when this is empty (cluster.app.build_app)"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.85,
        metadata={
            "help": "fraction of the GPU's memory the engine may fill (weights, activations, "
            "KV cache); with num_blocks none, the KV cache takes what is left of it"
        },
    )
    cpu_kv_cache_gb: float = field(
        default=1.0, metadata={"help": "GiB of KV cache on CPU when num_blocks is none"}
    )
    enable_cuda_graphs: bool = field(
        default=True,
        metadata={"help": "on CUDA, decode steps replay CUDA graphs captured per batch bucket"},
    )
    enable_triton_linear: bool = field(
        default=True,
        metadata={
            "help": "on CUDA in float16 / bfloat16, small-batch projections run kernels.linear "
            "(fused bias and activation) where it beats cuBLAS"
        },
    )
    mixed_prefill_tokens: int = field(
        default=32,
        metadata={
            "help": "a step whose prompt chunks total at most this many tokens runs them as "
            "extra rows of its decode forward (one pass over the weights, SGLang's mixed "
            "chunk) instead of a prefill forward before the decode; 0 keeps them apart"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto: K/V in the model's dtype; fp8 (or fp8_e4m3): float8 e4m3 with no "
            "scale (rounded to nearest, saturated at +-448; kernels.kv_quant), half a "
            "block's bytes, so twice the blocks in the same memory and half the bytes a "
            "decode step's attention reads. On CUDA it needs compute capability 8.9+ "
            "(Ada, Hopper)",
            "choices": KV_CACHE_DTYPES,
        },
    )
    replica_id: str = field(
        default="replica-0",
        metadata={"help": "this engine's name in its ReplicaStats (a cluster sets one a replica)"},
    )
    max_prefix_hashes_in_stats: int = field(
        default=2048,
        metadata={
            "help": "most cached-prefix block hashes one ReplicaStats carries, for prefix "
            "routing (bounds a snapshot's size and the walk that builds it)"
        },
    )
    options: EngineOptions = field(
        default_factory=EngineOptions,
        metadata={"help": "the GPU path's fusions and launch modes (replica.options)"},
    )

    def __post_init__(self) -> None:
        non_empty_str("model", self.model)
        one_of("device", self.device, DEVICES)
        one_of("dtype", self.dtype, DTYPES)
        one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        one_of("block_size", self.block_size, BLOCK_SIZES)
        positive_int("num_blocks", self.num_blocks, allow_none=True)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        is_int("seed", self.seed)
        if not isinstance(self.prefix_salt, str):
            raise ValueError("prefix_salt must be a string")  # never echo a salt
        number_in("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        positive_float("cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        positive_int("max_prefix_hashes_in_stats", self.max_prefix_hashes_in_stats)
        non_negative_int("mixed_prefill_tokens", self.mixed_prefill_tokens)
        for name in ("enable_prefix_caching", "enable_cuda_graphs", "enable_triton_linear"):
            is_bool(name, getattr(self, name))
        non_empty_str("replica_id", self.replica_id)
        if not isinstance(self.options, EngineOptions):
            raise ValueError(f"options must be an EngineOptions, got {self.options!r}")

    @classmethod
    def from_dict(cls, data: Mapping) -> EngineConfig:
        """From a YAML/JSON-like mapping; an unknown key raises ValueError naming it."""
        return from_mapping(cls, data)
