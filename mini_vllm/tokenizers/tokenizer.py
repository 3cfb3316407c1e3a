"""Tokenizers: the byte-level one of the shipped model, and Hugging Face ``tokenizer.json`` files.

:class:`ByteTokenizer` needs no vocabulary file: ids 0..255 are the bytes themselves, 256 is the
beginning-of-sequence token and 257 the end-of-sequence token. It round-trips any string exactly
(``decode(encode(s)) == s``), which keeps the engine's tests independent of any tokenizer package.
The model in ``mini_vllm/checkpoints/`` was trained with it.

:class:`HFTokenizer` wraps a real model's ``tokenizer.json`` with the ``tokenizers`` package (the
Rust library under Hugging Face's fast tokenizers), and reads ``tokenizer_config.json`` beside it
for the special tokens and the chat template. :func:`render_chat_template` renders a chat template
the way ``transformers`` does (a sandboxed Jinja environment with the same options and helpers).

upstream: vllm/v1/engine/detokenizer.py:29 @ v0.11.0 (vLLM wraps Hugging Face tokenizers too)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "render_chat_template"]

NUM_BYTES = 256


class ByteTokenizer:
    """Bytes in, bytes out.

    Invariants: ``vocab_size == 258``; ``encode`` returns ids in ``[0, 256)`` (plus the BOS id in
    front when asked); ``decode`` skips special ids and replaces byte sequences that are not valid
    UTF-8 (a generation cut in the middle of a character) with U+FFFD rather than failing.

    upstream: none (vLLM uses the model's Hugging Face tokenizer; this one needs no download)
    """

    bos_token_id: int = NUM_BYTES
    eos_token_id: int = NUM_BYTES + 1
    vocab_size: int = NUM_BYTES + 2
    chat_template: str | None = None

    def encode(self, text: str, *, add_bos: bool = False, add_special_tokens: bool = False
               ) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), optionally preceded by the BOS id."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects a str, got {type(text).__name__}.")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; special ids are dropped, unknown ids are an error."""
        data = bytearray()
        for tid in token_ids:
            tid = int(tid)
            if 0 <= tid < NUM_BYTES:
                data.append(tid)
            elif tid not in (self.bos_token_id, self.eos_token_id):
                raise ValueError(
                    f"ByteTokenizer.decode: token id {tid} is outside the vocabulary "
                    f"[0, {self.vocab_size}); was the model's vocab_size larger than the "
                    "tokenizer's?"
                )
        return data.decode("utf-8", errors="replace")


def _token_content(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) with its special tokens and chat template.

    ``encode(text)`` adds the special tokens the tokenizer's post-processor adds (a BOS for Llama
    tokenizers, nothing for GPT-2 style ones) unless ``add_special_tokens=False``, which is what
    chat prompts use (the template already wrote them). ``decode`` skips special tokens by default,
    as vLLM's detokenizer does.

    upstream: vllm/transformers_utils/tokenizer.py:145 @ v0.11.0
    """

    def __init__(self, tokenizer: Any, *, bos_token: str | None = None,
                 eos_token: str | None = None, chat_template: str | None = None,
                 source: str = "<memory>") -> None:
        self._tok = tokenizer
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return tid

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Read ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) in ``path``.

        ``chat_template`` comes from ``tokenizer_config.json`` or, as newer ``transformers``
        writes it, from ``chat_template.jinja`` beside it.
        """
        from tokenizers import Tokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"{tok_file}: not a readable tokenizer.json ({exc})") from exc
        config = _read_json(path / "tokenizer_config.json") if (
            path / "tokenizer_config.json").exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            tokenizer,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=template if isinstance(template, str) else None,
            source=str(tok_file),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode expects a str, got {type(text).__name__}.")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(t) for t in token_ids],
                                skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            chat_template: str | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation, rendered with the model's chat template."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                f"{self.source}: this tokenizer has no chat template (tokenizer_config.json has "
                "no chat_template); pass chat_template=... or use generate() with plain text"
            )
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(path: str | Path) -> HFTokenizer | None:
    """The tokenizer of a Hugging Face model directory, or ``None`` when it has no tokenizer.json.

    upstream: vllm/transformers_utils/tokenizer.py:145 @ v0.11.0
    """
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return HFTokenizer.from_dir(path)
    return None


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         **context: Any) -> str:
    """Render a Hugging Face chat template for ``messages`` (a list of ``{"role", "content"}``).

    The environment matches ``transformers``' (sandboxed, ``trim_blocks``, ``lstrip_blocks``, the
    loop-controls extension, ``raise_exception`` and ``strftime_now``), so a template renders the
    same text here as there. ``continue_final_message`` leaves the last (assistant) message open,
    for the model to continue, instead of closing it.

    upstream: vllm/entrypoints/chat_utils.py:1602 @ v0.11.0
    """
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
    ):
        raise TypeError(
            "chat: messages must be a list of dicts with a 'role' and a 'content', e.g. "
            "[{'role': 'user', 'content': 'Hello'}]"
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError("chat: add_generation_prompt and continue_final_message exclude "
                         "each other")

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent,
                                                                    ensure_ascii=False)
    try:
        text = env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )
    except TemplateError as exc:
        raise ValueError(f"chat: the chat template failed: {exc}") from exc
    if continue_final_message:
        last = messages[-1].get("content")
        if not isinstance(last, str) or last.strip() not in text:
            raise ValueError("chat: continue_final_message needs a final message with text")
        # Cut everything the template wrote after the final message's text (its end tokens).
        text = text[: text.rindex(last.strip()) + len(last.strip())]
    return text
