"""Running the model on more than one process: the tensor-parallel executor.

upstream: vllm/v1/executor/
"""
