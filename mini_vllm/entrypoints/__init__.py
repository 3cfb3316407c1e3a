"""Ways to use mini_vllm from outside Python: the OpenAI-compatible HTTP server (``openai/``).

upstream: none (a package that only holds the server; vLLM's entrypoints/ holds several)
"""
