"""Incremental detokenization: turn a stream of token ids into a stream of text, piece by piece.

A server streams text as tokens arrive, so it cannot wait for the end and call ``decode`` once,
and decoding the whole output again after every token costs O(n) per token (O(n^2) for the
request). :class:`IncrementalDetokenizer` decodes only a short window of recent tokens per step:

* ``prefix_offset..read_offset`` are tokens already turned into text (kept as context, because a
  tokenizer may render a token differently after a neighbour: a leading space, a byte fallback);
* ``read_offset..`` are the tokens not yet emitted.

Each step decodes ``ids[prefix:]`` and ``ids[prefix:read]`` and emits the difference. When the
window's text ends in U+FFFD the last token ends in the middle of a UTF-8 character (a byte-level
tokenizer emits a character's bytes one token at a time), so nothing is emitted and the window
grows until the character is complete: a streamed piece never holds half a character. When the
request finishes, whatever is still held is flushed as the tokenizer decodes it.

The result, the concatenation of every piece, equals ``tokenizer.decode(output_token_ids)``
(what ``LLM.generate`` returns), cut at a stop string when one is found.

upstream: vllm/v1/engine/detokenizer.py:68 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mini_vllm.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "IncrementalDetokenizerBase", "REPLACEMENT_CHAR",
           "check_stop_strings"]

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizerBase:
    """The text of one request's output tokens, built a token at a time (all but the window step).

    Lab 03-05 gives this part: the state, ``update`` (tokens in, stop tokens and stop strings)
    and ``get_next_output_text`` (the stream's deltas, the stop-string hold-back). The step that
    turns the tokens after ``read_offset`` into text, ``decode_next``, is
    :class:`IncrementalDetokenizer`'s.

    Invariants: ``output_text`` is the decoded text of ``token_ids[:read_offset]`` (minus the
    final stop token when the request ended on one, and cut at a stop string when one matched);
    ``prefix_offset <= read_offset <= len(token_ids)``; each call decodes at most the tokens from
    ``prefix_offset`` on, never the whole output. ``get_next_output_text(delta=True)`` hands out
    each character exactly once, holding back the last ``len(longest stop string) - 1``
    characters until the request finishes (they may turn out to start a stop string that must
    not be shown).

    upstream: vllm/v1/engine/detokenizer.py:68 @ v0.11.0
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters a stream must hold back: they may be the start of a stop string.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self.token_ids: list[int] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self._sent = 0  # characters of output_text already handed out as deltas
        self._stopped = False  # a stop string matched: later tokens add no text

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # a user tokenizer without that keyword
            return self.tokenizer.decode(list(ids))

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False,
               finished: bool = False) -> str | None:
        """Take the tokens a step produced; return the stop string they completed, or ``None``.

        ``stop_terminated``: the last token is EOS or a stop token id, so it is kept in
        ``token_ids`` but adds no text (unless ``include_stop_str_in_output``). ``finished``: no
        token follows, so held bytes are flushed. Stop strings count only once more than
        ``min_tokens`` tokens exist, and only in text those tokens made. After a stop string
        matched, ``output_text`` ends before it (or after it, when it is kept) and later calls
        add nothing.

        upstream: vllm/v1/engine/detokenizer.py:91 @ v0.11.0
        """
        if self._stopped:
            self.token_ids.extend(new_token_ids)
            return None
        new = list(new_token_ids)
        skipped = new.pop() if new and stop_terminated and not self.include_stop_str_in_output \
            else None
        check_from = len(self.output_text)
        for token_id in new:
            self.token_ids.append(token_id)
            self.output_text += self.decode_next()
            if len(self.token_ids) <= self.min_tokens:
                check_from = len(self.output_text)  # text of the first min_tokens never stops
        if finished:
            self.output_text += self.decode_next(final=True)
        if skipped is not None:
            self.token_ids.append(skipped)
            self.prefix_offset = self.read_offset = len(self.token_ids)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        found = check_stop_strings(self.output_text, len(self.output_text) - check_from,
                                   self.stop, self.include_stop_str_in_output)
        if found is None:
            return None
        stop_str, cut = found
        self.output_text = self.output_text[:cut]
        self._stopped = True
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it (``delta=False``) or only what is new since the last
        delta call; the stop-string hold-back applies until ``finished``.

        upstream: vllm/v1/engine/detokenizer.py:148 @ v0.11.0
        """
        held = 0 if finished else self.stop_buffer_length
        ready = max(len(self.output_text) - held, 0)
        if not delta:
            return self.output_text[:ready]
        if ready <= self._sent:
            return ""
        piece = self.output_text[self._sent:ready]
        self._sent = ready
        return piece


class IncrementalDetokenizer(IncrementalDetokenizerBase):
    """:class:`IncrementalDetokenizerBase` with its window step: what a server detokenizes with.

    upstream: vllm/v1/engine/detokenizer.py:68 @ v0.11.0
    """

    def decode_next(self, final: bool = False) -> str:
        """The new text of the tokens after ``read_offset``, and advance the window past them.

        Returns ``""`` (and keeps the tokens unread) while the window's text ends in an
        incomplete character, unless ``final``: then the tokenizer's rendering of the leftover
        bytes (U+FFFD) is returned, as a whole-output decode would show it.

        upstream: vllm/transformers_utils/detokenizer_utils.py:110 @ v0.11.0
        """
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (window_text.endswith(REPLACEMENT_CHAR)
                          or len(window_text) <= len(prefix_text)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return window_text[len(prefix_text):]


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """The first stop string found in the last ``new_char_count`` characters (or straddling
    them), and where to cut the text: before the string, or after it when it is kept.

    upstream: vllm/v1/engine/detokenizer.py:313 @ v0.11.0
    """
    if not new_char_count:
        return None
    for stop_str in stop:
        # Only text that could contain a new match: the new characters and the stop string's
        # length minus one before them.
        index = output_text.find(stop_str, max(0, len(output_text) - new_char_count
                                               - len(stop_str) + 1))
        if index != -1:
            return stop_str, index + len(stop_str) if include_in_output else index
    return None
