"""The OpenAI-compatible HTTP server: ``python -m mini_vllm serve``.

``protocol`` (the request and response shapes), ``serving_engine`` (what both endpoints share),
``serving_completion`` (``/v1/completions``), ``serving_chat`` (``/v1/chat/completions``) and
``api_server`` (the FastAPI app, the routes, ``/health``, ``/metrics``, running uvicorn).

upstream: vllm/entrypoints/openai/api_server.py:1511 @ v0.11.0
"""
