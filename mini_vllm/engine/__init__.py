"""The engine around the core: ``core.EngineCore`` steps a scheduler and a runner; ``async_llm``
serves requests that arrive at any time; ``output_processor``, ``detokenizer`` and ``logprobs``
turn each step's token ids into what a client reads; ``parallel_sampling`` makes the ``n``
children of a request.

upstream: vllm/v1/engine/
"""
