"""AsyncLLM's output loop: a generate that never starts it fails at once and names the call.

What a student who forgets ``self._run_output_handler()`` in lab 03-05's ``AsyncLLM.generate``
sees: the request is queued, nothing ever steps it, and the collector's ``get`` says why within
about a second (before, each such test waited out its 60 s timeout with a bare TimeoutError).
"""

from __future__ import annotations

import asyncio

import pytest

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams


class Forgetful(AsyncLLM):
    """generate as the reference writes it, less its first step."""

    async def generate(self, prompt, sampling_params, request_id=None):
        collector = self.add_request(request_id or "forgetful", prompt, sampling_params)
        while True:
            out = await collector.get()
            yield out
            if out.finished:
                return


async def _consume(engine) -> list:
    return [o async for o in engine.generate("HAMLET.\n", SamplingParams(max_tokens=4))]


def test_a_stream_whose_output_loop_never_started_says_so():
    engine = Forgetful(LLM(max_model_len=64))
    try:
        with pytest.raises(RuntimeError, match=r"output loop is not running.*"
                                               r"self\._run_output_handler\(\)"):
            asyncio.run(asyncio.wait_for(_consume(engine), timeout=30))
    finally:
        engine.shutdown()


def test_the_same_stream_with_the_loop_started_runs_to_the_end():
    """The control: the check never fires while the loop runs (a slow step included)."""
    engine = AsyncLLM(LLM(max_model_len=64), multiprocessing=False)
    try:
        outs = asyncio.run(asyncio.wait_for(_consume(engine), timeout=60))
        assert outs and outs[-1].finished
    finally:
        engine.shutdown()
