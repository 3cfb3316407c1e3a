"""``POST /v1/chat/completions``: a conversation in, the assistant's answer out.

The conversation is rendered with a chat template (the request's ``chat_template``, else the
server's ``--chat-template``, else the tokenizer's) and tokenized without special tokens (the
template wrote them), exactly as ``LLM.chat`` does, so the answer equals ``LLM.chat``'s.

upstream: vllm/entrypoints/openai/serving_chat.py:59 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from http import HTTPStatus

from fastapi.responses import JSONResponse, Response

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.openai.protocol import ChatCompletionRequest
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
from mini_vllm.tokenizers.tokenizer import render_chat_template

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(OpenAIServing):
    """Chat completions: streamed as ``chat.completion.chunk`` deltas (the role first, then the
    content), or whole as one ``chat.completion``.

    upstream: vllm/entrypoints/openai/serving_chat.py:59 @ v0.11.0
    """

    request_id_prefix = "chatcmpl"
    response_role = "assistant"

    def __init__(self, engine: AsyncLLM, model_name: str, chat_template: str | None = None
                 ) -> None:
        super().__init__(engine, model_name)
        self.chat_template = chat_template

    def render_prompt(self, request: ChatCompletionRequest) -> dict[str, object]:
        """The prompt of a conversation: its text and token ids; ``ValueError`` when there is
        no template or it fails."""
        tokenizer = self.engine.tokenizer
        template = (request.chat_template or self.chat_template
                    or getattr(tokenizer, "chat_template", None))
        if template is None:
            raise ValueError(
                "this model has no chat template (the shipped Shakespeare model is not a chat "
                "model): start the server with --chat-template FILE, or pass chat_template in "
                "the request, or use /v1/completions"
            )
        context = dict(request.chat_template_kwargs or {})
        for name in ("bos_token", "eos_token"):
            context.setdefault(name, getattr(tokenizer, name, None) or "")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        text = render_chat_template(
            template, messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, **context)
        return {"prompt": text,
                "prompt_token_ids": self.engine.llm._encode(text, add_special_tokens=False)}

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """Check the request, render and start it, and answer with JSON or an SSE stream.

        upstream: vllm/entrypoints/openai/serving_chat.py:163 @ v0.11.0
        """
        if (refused := self.refuse(request)) is not None:
            return refused
        if not request.messages:
            return error_response("messages is empty; give at least one message")
        try:
            prompt = self.render_prompt(request)
            field = ("max_completion_tokens" if request.max_completion_tokens is not None
                     else "max_tokens")
            max_tokens = self.output_budget(request.requested_max_tokens(),
                                            len(prompt["prompt_token_ids"]), field)
            params = request.to_sampling_params(max_tokens)
        except (TypeError, ValueError) as exc:
            return bad_request(exc)
        return await self.respond(
            prompt, params, request.stream,
            partial(self.chat_completion_stream_generator, request, n=params.n),
            partial(self.chat_completion_full, n=params.n,
                    return_token_ids=request.return_token_ids))

    def _chunk(self, request: ChatCompletionRequest, request_id: str, created: int, index: int,
               delta: dict[str, str], finish_reason: str | None = None,
               stop_reason: object = None, token_ids: list[int] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                 "model": self.model_name, "choices": [choice]}
        if request.include_usage:
            chunk["usage"] = None  # as OpenAI: the counts come in the last chunk
        return sse_event(chunk)

    async def chat_completion_stream_generator(
        self, request: ChatCompletionRequest, outputs: AsyncIterator[RequestOutput],
        request_id: str, created: int, n: int,
    ) -> AsyncIterator[str]:
        """First a chunk per choice with the role, then content deltas, the last one of each
        choice with its finish reason; usage (when asked for: every other chunk then has
        ``"usage": null``); ``[DONE]``.

        upstream: vllm/entrypoints/openai/serving_chat.py:478 @ v0.11.0
        """
        for index in range(n):
            yield self._chunk(request, request_id, created, index,
                              {"role": self.response_role, "content": ""})
        prompt_tokens = completion_tokens = 0
        try:
            async for out in outputs:
                prompt_tokens = len(out.prompt_token_ids)
                for comp in out.outputs:
                    completion_tokens += len(comp.token_ids)
                    ids = comp.token_ids if request.return_token_ids else None
                    if not comp.text and comp.finish_reason is None and not ids:
                        continue  # held back (half a character, a possible stop string)
                    yield self._chunk(request, request_id, created, comp.index,
                                      {"content": comp.text} if comp.text else {},
                                      comp.finish_reason, comp.stop_reason, ids)
            if request.include_usage:
                yield sse_event({
                    "id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens),
                })
        except RuntimeError as exc:  # the engine failed mid-stream (EngineGenerateError)
            yield engine_error_event(exc)
        yield sse_event("[DONE]")

    async def chat_completion_full(self, outputs: AsyncIterator[RequestOutput],
                                   request_id: str, created: int, n: int,
                                   return_token_ids: bool = False) -> Response:
        """Collect the stream into one ``chat.completion``.

        upstream: vllm/entrypoints/openai/serving_chat.py:1151 @ v0.11.0
        """
        try:
            got = await collect_choices(outputs, n)
        except RuntimeError as exc:
            return error_response(f"the engine failed while generating: {exc}",
                                  HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.model_name,
            "choices": [{"index": i,
                         "message": {"role": self.response_role, "content": got.texts[i]},
                         "logprobs": None, "finish_reason": got.finish_reasons[i],
                         "stop_reason": got.stop_reasons[i],
                         **({"token_ids": got.token_ids[i]} if return_token_ids else {})}
                        for i in range(n)],
            "usage": usage(got.prompt_tokens, got.completion_tokens),
            **({"prompt_token_ids": got.prompt_ids} if return_token_ids else {}),
        })
