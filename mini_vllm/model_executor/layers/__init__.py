"""Layers split over the tensor-parallel group.

upstream: vllm/model_executor/layers/
"""
