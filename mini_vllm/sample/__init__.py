"""Sampling: one next token per request from one row of logits each.

upstream: vllm/v1/sample/
"""
