"""Lab 01-01 solution: the reference lives once in mini_vllm.attention.reference; re-export it."""

from __future__ import annotations

from mini_vllm.attention.reference import (
    alibi_bias,
    attention_scores,
    causal_mask,
    ref_attention,
    ref_varlen_attention,
    repeat_kv,
)

__all__ = [
    "causal_mask",
    "alibi_bias",
    "repeat_kv",
    "attention_scores",
    "ref_attention",
    "ref_varlen_attention",
]
