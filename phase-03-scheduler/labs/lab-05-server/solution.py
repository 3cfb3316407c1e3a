"""Lab 03-05 reference: re-exports the server's pieces.

The code lives once, in ``mini_vllm`` (``detokenizer.py``, ``async_llm.py`` and
``entrypoints/openai/serving_completion.py``).
"""

from __future__ import annotations

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from mini_vllm.entrypoints.openai.protocol import CompletionRequest
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.openai.serving_engine import engine_error_event, sse_event, usage
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "REPLACEMENT_CHAR",
    "AsyncLLM",
    "CompletionOutput",
    "CompletionRequest",
    "IncrementalDetokenizer",
    "OpenAIServingCompletion",
    "RequestOutput",
    "SamplingParams",
    "engine_error_event",
    "sse_event",
    "usage",
]
