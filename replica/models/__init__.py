"""Models in plain torch over the paged KV cache, and their loaders."""

from replica.models.base import CausalLM
from replica.models.config import ModelConfig, load_model_config
from replica.models.loader import load_model, load_tokenizer
from replica.models.presets import PRESETS

__all__ = [
    "PRESETS",
    "CausalLM",
    "ModelConfig",
    "load_model",
    "load_model_config",
    "load_tokenizer",
]
