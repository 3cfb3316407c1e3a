"""What the engine counts (``stats``) and how a server reports it (``loggers``: Prometheus text).

upstream: vllm/v1/metrics/
"""
