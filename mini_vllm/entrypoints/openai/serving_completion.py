"""``POST /v1/completions``: a prompt in, its continuation out, whole or streamed as SSE.

upstream: vllm/entrypoints/openai/serving_completion.py:47 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from http import HTTPStatus

from fastapi.responses import JSONResponse, Response

from mini_vllm.entrypoints.openai.protocol import CompletionRequest
from mini_vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    collect_choices,
    engine_error_event,
    error_response,
    sse_event,
    usage,
)
from mini_vllm.outputs import RequestOutput

__all__ = ["OpenAIServingCompletion", "OpenAIServingCompletionBase"]


class OpenAIServingCompletionBase(OpenAIServing):
    """Completions: one prompt (text or token ids), ``n`` samples, streamed or not.

    All but the stream's framing, ``completion_stream_generator``, which is
    :class:`OpenAIServingCompletion`'s (lab 03-05 gives this part: the checks, the first-output
    handshake, the whole response).

    Invariant: the text of each choice, whole or concatenated over the stream's chunks, is the
    text ``LLM.generate`` returns for the same prompt and parameters.

    upstream: vllm/entrypoints/openai/serving_completion.py:47 @ v0.11.0
    """

    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest) -> Response:
        """Check the request, start it, and answer with JSON or an SSE stream.

        upstream: vllm/entrypoints/openai/serving_completion.py:82 @ v0.11.0
        """
        if (refused := self.refuse(request)) is not None:
            return refused
        try:
            # Tokenized here, once, to check max_tokens against the room the prompt leaves.
            text, ids = self.engine.llm._parse_one(request.single_prompt(), "the prompt")
            prompt = ids if text is None else {"prompt": text, "prompt_token_ids": ids}
            params = request.to_sampling_params(self.output_budget(request.max_tokens, len(ids)))
        except (TypeError, ValueError) as exc:
            return bad_request(exc)
        return await self.respond(
            prompt, params, request.stream,
            partial(self.completion_stream_generator, request),
            partial(self.completion_full, n=params.n, return_token_ids=request.return_token_ids))

    async def completion_full(self, outputs: AsyncIterator[RequestOutput], request_id: str,
                              created: int, n: int, return_token_ids: bool = False) -> Response:
        """Collect the stream into one response (the client waits for all of it).

        upstream: vllm/entrypoints/openai/serving_completion.py:496 @ v0.11.0
        """
        try:
            got = await collect_choices(outputs, n)
        except RuntimeError as exc:  # the engine failed (EngineGenerateError)
            return error_response(f"the engine failed while generating: {exc}",
                                  HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created,
            "model": self.model_name,
            "choices": [{"index": i, "text": got.texts[i], "logprobs": None,
                         "finish_reason": got.finish_reasons[i],
                         "stop_reason": got.stop_reasons[i],
                         **({"token_ids": got.token_ids[i], "prompt_token_ids": got.prompt_ids}
                            if return_token_ids else {})} for i in range(n)],
            "usage": usage(got.prompt_tokens, got.completion_tokens),
        })


class OpenAIServingCompletion(OpenAIServingCompletionBase):
    """:class:`OpenAIServingCompletionBase` with its SSE stream: what ``/v1/completions`` runs.

    upstream: vllm/entrypoints/openai/serving_completion.py:47 @ v0.11.0
    """

    async def completion_stream_generator(self, request: CompletionRequest,
                                          outputs: AsyncIterator[RequestOutput],
                                          request_id: str, created: int) -> AsyncIterator[str]:
        """One chunk per completion delta (``choices`` of one), then usage (when asked for), then
        ``[DONE]``. With ``include_usage`` every chunk has a ``usage`` field, ``null`` but in
        the last.

        upstream: vllm/entrypoints/openai/serving_completion.py:312 @ v0.11.0
        """
        prompt_tokens = completion_tokens = 0
        started: set[int] = set()  # choices that sent a chunk (the first carries the prompt ids)
        try:
            async for out in outputs:
                prompt_tokens = len(out.prompt_token_ids)
                for comp in out.outputs:
                    completion_tokens += len(comp.token_ids)
                    ids = request.return_token_ids and comp.token_ids
                    if not comp.text and comp.finish_reason is None and not ids:
                        continue  # held back (half a character, a possible stop string)
                    choice = {"index": comp.index, "text": comp.text, "logprobs": None,
                              "finish_reason": comp.finish_reason,
                              "stop_reason": comp.stop_reason}
                    if request.return_token_ids:
                        choice["token_ids"] = comp.token_ids
                        if comp.index not in started:
                            choice["prompt_token_ids"] = out.prompt_token_ids
                    started.add(comp.index)
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": [choice]}
                    if request.include_usage:
                        chunk["usage"] = None  # as OpenAI: the counts come in the last chunk
                    yield sse_event(chunk)
            if request.include_usage:
                yield sse_event({
                    "id": request_id, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens),
                })
        except RuntimeError as exc:  # the engine failed mid-stream (EngineGenerateError)
            yield engine_error_event(exc)
        yield sse_event("[DONE]")
