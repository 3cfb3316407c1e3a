"""Disaggregated prefill: one engine computes prompts, another generates, and the prompt's KV
moves between them through a KV connector (lab 04-06).

Each request goes first to the prefill engine with ``max_tokens=1`` (its prompt's full blocks
are saved to the store as they are computed), then to the decode engine with the caller's
parameters; the decode engine loads the blocks the store holds and computes only the prompt's
last, partial block before it generates. Each engine is an :class:`~mini_vllm.engine.async_llm.
AsyncLLM` with its engine core in a process of its own, so a long prompt being prefilled never
shares a step with the decode engine's running requests: the interference that disaggregation
removes (``benchmarks/disaggregated_prefill.py`` measures it).

    async with DisaggregatedLLM(kv_transport="tcp", num_gpu_blocks=256) as pair:
        async for out in pair.generate("To be, or not", SamplingParams(max_tokens=16)):
            ...

upstream: none (course-only; vLLM runs the two engines as two ``vllm serve`` processes with
``--kv-transfer-config`` behind a proxy: examples/online_serving/disaggregated_serving/ @ v0.33.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

from mini_vllm.config import KVTransferConfig
from mini_vllm.distributed.kv_transfer import remove_shm_segments
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

__all__ = ["DisaggregatedLLM", "free_tcp_port"]


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the producer binds it a moment later).

    upstream: none (upstream's examples pass fixed ports on the command line)
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DisaggregatedLLM:
    """A prefill engine and a decode engine joined by a KV connector (module docstring).

    ``kv_transport``: ``"shm"`` or ``"tcp"`` (see :class:`~mini_vllm.config.KVTransferConfig`);
    ``kv_store``: the segment prefix or ``host:port`` (default: a fresh one). ``llm_kwargs`` go
    to both engines' ``LLM``; ``prefill_kwargs`` / ``decode_kwargs`` to one only.

    Invariants: with greedy sampling, every request's tokens equal one engine's; after
    :meth:`shutdown` (also on an exception in ``async with``, and when the object is collected)
    neither engine's process and no segment of the store is left.

    upstream: none (see the module docstring)
    """

    def __init__(self, model: Any = None, *, kv_transport: str = "shm", kv_store: str | None = None,
                 prefill_kwargs: dict | None = None, decode_kwargs: dict | None = None,
                 step_timeout_s: float | None = 60.0, **llm_kwargs: Any) -> None:
        if kv_store is None:
            kv_store = (f"127.0.0.1:{free_tcp_port()}" if kv_transport == "tcp"
                        else f"mini_vllm_kv_{os.getpid()}_{secrets.token_hex(4)}")
        self.kv_store = kv_store
        self._ids = itertools.count()
        self.prefill: AsyncLLM | None = None
        self.decode: AsyncLLM | None = None
        # The sweep that holds even if a core process was killed before closing its store.
        self._sweep = weakref.finalize(self, remove_shm_segments,
                                       kv_store if kv_transport == "shm" else "")
        try:
            for role, extra in (("kv_producer", prefill_kwargs), ("kv_consumer", decode_kwargs)):
                config = KVTransferConfig(kv_role=role, kv_transport=kv_transport,
                                          kv_store=kv_store)
                llm = LLM(model, **{**llm_kwargs, **(extra or {})}, kv_transfer_config=config)
                engine = AsyncLLM(llm, multiprocessing=True, step_timeout_s=step_timeout_s)
                if role == "kv_producer":
                    self.prefill = engine
                else:
                    self.decode = engine
        except BaseException:
            self.shutdown()
            raise

    @property
    def tokenizer(self) -> Any:
        return self.decode.tokenizer

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Prefill on one engine, then stream the decode engine's output (as
        :meth:`AsyncLLM.generate <mini_vllm.engine.async_llm.AsyncLLM.generate>` does).

        upstream: none (the proxy's two requests in upstream's disaggregated serving examples)
        """
        request_id = request_id or f"disagg-{next(self._ids)}-{secrets.token_hex(4)}"
        prefill_params = dataclasses.replace(sampling_params, max_tokens=1, n=1,
                                             min_tokens=0, logprobs=None, prompt_logprobs=None)
        async for _ in self.prefill.generate(prompt, prefill_params, f"{request_id}-prefill"):
            pass
        async for out in self.decode.generate(prompt, sampling_params, request_id):
            yield out

    def shutdown(self) -> None:
        """Stop both engines and remove the store's segments. Safe to call twice."""
        for engine in (self.decode, self.prefill):
            if engine is not None:
                engine.shutdown()
        self._sweep()

    async def __aenter__(self) -> DisaggregatedLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
