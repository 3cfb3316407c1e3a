"""Attention for mini_vllm: the reference (phase 01) and PagedAttention (phase 02)."""
