"""Build a model from a preset (seeded random weights) or a save_pretrained directory.

Parameters are created on the meta device and materialised once on the target
device in the target dtype, so a large model is never built twice or on the
host first; checkpoint tensors are read by safetensors straight to the device.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from replica.attention import AttentionBackend
from replica.models.config import ModelConfig, is_preset, load_model_config
from replica.models.gpt2 import GPT2LMHeadModel
from replica.models.layers import RMSNorm, use_triton_linear
from replica.models.llama import LlamaForCausalLM
from replica.options import EngineOptions

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
INIT_STD = 0.02  # HF's default initializer_range
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    backend: AttentionBackend,
    fused: bool | None = None,
    triton_linear: bool = True,
    options: EngineOptions | None = None,  # None: EngineOptions()
) -> tuple[nn.Module, ModelConfig]:
    """Preset -> seeded random weights; directory -> its safetensors weights.

    fused (default: on CUDA) runs norms, RoPE and activations as fused Triton
    kernels over concatenated projections; otherwise HF's exact torch ops.
    triton_linear (fused path, fp16 / bf16 only) runs GPT-2's small-batch
    projections as kernels.linear where its tile table beats cuBLAS.
    options: the fused path's launch modes and fusions (pdl, fold_norms, fuse_silu).

    Raises ValueError for an unknown name, an unsupported architecture, a
    directory without safetensors, and missing, unexpected or misshapen weights.
    """
    config = load_model_config(model)
    options = options or EngineOptions()
    device = torch.device(device)
    fused = device.type == "cuda" if fused is None else fused
    module = build_model(config, backend, dtype, device, fused, options)
    if fused and triton_linear and dtype in (torch.float16, torch.bfloat16):
        use_triton_linear(module, pdl=options.pdl)
    if is_preset(model):
        init_random_weights(module, seed)
    else:
        load_checkpoint_weights(module, model)
    module = module.eval().requires_grad_(False)
    with torch.no_grad():
        module.finalize()
    return module, config


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    fused: bool = False,
    options: EngineOptions | None = None,  # None: EngineOptions()
) -> nn.Module:
    """The model with uninitialised parameters on `device` in `dtype`."""
    with torch.device("meta"):
        module = MODEL_CLASSES[config.architecture](config, backend, dtype, device, fused, options)
    return module.to(dtype=dtype).to_empty(device=device)


@torch.no_grad()
def init_random_weights(module: nn.Module, seed: int) -> None:
    """Norms to ones, biases to zeros, every other weight ~ N(0, INIT_STD), seeded.

    Deterministic for a given (seed, device type): CPU and CUDA generators differ.
    """
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for submodule in module.modules():
        is_norm = isinstance(submodule, nn.LayerNorm | RMSNorm)
        for name, param in submodule.named_parameters(recurse=False):
            if name == "bias":
                param.zero_()
            elif is_norm:
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)


@torch.no_grad()
def load_checkpoint_weights(module: nn.Module, model_dir: str) -> None:
    params = dict(module.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for hf_name in f.keys():
                name = module.checkpoint_name(hf_name)
                if name is None:
                    continue
                if name not in params:
                    unexpected.append(hf_name)
                    continue
                _copy_weight(params[name], f.get_tensor(hf_name), hf_name)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir!r} does not match the model: "
            f"missing weights {missing}, unexpected weights {sorted(unexpected)}"
        )


def _copy_weight(param: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(tensor)


def _safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors weights")
    return [os.path.join(model_dir, n) for n in files]


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The directory's AutoTokenizer when it has tokenizer files; None for presets."""
    if is_preset(model):
        return None
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a preset nor a directory")
    if not any(os.path.isfile(os.path.join(model, n)) for n in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model)
