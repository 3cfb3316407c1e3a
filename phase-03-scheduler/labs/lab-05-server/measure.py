"""Predict, then measure: what streaming one token's text costs as the output grows.

`python -m course measure 03-05 --plot detok.png` streams outputs of growing length through your
IncrementalDetokenizer (one token per step, as the engine hands them over, with the shipped
model's byte tokenizer) and counts the tokens each step gives the tokenizer to decode, beside
the reference's and beside the obvious way: decode the whole output again after every token and
send what is new. It also times both, per output token (the best of 3 rounds).
"""

from __future__ import annotations

import time

TITLE = "Streaming text: the cost of one token's piece as the output grows"
X_LABEL = "output length (tokens)"
Y_LABEL = "see each panel"
LOG_X = LOG_Y = True
ROUNDS = 3
METRICS = {
    "decoded_per_token": "tokens decoded per output token",
    "us_per_token": "microseconds per output token",
}
# Text with 1- to 4-byte characters, so that windows sometimes wait for a character's end.
TEXT = "To be, or not to be — naïve café, 東京 🙂. "


def sizes(quick: bool) -> list[int]:
    return [64, 512, 4096] if quick else [64, 256, 1024, 4096, 16384]


def _ids(n: int) -> list[int]:
    from mini_vllm.tokenizers.tokenizer import ByteTokenizer

    data = ByteTokenizer().encode(TEXT)
    return (data * (n // len(data) + 1))[:n]


class _Counting:
    """The byte tokenizer, counting the tokens it is given to decode."""

    def __init__(self) -> None:
        from mini_vllm.tokenizers.tokenizer import ByteTokenizer

        self.inner = ByteTokenizer()
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


def run(impl, n: int) -> dict[str, float]:
    """Your detokenizer (or the reference's) streaming an n-token output."""
    tok = _Counting()
    detok = impl.IncrementalDetokenizer(tok, impl.SamplingParams(temperature=0.0))
    ids = _ids(n)
    start = time.perf_counter()
    for i, token in enumerate(ids):
        detok.update([token], finished=i == n - 1)
        detok.get_next_output_text(finished=i == n - 1, delta=True)
    seconds = time.perf_counter() - start
    return {"decoded_per_token": tok.decoded / n, "us_per_token": 1e6 * seconds / n}


def decode_everything_again(n: int) -> dict[str, float]:
    """The obvious way: after each token, decode the whole output and send the new suffix."""
    tok = _Counting()
    ids = _ids(n)
    sent = 0
    start = time.perf_counter()
    for i in range(1, n + 1):
        text = tok.decode(ids[:i])
        if not text.endswith("\ufffd") or i == n:  # wait for a character's last byte
            sent = len(text)
    seconds = time.perf_counter() - start
    assert sent == len(tok.inner.decode(ids))
    return {"decoded_per_token": tok.decoded / n, "us_per_token": 1e6 * seconds / n}


BASELINES = {"decode the whole output each token": decode_everything_again}
