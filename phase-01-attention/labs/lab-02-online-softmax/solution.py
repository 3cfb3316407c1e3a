"""Lab 01-02 solution: the reference lives once in mini_vllm.attention.online_softmax."""

from __future__ import annotations

from mini_vllm.attention.online_softmax import (
    Partial,
    SoftmaxState,
    blockwise_attention,
    finalize,
    merge_partials,
    online_update,
    reduce_partials,
    split_kv_attention,
)

__all__ = [
    "SoftmaxState",
    "Partial",
    "online_update",
    "finalize",
    "merge_partials",
    "reduce_partials",
    "blockwise_attention",
    "split_kv_attention",
]
