"""Helpers that belong to no one layer: ``huge_pages`` moves tensors onto 2 MB pages.

upstream: vllm/utils/
"""
