"""The engine around the core: ``core.EngineCore`` steps a scheduler and a runner; ``async_llm``
serves requests that arrive at any time, through a client (``core_client``) of the core's busy
loop (``core_proc``), which runs in a process of its own and speaks ``messages`` encoded by
``serial_utils``; ``output_processor``, ``detokenizer`` and ``logprobs`` turn each step's token
ids into what a client reads; ``parallel_sampling`` makes the ``n`` children of a request.

upstream: vllm/v1/engine/
"""
