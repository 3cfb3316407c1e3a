"""Ways in: ``llm.LLM`` (Python, offline), the OpenAI-compatible HTTP server (``openai/``), and
beam search on top of ``LLM`` (``beam_search``); beyond one engine, a prefill engine and a
decode engine joined by a KV connector (``disagg``) and several engines behind a cache-aware
router (``router``).

upstream: vllm/entrypoints/
"""
