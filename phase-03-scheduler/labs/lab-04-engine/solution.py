"""Lab 03-04 reference: re-exports the engine step loop and the model runner's step.

The code lives once, in ``mini_vllm`` (``model_runner.py`` and ``llm.py``).
"""

from __future__ import annotations

from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.config import SchedulerConfig
from mini_vllm.llm import EngineCore
from mini_vllm.model_runner import CachedRequestState, ModelRunner
from mini_vllm.sampler import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "AttentionMetadata",
    "CachedRequestData",
    "CachedRequestState",
    "EngineCore",
    "ModelRunner",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingMetadata",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "build_attention_metadata",
    "reorder_batch_to_split_decodes_and_prefills",
]
