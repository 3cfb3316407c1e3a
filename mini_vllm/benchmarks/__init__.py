"""Serving benchmarks of mini_vllm, in the shape of upstream's ``vllm/benchmarks/`` package
(``vllm bench serve`` is ``vllm/benchmarks/serve.py`` there): a synthetic dataset
(:mod:`.datasets`) and the load generator with its metrics (:mod:`.serve`).

upstream: vllm/benchmarks/
"""
