"""Graded tests of lab 03-05: the incremental detokenizer step, the request stream and its abort,
and the server-sent events of a streamed completion.

Tasks 1 and 3 are tested without a model or a server (a byte tokenizer; hand-made outputs), task
2 on the shipped tiny model, and the three together in a real uvicorn server driven by the
official ``openai`` client (``course/labs/serving.py``, over a Unix socket so that it also runs
where the network is cut off).

Where the lab's code runs in a process of its own (course/labs/student_process.py), what must
live beside it runs there: the async streams (an async generator does not cross), the engine
(its weights are the reference's, loaded in this process before that one forks) and the server.
What they return is data, checked here against what this process computes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.serving import CountingTokenizer, ServerThread, openai_client, wait_idle
from course.labs.student_process import beside_the_student
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tokenizers.tokenizer import ByteTokenizer

lab = load_lab(__file__)

TOK = ByteTokenizer()
MAX_MODEL_LEN = 128
# An abort is applied before the engine's next step (milliseconds with the tiny model): seconds
# of waiting for the engine to go idle is ample and keeps a failing run short.
IDLE_TIMEOUT = 5.0


# ---------------------------------------------------------------------------- task 1


def stream_text(ids, *, chunk=1, tokenizer=TOK, **params):
    """Feed ``ids`` ``chunk`` tokens per step through the lab's detokenizer, as the engine does;
    return (the pieces a client gets, the detokenizer, the stop string found)."""
    detok = lab.IncrementalDetokenizer(tokenizer, lab.SamplingParams(temperature=0.0, **params))
    pieces, found = [], None
    steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)] or [[]]
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        found = detok.update(step, finished=last)
        pieces.append(detok.get_next_output_text(finished=last or found is not None, delta=True))
        if found is not None:
            break
    return pieces, detok, found


@pytest.mark.points(2)
@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", ["HAMLET. To be", "naïve café", "東京 🙂 ok", "🙂🙂"])
def test_pieces_add_up_to_the_text_and_never_split_a_character(text, chunk):
    pieces, detok, _ = stream_text(TOK.encode(text), chunk=chunk)
    assert "".join(pieces) == text, (
        f"the streamed pieces of {text!r} do not add up to its text: decode_next must return "
        f"exactly the text the new tokens add, once; pieces {pieces!r}")
    for piece in pieces:
        assert lab.REPLACEMENT_CHAR not in piece, (
            f"a piece of {text!r} holds U+FFFD, half a character: decode_next must return '' "
            f"while the window's text ends in U+FFFD; pieces {pieces!r}")
    assert detok.prefix_offset <= detok.read_offset == len(detok.token_ids), (
        f"after the last token the window is prefix_offset={detok.prefix_offset}, "
        f"read_offset={detok.read_offset} over {len(detok.token_ids)} tokens: read_offset must "
        "reach the end once the text is complete")


@given(st.text(max_size=24), st.integers(1, 3))
def test_any_text_streams_back_whole(text, chunk):
    pieces, _, _ = stream_text(TOK.encode(text), chunk=chunk)
    assert "".join(pieces) == text, (
        f"the streamed pieces of {text!r} do not add up to its text (chunk {chunk}): "
        f"pieces {pieces!r}")
    assert all(lab.REPLACEMENT_CHAR not in p for p in pieces) or lab.REPLACEMENT_CHAR in text, (
        f"a piece of {text!r} holds half a character: {pieces!r}")


@beside_the_student
def _add_tokens(detok, ids):
    detok.token_ids.extend(ids)


def add_tokens(detok, ids):
    """Append ``ids`` to the detokenizer's own ``token_ids`` (a list read from the lab's objects
    is a copy), as the engine's update does before it decodes."""
    _add_tokens(detok, list(ids), beside=lab)


