"""One GPU's serving engine: block manager, scheduler, model runner, models, sampler."""

from replica.config import CacheConfig, EngineConfig, SchedulerConfig
from replica.engine import LLMEngine
from replica.outputs import CompletionOutput, RequestOutput, StepOutputs
from replica.protocol import ServingEngine
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ReplicaStats",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "ServingEngine",
    "StepOutputs",
]
