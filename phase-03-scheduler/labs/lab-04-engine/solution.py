"""Lab 03-04 reference: re-exports the engine step loop, the model runner's step and the beam
search step.

The code lives once, in ``mini_vllm`` (``model_runner.py``, ``llm.py`` and ``beam_search.py``).
"""

from __future__ import annotations

from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from mini_vllm.engine.core import EngineCore
from mini_vllm.entrypoints.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
    create_sort_beams_key_function,
    expand_beams,
    finish_beams,
    get_beam_search_score,
)
from mini_vllm.logprobs import Logprob
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.sample.sampler import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.model_runner import CachedRequestState, ModelRunner

__all__ = [
    "AttentionMetadata",
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CachedRequestData",
    "CachedRequestState",
    "EngineCore",
    "Logprob",
    "ModelRunner",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingMetadata",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "build_attention_metadata",
    "create_sort_beams_key_function",
    "expand_beams",
    "finish_beams",
    "get_beam_search_score",
    "reorder_batch_to_split_decodes_and_prefills",
]
