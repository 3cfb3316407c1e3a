"""The model and its weights: ``models/`` holds the network, ``model_loader/`` reads checkpoints
(safetensors, GGUF) into it.

upstream: vllm/model_executor/
"""