def test_an_incomplete_character_is_held_and_the_window_stays():
    detok = lab.IncrementalDetokenizer(TOK, lab.SamplingParams(temperature=0.0))
    smile = TOK.encode("🙂")  # four bytes, four tokens
    add_tokens(detok, TOK.encode("ab"))
    assert detok.decode_next() == "ab", (
        "decode_next with the new tokens of 'ab' (two whole characters) must return 'ab'")
    assert (detok.prefix_offset, detok.read_offset) == (0, 2), (
        f"after 'ab' the window is ({detok.prefix_offset}, {detok.read_offset}): prefix_offset "
        "takes the old read_offset (0) and read_offset the number of tokens (2)")
    for i, byte in enumerate(smile[:-1]):
        add_tokens(detok, [byte])
        got = detok.decode_next()
        assert got == "", (
            f"after {i + 1} of the 4 bytes of 🙂 decode_next returned {got!r}: it must return "
            "'' while the window's text ends in U+FFFD")
        assert (detok.prefix_offset, detok.read_offset) == (0, 2), (
            "decode_next moved the window while the character was incomplete: it must keep "
            "the bytes unread so that the next call decodes them with the rest")
    add_tokens(detok, smile[-1:])
    assert detok.decode_next() == "🙂", (
        "the 4th byte completes 🙂: decode_next must now return the whole character, decoding "
        "the held bytes with it")
    assert (detok.prefix_offset, detok.read_offset) == (2, 6), (
        f"after 🙂 the window is ({detok.prefix_offset}, {detok.read_offset}): prefix_offset "
        "takes the old read_offset (2) and read_offset the number of tokens (6)")
    assert detok.decode_next() == "", "with no new token decode_next must return ''"


def test_a_cut_character_at_the_end_is_flushed_as_the_whole_decode_shows_it():
    ids = TOK.encode("ab") + TOK.encode("🙂")[:2]
    pieces, detok, _ = stream_text(ids)
    assert "".join(pieces) == TOK.decode(ids), (
        f"a request that ends inside a character streamed {''.join(pieces)!r}, but "
        f"LLM.generate shows {TOK.decode(ids)!r}: with final=True decode_next returns the "
        "leftover text, U+FFFD included")


def test_each_step_decodes_a_short_window_not_the_whole_output():
    text = "naïve café — 東京 🙂 " * 12  # 1- to 4-byte characters, 250+ tokens
    tok = CountingTokenizer()
    pieces, _, _ = stream_text(TOK.encode(text), tokenizer=tok)
    assert "".join(pieces) == text, (
        f"the streamed pieces ({len(''.join(pieces))} characters, "
        f"{sum(p.count(lab.REPLACEMENT_CHAR) for p in pieces)} of them U+FFFD) do not add up to "
        f"the text ({len(text)}, no U+FFFD): decode_next must return each new character once")
    assert max(tok.calls) <= 8, (
        f"a decode call was given {max(tok.calls)} tokens of {len(TOK.encode(text))}: "
        "decode_next must decode only token_ids[prefix_offset:], and move prefix_offset on")


def test_stop_string_cuts_the_stream_and_is_never_shown():
    pieces, _, found = stream_text(TOK.encode("to be or not to be"), stop=["not"])
    assert found == "not", (
        f"with stop=['not'] the given update returned {found!r}, want 'not': it searches the text "
        f"decode_next returned, {''.join(pieces)!r}")
    assert "".join(pieces) == "to be or ", (
        f"with stop='not' the stream showed {''.join(pieces)!r}; it must end before the stop "
        "string")


# ---------------------------------------------------------------------------- task 2


@functools.cache
def reference_llm() -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference():
    return reference_llm()


@beside_the_student
def _new_engine(model_name=None):
    """A ``lab.AsyncLLM`` on the reference's weights, made where the lab's code runs (a fork of
    this process: the weights loaded once for the module are there already)."""
    kwargs = {} if model_name is None else {"model_name": model_name}
    # In one process: the tests read the engine core's state between steps.
    return lab.AsyncLLM(LLM(reference_llm().model, max_model_len=MAX_MODEL_LEN),
                        multiprocessing=False, **kwargs)


@pytest.fixture
def engine(reference):
    """A fresh AsyncLLM of the lab for each test, so that what one test leaves in an engine
    never fails the next. Each stream runs its own event loop; the engine's loop follows it."""
    eng = _new_engine(beside=lab)
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def collect(engine, prompt, params, request_id=None):
    """Every delta of one request, in order."""
    return [out async for out in engine.generate(prompt, params, request_id)]


@beside_the_student
def _stream(engine, prompt, params, request_id, record_aborts):
    aborted = []
    if record_aborts:
        engine.abort = aborted.append  # what generate aborts is recorded, not aborted
    outs = run(collect(engine, prompt, params, request_id))
    return outs, aborted


def stream(engine, prompt, params, request_id=None, *, record_aborts=False):
    """Every delta of one request from the engine's ``generate``, in order; with
    ``record_aborts`` also the ids ``generate`` passed to ``engine.abort``, which then aborts
    nothing."""
    outs, aborted = _stream(engine, prompt, params, request_id, record_aborts, beside=lab)
    return (outs, aborted) if record_aborts else outs


