"""Tokenizers: the shipped model's byte-level one and Hugging Face ``tokenizer.json`` files
(``tokenizer``).

upstream: vllm/tokenizers/ (vllm/transformers_utils/tokenizer.py @ v0.11.0)
"""
