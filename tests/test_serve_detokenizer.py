"""The server's incremental detokenizer and output collector, without a server.

What a stream promises: the pieces add up to ``tokenizer.decode`` of the whole output (what
``LLM.generate`` returns); a piece never holds half a UTF-8 character; a piece once sent is never
taken back (text that may start a stop string is held until it is known not to); and each token
costs a decode of a few tokens, never of the whole output.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from course.labs.serving import CountingTokenizer
from mini_vllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from mini_vllm.engine.output_processor import RequestOutputCollector
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tokenizers.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def stream(ids, params=None, chunk=1, tokenizer=TOK, stop_terminated=False):
    """Feed ``ids`` ``chunk`` tokens per step, as the engine would; return (pieces, detok,
    the stop string found)."""
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams(temperature=0.0))
    pieces, found = [], None
    steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)] or [[]]
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        found = detok.update(step, stop_terminated=stop_terminated and last, finished=last)
        pieces.append(detok.get_next_output_text(finished=last or found is not None,
                                                 delta=True))
        if found is not None:
            break
    return pieces, detok, found


@given(st.lists(st.integers(0, 257), max_size=40), st.integers(1, 3))
def test_pieces_add_up_to_the_whole_decode_even_for_invalid_utf8(ids, chunk):
    pieces, detok, _ = stream(ids, chunk=chunk)
    assert "".join(pieces) == TOK.decode(ids)
    assert detok.token_ids == ids


@given(st.text(max_size=30))
def test_a_piece_never_holds_half_a_character(text):
    ids = TOK.encode(text)
    pieces, _, _ = stream(ids)
    assert "".join(pieces) == text
    for piece in pieces:
        assert REPLACEMENT_CHAR not in piece or REPLACEMENT_CHAR in text, (
            f"a piece of {text!r} ends inside a character: {pieces!r}")


def test_each_token_decodes_a_short_window_not_the_whole_output():
    text = "naïve café — 東京 🙂 " * 25  # 1- to 4-byte characters, 500+ tokens
    tok = CountingTokenizer()
    pieces, _, _ = stream(TOK.encode(text), tokenizer=tok)
    assert "".join(pieces) == text
    assert max(tok.calls) <= 8, (
        f"a decode call was given {max(tok.calls)} tokens: the detokenizer re-decodes more "
        "than the last character's bytes")


@given(st.text(alphabet="ab \n", max_size=24), st.text(alphabet="ab \n", min_size=1,
                                                       max_size=3),
       st.booleans(), st.integers(1, 3))
def test_stop_strings_cut_the_text_and_a_sent_piece_is_never_taken_back(text, stop, keep,
                                                                       chunk):
    params = SamplingParams(temperature=0.0, stop=[stop], include_stop_str_in_output=keep)
    pieces, detok, found = stream(TOK.encode(text), params, chunk=chunk)
    at = text.find(stop)
    want = text if at < 0 else text[: at + len(stop) if keep else at]
    assert detok.output_text == want
    assert "".join(pieces) == want, f"streamed {pieces!r}, want {want!r}"
    assert found == (stop if at >= 0 else None)


def test_stop_token_is_kept_as_an_id_but_not_as_text():
    ids = [*TOK.encode("Good night"), TOK.eos_token_id]
    pieces, detok, _ = stream(ids, stop_terminated=True)
    assert "".join(pieces) == "Good night"
    assert detok.token_ids == ids


@pytest.mark.parametrize("chunk", [1, 6], ids=["token-per-step", "all-in-one-step"])
def test_stop_strings_inside_min_tokens_do_not_count(chunk):
    params = SamplingParams(temperature=0.0, stop=["a"], min_tokens=3, max_tokens=10)
    pieces, _, found = stream(TOK.encode("aa bca"), params, chunk=chunk)
    assert found == "a" and "".join(pieces) == "aa bc"


def _delta(index, text, ids, finished=False, reason=None):
    return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids, reason)],
                         finished=finished)


def test_collector_merges_deltas_a_slow_consumer_missed_and_raises_errors():
    async def run():
        box = RequestOutputCollector()
        assert box.get_nowait() is None
        box.put(_delta(0, "To ", [1]))
        box.put(_delta(1, "Or", [2]))
        box.put(_delta(0, "be", [3], finished=True, reason="length"))
        merged = await box.get()
        assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
            (0, "To be", [1, 3], "length"), (1, "Or", [2], None)]
        assert merged.finished and box.get_nowait() is None
        box.put(_delta(0, "x", [4]))
        box.put(RuntimeError("engine failed"))
        with pytest.raises(RuntimeError, match="engine failed"):
            await box.get()

    asyncio.run(run())
