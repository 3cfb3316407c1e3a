"""Ways in: ``llm.LLM`` (Python, offline), the OpenAI-compatible HTTP server (``openai/``), and
beam search on top of ``LLM`` (``beam_search``).

upstream: vllm/entrypoints/
"""