def steps(engine) -> int:
    return engine.engine_core.scheduler.stats.num_steps


@pytest.mark.points(2)
@pytest.mark.parametrize("params", [
    dict(temperature=0.0, max_tokens=20),
    dict(temperature=0.8, seed=7, n=2, max_tokens=12),
], ids=["greedy", "seeded-n2"])
def test_stream_equals_generate_token_for_token(engine, reference, params):
    sp = SamplingParams(**params)
    outs = stream(engine, "HAMLET.\n", sp)
    want = reference.generate("HAMLET.\n", sp, use_tqdm=False)[0].outputs
    assert outs and outs[-1].finished, (
        "the stream ended without an output with finished=True: generate must yield until the "
        "last output and then stop")
    assert [o.finished for o in outs].count(True) == 1, (
        "the stream went on after the finished output: stop right after yielding it")
    got: dict[int, list[int]] = {}
    for out in outs:
        for comp in out.outputs:
            got.setdefault(comp.index, []).extend(comp.token_ids)
    for comp in want:
        assert got.get(comp.index) == comp.token_ids, (
            f"choice {comp.index}: the stream's tokens {got.get(comp.index)} differ from "
            f"LLM.generate's {comp.token_ids}: yield every output of the collector, in order")
    held = wait_idle(engine, IDLE_TIMEOUT)
    assert held is None, held


async def _read_then_close(engine, params, k):
    agen = engine.generate("ROMEO.\n", params)
    outs = []
    async for out in agen:
        outs.append(out)
        if len(outs) == k:
            break
    await agen.aclose()  # what `async for` leaves to the garbage collector, made explicit
    return outs


