"""Leaving one process: the tensor-parallel group and its collectives.

upstream: vllm/distributed/
"""
