"""Lab 03-05 starter: the server, from a token to a byte on the wire.

The engine of lab 03-04 generates tokens; a server must hand them to a client while they are
made. Three pieces sit between the engine step and the HTTP response, and they are yours:

* task 1, ``IncrementalDetokenizer.decode_next``: the new text of the newest tokens, from a short
  window, never half a UTF-8 character;
* task 2, ``AsyncLLM.generate``: one request's stream of outputs, and its abort when the
  consumer goes away (a client that hangs up must not keep its KV blocks);
* task 3, ``OpenAIServingCompletion.completion_stream_generator``: the server-sent events of a
  streamed ``/v1/completions`` response, closed by ``data: [DONE]``.

Given (read them in ``mini_vllm``): ``IncrementalDetokenizerBase`` (the state, ``update``, the
stop-string hold-back of ``get_next_output_text``) in ``detokenizer.py``; ``AsyncLLMBase`` (the
core thread, ``add_request``, ``abort``, the output handler) in ``async_llm.py``;
``OpenAIServingCompletionBase`` (the checks, the first-output handshake, the whole response) in
``entrypoints/openai/serving_completion.py``, and ``sse_event``, ``usage`` and
``engine_error_event`` in ``serving_engine.py``. Each file's class right after the base is the
reference answer: do not read it before you have tried.

Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 03-05 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), ``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-05-server -q
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mini_vllm.engine.async_llm import AsyncLLMBase
from mini_vllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizerBase
from mini_vllm.entrypoints.openai.protocol import CompletionRequest
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletionBase
from mini_vllm.entrypoints.openai.serving_engine import engine_error_event, sse_event, usage
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "REPLACEMENT_CHAR",
    "AsyncLLM",
    "CompletionOutput",
    "CompletionRequest",
    "IncrementalDetokenizer",
    "OpenAIServingCompletion",
    "RequestOutput",
    "SamplingParams",
    "engine_error_event",
    "sse_event",
    "usage",
]


class IncrementalDetokenizer(IncrementalDetokenizerBase):
    """One request's output text, a few tokens at a time.

    Given by the base: ``self.token_ids`` (every output token so far; ``update`` appends one,
    then calls your ``decode_next``), ``self.prefix_offset`` and ``self.read_offset`` (the
    window), ``self._decode(ids)`` (the tokenizer's text of ``ids``).
    """

    def decode_next(self, final: bool = False) -> str:
        """Task 1: the text the tokens from ``read_offset`` on add, and move the window past them.

        The window: ``token_ids[prefix_offset:read_offset]`` are tokens already turned into text,
        kept as context (a tokenizer may write a token differently after a neighbour);
        ``token_ids[read_offset:]`` are not turned into text yet. Decode the context alone and
        the context with the new tokens; the new text is what the second has beyond the first.

        * No new token (``read_offset == len(token_ids)``): return ``""``.
        * The longer text ends in ``REPLACEMENT_CHAR`` (U+FFFD: the newest token ends inside a
          UTF-8 character; a byte tokenizer emits a character's bytes one token at a time), or
          it is no longer than the context's text: return ``""`` and move nothing, so that the
          next call decodes these tokens again with the rest of the character. Unless ``final``
          (no token will follow): then return the new text as it is, U+FFFD included, as a
          decode of the whole output shows it.
        * Otherwise: ``prefix_offset`` becomes the old ``read_offset``, ``read_offset`` becomes
          ``len(token_ids)``, and the new text is returned.

        Afterwards: the concatenation of everything returned equals
        ``tokenizer.decode(token_ids)``, no piece but a final one holds U+FFFD, and ``prefix_offset
        <= read_offset <= len(token_ids)``. Cost: each call decodes only
        ``token_ids[prefix_offset:]`` (a few tokens), never the whole output.
        """
        raise NotImplementedError(
            "lab 03-05, task 1: implement IncrementalDetokenizer.decode_next "
            "(hint: python -m course hint 03-05 1)"
        )


class AsyncLLM(AsyncLLMBase):
    """The engine a server runs on. Given by the base (``mini_vllm/engine/async_llm.py``):
    ``self._run_output_handler()`` (starts the engine loop on the running event loop),
    ``self.add_request(request_id, prompt, params)`` (checks and queues the request; returns
    its collector), ``self.abort(request_id)`` (the engine finishes the request and frees its
    blocks before its next step), ``self._ids`` (a counter for fresh request ids).
    """

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Task 2 (an async generator): yield one request's outputs as the engine makes them.

        ``request_id``: when ``None``, make a fresh one (``f"req-{next(self._ids)}"`` is
        enough). Start the engine loop, add the request (bad input raises there, from
        ``add_request``, before anything is queued), then yield what its collector holds, one
        ``RequestOutput`` (a delta) at a time: ``collector.get_nowait()`` returns one or
        ``None``; ``await collector.get()`` waits for one. The last one has ``finished=True``;
        stop after yielding it.

        A consumer may stop early: a client that disconnects cancels the task iterating this
        generator, and an abandoned generator is closed (``aclose()``), both of which raise
        inside it at the ``yield`` or the ``await``. Whatever the way out, a request whose last
        output was not yielded must be aborted (``self.abort(request_id)``), and a finished one
        must not be. Afterwards the engine holds no request and no block of it.
        """
        raise NotImplementedError(
            "lab 03-05, task 2: implement AsyncLLM.generate (hint: python -m course hint 03-05 2)"
        )
        yield  # an async generator: `yield` makes it one


class OpenAIServingCompletion(OpenAIServingCompletionBase):
    """``/v1/completions``. Given by the base: ``create_completion`` (checks the request, starts
    it, and calls your stream generator when ``request.stream``), ``completion_full``,
    ``self.model_name``."""

    async def completion_stream_generator(self, request: CompletionRequest,
                                          outputs: AsyncIterator[RequestOutput],
                                          request_id: str, created: int) -> AsyncIterator[str]:
        """Task 3 (an async generator): the server-sent events of one streamed completion.

        Every event is ``sse_event(payload)``: ``"data: <json>\\n\\n"``. For each output of
        ``outputs`` and each ``CompletionOutput`` ``comp`` in it (a delta of choice
        ``comp.index``), yield one chunk::

            {"id": request_id, "object": "text_completion", "created": created,
             "model": self.model_name,
             "choices": [{"index": comp.index, "text": comp.text, "logprobs": None,
                          "finish_reason": comp.finish_reason,
                          "stop_reason": comp.stop_reason}]}

        skipping a delta that says nothing (no text and no ``finish_reason``: text held back,
        half a character or a possible stop string). With ``request.return_token_ids``, a
        choice also carries ``"token_ids": comp.token_ids``, and the first chunk of each choice
        ``"prompt_token_ids"`` (the output's ``prompt_token_ids``); a delta with token ids is
        then never skipped.

        After the last output: when ``request.include_usage``, one more chunk with
        ``"choices": []`` and ``"usage": usage(prompt_tokens, completion_tokens)`` (the prompt's
        length; the number of token ids of every delta of every choice); every chunk before it
        then carries ``"usage": None`` (as OpenAI's streams do), and without
        ``include_usage`` no chunk has a ``usage`` key. If iterating
        ``outputs`` raises ``RuntimeError`` (the engine failed mid-stream), yield
        ``engine_error_event(exc)`` instead of the rest. In every case the last event is
        ``sse_event("[DONE]")``: the OpenAI clients stop reading there.
        """
        raise NotImplementedError(
            "lab 03-05, task 3: implement OpenAIServingCompletion.completion_stream_generator "
            "(hint: python -m course hint 03-05 3)"
        )
        yield  # an async generator: `yield` makes it one
