"""The KV cache's bookkeeping: the block pool, the prefix-cache hash chain, each request's block
table (``kv_cache_manager``), and the scheduler that spends them (``sched/``).

``block_sharing`` (fork and copy-on-write) and ``swap`` (a CPU block pool for preemption by
swapping) are V0's mechanisms, which v1 dropped; the course builds them to compare.

Nothing here imports the engine, the worker or the model: the core decides, others compute.

upstream: vllm/v1/core/ (V0: vllm/core/block/ and vllm/core/block_manager.py @ v0.10.2)
"""
