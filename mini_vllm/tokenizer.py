"""A byte-level tokenizer: every UTF-8 byte is one token, plus two special tokens.

No vocabulary file and nothing to download: ids 0..255 are the bytes themselves, 256 is the
beginning-of-sequence token and 257 the end-of-sequence token. It round-trips any string exactly
(``decode(encode(s)) == s``), which keeps the engine's tests independent of any tokenizer package.
The model in ``mini_vllm/checkpoints/`` was trained with it.

upstream: vllm/v1/engine/detokenizer.py:29 @ v0.11.0 (vLLM wraps Hugging Face tokenizers instead)
"""

from __future__ import annotations

from collections.abc import Iterable

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

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), optionally preceded by the BOS id."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects a str, got {type(text).__name__}.")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int]) -> str:
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