async def _read_then_cancel(engine, params, k):
    """What came of cancelling the consumer's task after its k-th output: "cancelled" (its
    await raised CancelledError), "finished early" or "not cancelled"."""
    got = asyncio.Event()

    async def consume():
        n = 0
        async for _ in engine.generate("ROMEO.\n", params):
            n += 1
            if n == k:
                got.set()

    task = asyncio.create_task(consume())
    waiter = asyncio.create_task(got.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # the stream ended or failed before its k-th output: say why
        return "finished early"
    task.cancel()  # what a client disconnect does to the request's task
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "not cancelled"


@beside_the_student
def _go_away(engine, params, k, how):
    if how == "close":
        return run(_read_then_close(engine, params, k))
    return run(_read_then_cancel(engine, params, k))


@pytest.mark.points(2)
@pytest.mark.parametrize("how", ["close", "cancel"])
def test_a_consumer_that_goes_away_aborts_the_request_and_frees_its_blocks(engine, how):
    longest = MAX_MODEL_LEN - 16
    params = SamplingParams(temperature=0.0, max_tokens=longest, ignore_eos=True)
    before = steps(engine)
    if how == "close":
        outs = _go_away(engine, params, 3, how, beside=lab)
        finished = [getattr(o, "finished", None) for o in outs]
        assert finished == [False] * 3, (
            f"the stream gave {len(outs)} outputs (finished: {finished}) before its consumer "
            f"closed it; want 3 unfinished outputs of a {longest}-token request")
    else:
        what = _go_away(engine, params, 3, how, beside=lab)
        assert what != "finished early", (
            "the request finished before its consumer went away: max_tokens too small")
        assert what == "cancelled", (
            "the consumer's task was cancelled, but awaiting it did not raise CancelledError: "
            "generate must let the cancellation through (abort, then re-raise)")
    held = wait_idle(engine, IDLE_TIMEOUT)
    assert held is None, f"{held}: generate must call self.abort(request_id) on its way out"
    assert steps(engine) - before < longest, (
        f"the request ran to its end after its consumer went away ({how}): generate must "
        "abort it")


def test_a_finished_request_is_not_aborted(engine):
    outs, aborted = stream(engine, "HAMLET.\n", SamplingParams(temperature=0.0, max_tokens=4),
                           request_id="done-1", record_aborts=True)
    assert outs and getattr(outs[-1], "finished", False), (
        f"the stream of a 4-token request gave {len(outs)} outputs and none finished: "
        "generate must yield until the finished output")
    assert aborted == [], (
        f"generate aborted {aborted} after its last output: only a request whose finished "
        "output was not yielded is aborted")


def test_bad_input_raises_and_queues_nothing(engine):
    too_long = "x" * (MAX_MODEL_LEN + 4)
    with pytest.raises(ValueError):
        stream(engine, too_long, SamplingParams(max_tokens=4))
    held = wait_idle(engine, IDLE_TIMEOUT)
    assert held is None, f"{held}: a refused request must leave nothing in the engine"


# ---------------------------------------------------------------------------- task 3


def delta(index, text, ids, finish=None, prompt_ids=(1, 2, 3), stop_reason=None):
    comp = CompletionOutput(index, text, list(ids), finish, stop_reason)
    return RequestOutput("r", None, list(prompt_ids), [comp], finished=finish is not None)


async def replay(outputs, error=None):
    for out in outputs:
        await asyncio.sleep(0)
        yield out
    if error is not None:
        raise RuntimeError(error)


@beside_the_student
def _sse(outputs, error, request):
    serving = lab.OpenAIServingCompletion(None, "tiny")
    req = lab.CompletionRequest(prompt="x", stream=True, **request)

    async def go():
        gen = serving.completion_stream_generator(req, replay(outputs, error), "cmpl-1", 99)
        return [event async for event in gen]

    return run(go())


def sse(outputs, error=None, **request):
    """The events the lab's stream generator makes for ``outputs`` (then, with ``error``, a
    RuntimeError of that message)."""
    return _sse(outputs, error, request, beside=lab)


def payloads(events):
    """The JSON of every event but the last ([DONE]), after checking the framing."""
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n") and \
            event.count("\n") == 2, (
                f"{event!r} is not one server-sent event: use sse_event(payload), which "
                "writes 'data: <json>' and a blank line")
    assert events and events[-1] == "data: [DONE]\n\n", (
        f"the stream ends with {events[-1:]!r}: its last event must be sse_event('[DONE]'), "
        "where OpenAI clients stop reading")
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.points(2)
def test_each_delta_is_one_chunk_and_the_stream_ends_with_done():
    chunks = payloads(sse([delta(0, "He", [72, 101]), delta(0, "", [240]),
                           delta(0, "llo", [159, 108], finish="length")]))
    assert [c["choices"][0]["text"] for c in chunks] == ["He", "llo"], (
        f"chunks {chunks}: one chunk per delta that says something; a delta with no text and "
        "no finish_reason (text held back) sends nothing")
    assert chunks[0] == {
        "id": "cmpl-1", "object": "text_completion", "created": 99, "model": "tiny",
        "choices": [{"index": 0, "text": "He", "logprobs": None, "finish_reason": None,
                     "stop_reason": None}],
    }, (
        f"the first chunk is {chunks[0]}: it needs id, object, created, model and one choice "
        "with index, text, logprobs, finish_reason and stop_reason, nothing else")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", (
        f"the last chunk's finish_reason is {chunks[-1]['choices'][0]['finish_reason']!r}, "
        "want 'length': the finished delta's finish_reason")


def test_choices_usage_and_token_ids():
    outs = [delta(1, "a", [97]), delta(0, "b", [98]), delta(0, "", [99]),
            delta(1, "c", [100], finish="stop", stop_reason="\n"),
            delta(0, "d", [101], finish="length")]
    chunks = payloads(sse(outs, return_token_ids=True, stream_options={"include_usage": True}))
    assert [(c["choices"][0]["index"], c["choices"][0]["token_ids"]) for c in chunks[:-1]] == \
        [(1, [97]), (0, [98]), (0, [99]), (1, [100]), (0, [101])], (
            "with return_token_ids every delta is a chunk, its token ids included")
    firsts = [(c["choices"][0]["index"], c["choices"][0]["prompt_token_ids"])
              for c in chunks[:-1] if "prompt_token_ids" in c["choices"][0]]
    assert firsts == [(1, [1, 2, 3]), (0, [1, 2, 3])], (
        f"prompt_token_ids went with the chunks of choices {firsts}: only each choice's first, "
        "holding the prompt's ids")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}, (
        f"the last chunk is {chunks[-1]}: with include_usage it has no choices and the usage "
        "(prompt length, every delta's token ids)")
    envelope = {"id": "cmpl-1", "object": "text_completion", "created": 99, "model": "tiny"}
    assert {k: chunks[-1].get(k) for k in envelope} == envelope, (
        f"the usage chunk is {chunks[-1]}: it is a chunk like the others, with the stream's id, "
        "object, created and model")
    assert chunks[3]["choices"][0]["stop_reason"] == "\n", (
        f"the chunk of choice 1's finishing delta has stop_reason "
        f"{chunks[3]['choices'][0]['stop_reason']!r}, want '\\n': the delta's stop_reason")
    not_null = [c for c in chunks[:-1] if c.get("usage", "absent") is not None]
    assert not not_null, (
        f"chunk {not_null[0]} has no \"usage\": null: with include_usage every chunk but the "
        "last carries usage None, as OpenAI's streams do")
    plain = payloads(sse(outs[:2]))
    assert all("usage" not in c for c in plain), (
        f"chunks {plain}: without include_usage no chunk has a usage key")


