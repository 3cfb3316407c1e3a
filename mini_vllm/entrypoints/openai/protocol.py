"""The shapes of the OpenAI API that the server speaks: requests in, errors and models out.

Requests are pydantic models, so a field of the wrong type is refused before any engine work,
with the field's name in the message. Fields the API defines but mini_vllm does not implement
(log-probabilities, penalties, ``best_of``, ``echo``, ``suffix``, tools) are refused with a 400
that names them, rather than silently ignored; so are fields the API does not know (a typo).
Besides OpenAI's fields, the requests take vLLM's extra sampling fields (``top_k``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, and ``return_token_ids`` to get each choice's token ids; with the
``openai`` client, pass them in ``extra_body``).

Responses are built as plain dicts in ``serving_completion`` and ``serving_chat``.

upstream: vllm/entrypoints/openai/protocol.py:1024 @ v0.11.0
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from mini_vllm.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
    "model_list",
]

# Fields of the OpenAI API that mini_vllm does not implement; a request that sets one to
# something other than its "off" value gets a 400 naming it.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "best_of": None, "echo": False, "suffix": None,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None, "tools": None,
    "tool_choice": None, "response_format": None,
}


class OpenAIBaseModel(BaseModel):
    """A request body: unknown fields are an error (a typo must not be silently ignored).

    upstream: vllm/entrypoints/openai/protocol.py:68 @ v0.11.0
    """

    model_config = ConfigDict(extra="forbid")

    def unsupported(self) -> list[str]:
        """The fields set to something mini_vllm cannot honour."""
        return [name for name, off in UNSUPPORTED_FIELDS.items()
                if getattr(self, name, off) not in (off, None)]


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts.

    upstream: vllm/entrypoints/openai/protocol.py:192 @ v0.11.0
    """

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIBaseModel):
    """The sampling fields both endpoints share, and their translation to ``SamplingParams``."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted at their "off" values only (see UNSUPPORTED_FIELDS).
    logprobs: Any = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's extra output field: each choice also carries its token ids (and the prompt's).
    return_token_ids: bool = False

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request; ``TypeError``/``ValueError`` (the
        server's 400) when a value is out of range.

        upstream: vllm/entrypoints/openai/protocol.py:1220 @ v0.11.0
        """
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids), ``max_tokens`` 16 by default.

    upstream: vllm/entrypoints/openai/protocol.py:1024 @ v0.11.0
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; ``ValueError`` for a batch of several (one user
        request is one stream here; send one request per prompt)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(
                    f"prompt holds {len(prompt)} prompts; this server takes one prompt per "
                    "request (send one request per prompt)"
                )
            return prompt[0]
        return prompt


class ChatMessage(BaseModel):
    """One message of a conversation: a role and its text (a string, or text parts).

    upstream: vllm/entrypoints/openai/protocol.py:1830 @ v0.11.0
    """

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; ``ValueError`` for a part that is not text (images, audio)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"a {self.role} message has a content part of type {part.get('type')!r}; "
                    "this server takes text only"
                )
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a conversation rendered with the model's chat template
    (or ``chat_template``, a vLLM extra field); without ``max_tokens`` / ``max_completion_tokens``
    the answer may fill the model's context.

    upstream: vllm/entrypoints/openai/protocol.py:425 @ v0.11.0
    """

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra chat fields.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def error_body(message: str, err_type: str, code: int, param: str | None = None
               ) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``; ``param``
    names the request field at fault, when one is.

    upstream: vllm/entrypoints/openai/protocol.py:101 @ v0.11.0
    """
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def model_list(model_name: str, max_model_len: int, created: int | None = None
               ) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server serves.

    upstream: vllm/entrypoints/openai/protocol.py:127 @ v0.11.0
    """
    return {"object": "list", "data": [{
        "id": model_name, "object": "model",
        "created": int(time.time()) if created is None else created,
        "owned_by": "mini_vllm", "root": model_name, "parent": None,
        "max_model_len": max_model_len,
    }]}

