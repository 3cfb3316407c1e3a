"""Lab 04-05 solution: the reference lives in ``mini_vllm.model_executor.model_loader.tp_loader``
(the head split and the cut), ``mini_vllm.model_executor.layers.linear`` (the linear layers) and
``mini_vllm.model_executor.layers.vocab_parallel_embedding`` (the vocabulary split)."""

from __future__ import annotations

from mini_vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from mini_vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_range,
)
from mini_vllm.model_executor.model_loader.tp_loader import (
    check_tp_size,
    head_ranges,
    shard_model,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "check_tp_size",
    "head_ranges",
    "shard_model",
    "vocab_range",
]
