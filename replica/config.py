"""Frozen, validated configs for one replica: engine, cache and scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.options import EngineOptions

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_BLOCK_SIZES = (8, 16, 32, 64, 128)


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    max_blocks_per_seq: int = 0

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        _positive_int("num_blocks", self.num_blocks)
        _positive_int("max_blocks_per_seq", self.max_blocks_per_seq)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # prefill tokens (plus decodes) per step

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica needs; the user-facing knob set.

    model: a `save_pretrained` directory or a preset name (replica.models.PRESETS).
    num_blocks None sizes the KV pool from free device memory
    (gpu_memory_utilization on CUDA; cpu_kv_cache_gb on CPU).
    max_model_len None takes the model's own limit.
    enable_triton_linear: on CUDA in fp16 / bf16, small-batch projections run
    kernels.linear (fused bias and activation) where it beats cuBLAS.
    mixed_prefill_tokens: a step whose prompt chunks total at most this many
    tokens runs them as extra rows of its decode forward (one pass over the
    weights, SGLang's mixed chunk) instead of a prefill forward before the
    decode; 0 keeps prefill and decode apart.
    kv_cache_dtype: "auto" stores K/V in the model's dtype; "fp8" (or "fp8_e4m3")
    stores them as float8 e4m3 with no scale (rounded to nearest, saturated at
    +-448; kernels.kv_quant), which halves a block's bytes: twice the blocks in the
    same memory, and half the bytes a decode step's attention reads. On CUDA it
    needs compute capability 8.9 or later (Ada, Hopper).
    """

    model: str = "gpt2-tiny"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    enable_cuda_graphs: bool = True
    enable_triton_linear: bool = True
    mixed_prefill_tokens: int = 32
    kv_cache_dtype: str = "auto"
    replica_id: str = "replica-0"
    max_prefix_hashes_in_stats: int = 2048
    options: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size not in _BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {_BLOCK_SIZES}, got {self.block_size!r}")
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not self.cpu_kv_cache_gb > 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb!r}")
        _positive_int("max_prefix_hashes_in_stats", self.max_prefix_hashes_in_stats)
        m = self.mixed_prefill_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"mixed_prefill_tokens must be an integer >= 0, got {m!r}")
        for name in ("enable_prefix_caching", "enable_cuda_graphs", "enable_triton_linear"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.options, EngineOptions):
            raise ValueError(f"options must be an EngineOptions, got {self.options!r}")
