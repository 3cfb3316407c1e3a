"""The networks mini_vllm runs: one Llama-style decoder (``llama``; Qwen2 is Llama with q/k/v
biases).

upstream: vllm/model_executor/models/
"""