def test_a_held_back_completion_does_not_hold_back_the_others():
    """One delta may carry several completions (n > 1): one with nothing to say yet is skipped,
    the next one still gets its chunk."""
    held = CompletionOutput(0, "", [240], None, None)  # half a character: nothing to show
    ready = CompletionOutput(1, "b", [98], None, None)
    both = RequestOutput("r", None, [1, 2, 3], [held, ready], finished=False)
    chunks = payloads(sse([both]))
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [(1, "b")], (
        f"chunks {chunks}: completion 0 held its text back, completion 1 had 'b' to send; skip "
        "the held one (continue), do not stop the delta's loop")


def test_an_engine_failure_mid_stream_is_an_error_event_then_done():
    chunks = payloads(sse([delta(0, "ab", [97, 98])], error="boom"))
    assert len(chunks) == 2 and "error" in chunks[1] and "boom" in chunks[1]["error"]["message"], (
        f"events {chunks}: an exception from the outputs is sent as engine_error_event(exc), "
        "then [DONE]")


_SERVERS: list[contextlib.ExitStack] = []  # what _start_server set up, in its process


@beside_the_student
def _start_server():
    """The real server with this lab's three pieces in place of the reference's, on a fresh
    engine, where the lab's code runs: its Unix socket and its engine. _stop_servers undoes it
    all, also what a start that failed half-way set up."""
    running = contextlib.ExitStack()
    _SERVERS.append(running)
    running.enter_context(mock.patch("mini_vllm.engine.output_processor.IncrementalDetokenizer",
                                     lab.IncrementalDetokenizer))
    running.enter_context(mock.patch(
        "mini_vllm.entrypoints.openai.api_server.OpenAIServingCompletion",
        lab.OpenAIServingCompletion))
    from mini_vllm.entrypoints.openai.api_server import build_app

    eng = _new_engine(model_name="tiny")
    server = ServerThread(build_app(eng), uds=True).start()
    running.callback(server.stop)
    return server.uds, eng


@beside_the_student
def _stop_servers():
    while _SERVERS:
        _SERVERS.pop().close()


@pytest.mark.points(3)
def test_the_real_server_streams_generate_s_tokens_and_frees_a_dropped_stream(reference):
    # Each piece once first: an unwritten task says so here, not as a 500.
    stream_text(TOK.encode("ok"))
    probe = _new_engine(beside=lab)
    try:
        stream(probe, "HAMLET.\n", SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        probe.shutdown()
    sse([delta(0, "ok", [111, 107], finish="stop")])
    try:
        uds, eng = _start_server(beside=lab)
        client = openai_client(uds, timeout=60)
        want = reference.generate("HAMLET.\n", SamplingParams(temperature=0.0, max_tokens=24),
                                  use_tqdm=False)[0].outputs[0]
        text, ids = "", []
        for chunk in client.completions.create(model="tiny", prompt="HAMLET.\n", max_tokens=24,
                                               temperature=0.0, stream=True,
                                               extra_body={"return_token_ids": True}):
            for choice in chunk.choices:
                text += choice.text
                ids += getattr(choice, "token_ids", None) or []
        assert (ids, text) == (want.token_ids, want.text), (
            f"the openai client read {text!r} from the stream; LLM.generate says {want.text!r}")
        longest = MAX_MODEL_LEN - 16
        with client.completions.create(model="tiny", prompt="ROMEO.\n", max_tokens=longest,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True}) as events:
            for i, _ in enumerate(events):
                if i == 3:
                    break
        held = wait_idle(eng, IDLE_TIMEOUT)
        assert held is None, f"{held}: a client that hangs up must leave no block behind"
    finally:
        _stop_servers(beside=lab)
