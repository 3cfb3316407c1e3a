"""Reading a model from disk: ``loader`` resolves what ``LLM(model=...)`` names, ``hf_loader``
reads safetensors checkpoints (mini_vllm's and Hugging Face's), ``gguf_loader`` llama.cpp's GGUF
files.

upstream: vllm/model_executor/model_loader/
"""
