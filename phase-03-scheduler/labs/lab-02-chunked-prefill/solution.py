"""Lab 03-02 solution: the reference code lives in ``mini_vllm.attention.metadata`` and
``mini_vllm.attention.chunked_prefill``."""

from __future__ import annotations

from mini_vllm.attention.chunked_prefill import chunked_prefill_attention, gather_paged_kv
from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    compute_query_start_loc,
    compute_slot_mapping,
    make_block_table_tensor,
    reorder_batch_to_split_decodes_and_prefills,
)

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "chunked_prefill_attention",
    "compute_query_start_loc",
    "compute_slot_mapping",
    "gather_paged_kv",
    "make_block_table_tensor",
    "reorder_batch_to_split_decodes_and_prefills",
]
