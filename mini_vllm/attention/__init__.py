"""Attention for mini_vllm: the reference (phase 01), PagedAttention (phase 02) and the backend
the model runner plugs into every layer.

upstream: vllm/v1/attention/ (vllm/attention/ at v0.11.0)
"""
