"""Graded tests of lab 04-01: the encoder's and decoder's tensor hooks, the core's input queue and
busy loop, and the client's verdict on a core that died.

The hooks are tested on messages with tensors of every dtype and shape: the frames a student's
encoder makes are decoded here by mini_vllm's decoder (and the other way round), so each side
is held to the wire format the other reads. The busy loop runs on a thread, on the shipped tiny
model, fed as the core process's input thread feeds it; its tokens are checked against
``LLM.generate``.

Where the lab's code runs in a process of its own (course/labs/student_process.py), what must
live beside it runs there: the encoder's frames (a memoryview does not cross; they come back as
bytes), the engine and its loop (the weights are loaded here before that process forks), the
faults a test injects into a step. What comes back is data: the frames the loop posted, encoded
there by mini_vllm's encoder and decoded and checked here.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from course.labs.student_process import beside_the_student
from mini_vllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from mini_vllm.engine.serial_utils import TENSOR_EXT, MsgpackDecoder, MsgpackEncoder
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.request import RequestStatus
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)

MAX_MODEL_LEN = 128
WAIT_S = 30.0  # the longest a scenario waits for the loop (the tiny model steps in milliseconds)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SHAPES = [(2, 3), (), (0, 4), (5,), (2, 1, 3)]


def make_tensor(dtype: torch.dtype, shape: tuple, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g,
                         dtype=dtype)


def body_refs(body: bytes):
    """The body with each extension shown as ``(code, its decoded msgpack)``."""
    return msgspec.msgpack.decode(
        body, ext_hook=lambda code, data: ("ext", code, msgspec.msgpack.decode(bytes(data))))


def same_tensor(got, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: decoded to a {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, sent {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, sent {tuple(want.shape)}")
    assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------------------- task 1


def _address(frame) -> int:
    import numpy as np

    return int(np.frombuffer(frame, dtype=np.uint8).__array_interface__["data"][0]) \
        if len(memoryview(frame)) else 0


@beside_the_student
def _encode(obj):
    """The student's frames of ``obj``, as bytes (a memoryview does not cross)."""
    return [bytes(f) for f in lab.MsgpackEncoder().encode(obj)]


def encode(obj) -> list[bytes]:
    frames = _encode(obj, beside=lab)
    assert isinstance(frames, list) and frames and isinstance(frames[0], bytes), (
        "MsgpackEncoder.encode did not return [body, *buffers]: the given encode returns them; "
        "did _enc_hook change self._buffers into something else?")
    return frames


@pytest.mark.points(2)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_travels_as_a_frame_of_its_own(dtype, shape):
    t = make_tensor(dtype, shape, seed=1)
    frames = encode({"t": t, "n": 3})
    assert len(frames) == 2, (
        f"a message with one tensor encoded to {len(frames)} frame(s): the tensor's bytes must "
        "be appended to self._buffers, one frame per tensor")
    ref = body_refs(frames[0])
    want_meta = [str(dtype).removeprefix("torch."), list(shape), 0]
    assert ref.get("n") == 3 and ref.get("t") == ("ext", TENSOR_EXT, want_meta), (
        f"the body holds {ref!r} for a {dtype} tensor of shape {list(shape)}: it must hold "
        f"Ext(TENSOR_EXT, msgpack of (dtype name, shape, frame index)), here "
        f"('ext', {TENSOR_EXT}, {want_meta!r})")
    assert frames[1] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), (
        "the frame does not hold the tensor's bytes, in C order")
    got = MsgpackDecoder().decode(frames)
    same_tensor(got["t"], t, f"a {dtype} tensor of shape {list(shape)} sent and decoded")


def test_several_tensors_each_get_their_index_in_order():
    a, b, c = make_tensor(torch.float32, (3, 4), 2), make_tensor(torch.int64, (7,), 3), \
        make_tensor(torch.bfloat16, (2, 2), 4)
    frames = encode({"first": a, "rest": [b, {"deep": c}], "k": "v"})
    assert len(frames) == 4, f"three tensors encoded to {len(frames)} frames, not 1 + 3"
    ref = body_refs(frames[0])
    indices = [ref["first"][2][2], ref["rest"][0][2][2], ref["rest"][1]["deep"][2][2]]
    assert indices == [0, 1, 2], (
        f"the tensors' frame indices are {indices}: each is its place in self._buffers, in the "
        "order msgspec meets them (0, 1, 2)")
    got = MsgpackDecoder().decode(frames)
    same_tensor(got["first"], a, "the first tensor")
    same_tensor(got["rest"][0], b, "the second tensor")
    same_tensor(got["rest"][1]["deep"], c, "the third tensor")


@beside_the_student
def _zero_copy():
    t = torch.arange(1024, dtype=torch.float32)
    frames = lab.MsgpackEncoder().encode({"t": t})
    return len(frames) == 2 and _address(frames[1]) == t.data_ptr(), type(frames[1]).__name__


@pytest.mark.points(2)
def test_a_contiguous_tensor_is_sent_from_its_own_memory():
    frames = encode({"t": torch.arange(1024, dtype=torch.float32)})
    assert len(frames) == 2 and len(frames[0]) < 64, (
        f"a 4 KiB tensor gave a body of {len(frames[0])} bytes: its bytes belong in a frame of "
        "their own, the body holds only the reference")
    aliased, kind = _zero_copy(beside=lab)
    assert aliased, (
        f"the frame of a contiguous CPU tensor (a {kind}) is a copy of its bytes: it must be a "
        "memoryview of the tensor's own memory (view it as uint8; .numpy() shares it)")


@pytest.mark.parametrize("how", ["transposed", "strided-slice", "row-slice", "requires-grad"])
def test_views_and_grad_tensors_send_exactly_their_elements(how):
    base = make_tensor(torch.float32, (6, 8), seed=5)
    t = {"transposed": base.T, "strided-slice": base[:, ::3], "row-slice": base[2:4],
         "requires-grad": base.clone().requires_grad_(True)}[how]
    frames = encode({"t": t})
    assert len(frames) == 2, f"a {how} tensor encoded to {len(frames)} frames, not 2"
    assert len(frames[1]) == t.numel() * t.element_size(), (
        f"a {how} tensor of {t.numel()} elements sent {len(frames[1])} bytes: send its "
        "elements in C order (contiguous first), not its whole storage")
    got = MsgpackDecoder().decode(frames)
    same_tensor(got["t"], t.detach(), f"a {how} tensor sent and decoded")


@beside_the_student
def _encode_unsupported():
    enc = lab.MsgpackEncoder()
    out = []
    for bad in (object(), complex(1, 2)):
        try:
            enc.encode({"x": bad})
        except Exception as exc:  # noqa: BLE001 - reported as data
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(None)
    return out


def test_anything_else_is_a_type_error_naming_it():
    t = torch.ones(3)
    frames = encode({"t": t})  # first the work: a tensor goes out
    assert len(frames) == 2, "a message with one tensor must encode to a body and one frame"
    same_tensor(MsgpackDecoder().decode(frames)["t"], t, "a tensor sent and decoded")
    for got, name in zip(_encode_unsupported(beside=lab), ("object", "complex")):
        assert got is not None, f"encoding a {name} raised nothing: _enc_hook must raise TypeError"
        assert got[0] == "TypeError" and name in got[1], (
            f"encoding a {name} raised {got[0]}: {got[1]!r}: raise TypeError naming its type")


# ---------------------------------------------------------------------------- task 2


def reference_frames(obj) -> list[bytes]:
    return [bytes(f) for f in MsgpackEncoder().encode(obj)]


@beside_the_student
def _decode(frames, writable):
    """The student's decoder on ``frames`` (as bytearrays when ``writable``); the warnings it
    raised."""
    frames = [frames[0], *(bytearray(f) if writable else f for f in frames[1:])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = lab.MsgpackDecoder().decode(frames)
    return got, [str(w.message) for w in caught]


@pytest.mark.points(2)
@pytest.mark.parametrize("writable", [True, False], ids=["bytearray", "bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_frames_decode_to_the_tensors_they_carry(dtype, shape, writable):
    t = make_tensor(dtype, shape, seed=6)
    got, caught = _decode(reference_frames({"t": t, "n": 1}), writable, beside=lab)
    assert got.get("n") == 1, f"the body decoded to {got!r}"
    same_tensor(got["t"], t, f"a {dtype} tensor of shape {list(shape)} decoded")
    assert not caught, (
        f"decoding warned: {caught[0]!r}: a read-only frame (bytes) must be copied into a "
        "bytearray before torch.frombuffer wraps it")


@beside_the_student
def _wraps_the_frame():
    """Whether a writable frame became the tensor's memory, and whether a bytes frame did
    not (writing into the tensor must not write into an immutable bytes object)."""
    t = torch.arange(16, dtype=torch.int32)
    frames = MsgpackEncoder().encode({"t": t})
    writable = bytearray(frames[1])
    got = lab.MsgpackDecoder().decode([frames[0], memoryview(writable)])["t"]
    writable[0:4] = (1234).to_bytes(4, "little")
    wrapped = int(got[0]) == 1234
    frozen = bytes(frames[1])
    got = lab.MsgpackDecoder().decode([frames[0], frozen])["t"]
    got[0] = 99
    return wrapped, frozen == bytes(frames[1])


@pytest.mark.points(2)
def test_a_writable_frame_becomes_the_tensor_s_memory_a_read_only_one_is_copied():
    t = torch.arange(16, dtype=torch.int32)
    got, _ = _decode(reference_frames({"t": t}), True, beside=lab)
    same_tensor(got["t"], t, "an int32 tensor decoded")
    wrapped, bytes_untouched = _wraps_the_frame(beside=lab)
    assert wrapped, (
        "a tensor decoded from a writable frame does not see a write into that frame: wrap the "
        "frame with torch.frombuffer (no copy) rather than copying its bytes")
    assert bytes_untouched, (
        "writing into a tensor decoded from a bytes frame changed the bytes object: copy a "
        "read-only frame into a bytearray first")


@beside_the_student
def _decode_unknown(code):
    body = msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(code, b"\x90")})
    try:
        lab.MsgpackDecoder().decode([body])
    except Exception as exc:  # noqa: BLE001 - reported as data
        return type(exc).__name__, str(exc)
    return None


def test_an_unknown_extension_is_a_value_error_naming_it():
    t = torch.arange(4)
    got, _ = _decode(reference_frames({"t": t}), True, beside=lab)  # first the work
    same_tensor(got["t"], t, "an int64 tensor decoded")
    raised = _decode_unknown(7, beside=lab)
    assert raised is not None, "a message with extension code 7 decoded: raise ValueError"
    assert raised[0] == "ValueError" and "7" in raised[1], (
        f"extension code 7 raised {raised[0]}: {raised[1]!r}: raise ValueError naming the code")


@beside_the_student
def _round_trip(obj):
    return lab.MsgpackDecoder().decode(lab.MsgpackEncoder().encode(obj))


@given(st.integers(0, len(DTYPES) - 1), st.lists(st.integers(0, 4), max_size=3),
       st.integers(0, 3))
def test_the_student_s_encoder_and_decoder_round_trip_any_tensor(d, shape, count):
    tensors = [make_tensor(DTYPES[(d + i) % len(DTYPES)], tuple(shape), seed=i)
               for i in range(count)]
    got = _round_trip({"ts": tensors, "k": len(tensors)}, beside=lab)
    assert got["k"] == count and len(got["ts"]) == count, f"decoded {got!r}"
    for i, (g, want) in enumerate(zip(got["ts"], tensors)):
        same_tensor(g, want, f"tensor {i} of {count} through your encoder and decoder")


# ---------------------------------------------------------------------------- the engine side


@functools.cache
def reference_llm() -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference():
    return reference_llm()


PROMPTS = {"a": [5, 9, 12, 40, 7], "b": [60, 61, 62], "c": [8, 8, 8, 8, 8, 8, 8, 8, 8]}


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected(reference, rid: str, max_tokens: int) -> list[int]:
    out = reference.generate({"prompt_token_ids": PROMPTS[rid]}, params(max_tokens),
                             use_tqdm=False)
    return out[0].outputs[0].token_ids


def add_item(specs):
    """An ADD item for the input queue: ``specs`` is ``[(request id, max_tokens)]``."""
    return (EngineCoreRequestType.ADD,
            [EngineCoreRequest(rid, PROMPTS[rid], params(n), time.monotonic())
             for rid, n in specs])


def abort_item(ids):
    return (EngineCoreRequestType.ABORT, EngineCoreAbort(list(ids), RequestStatus.FINISHED_ABORTED))


class Core:
    """A student's ``EngineCoreProc`` on the tiny model (in the student's process), what it
    posted (encoded by mini_vllm's encoder, as the core process sends it) and its loop thread."""

    def __init__(self, **knobs) -> None:
        self.llm = LLM(reference_llm().model, max_model_len=MAX_MODEL_LEN, **knobs)
        self.posted: list[list[bytes]] = []
        encoder = MsgpackEncoder()
        self.proc = lab.EngineCoreProc(
            self.llm, lambda out: self.posted.append([bytes(f) for f in encoder.encode(out)]))
        self.thread: threading.Thread | None = None
        self.raised: tuple[str, str] | None = None
        self.exception: Exception | None = None
        self.steps_seen: list = []  # step_started as each step saw it
        self.step_fn_calls = 0  # step_with_batch_queue calls (async scheduling)
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._decoded: list[EngineCoreOutputs] = []

    def put(self, *items) -> None:
        for item in items:
            self.proc.input_queue.put(item)

    def start(self) -> None:
        def loop():
            try:
                self.proc.run_busy_loop()
            except Exception as exc:  # noqa: BLE001 - reported as data
                self.raised = (type(exc).__name__, str(exc))
                self.exception = exc

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def outputs(self) -> list[EngineCoreOutputs]:
        """Everything posted so far, decoded (each post once)."""
        posted = list(self.posted)
        self._decoded += [self._decoder.decode(f) for f in posted[len(self._decoded):]]
        return self._decoded

    def wait(self, done, timeout: float = WAIT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done(self.outputs()) or (self.thread and not self.thread.is_alive()):
                return done(self.outputs())
            time.sleep(0.005)
        return False

    def stop(self) -> bool:
        """SHUTDOWN; whether the loop returned."""
        self.put(lab.SHUTDOWN)
        self.thread.join(timeout=10)
        return not self.thread.is_alive()

    def watch_steps(self) -> None:
        core = self.proc.engine_core
        step, step_with_batch_queue = core.step, core.step_with_batch_queue

        def watched():
            self.steps_seen.append(self.proc.step_started)
            return step()

        def watched_queue():
            self.step_fn_calls += 1
            return step_with_batch_queue()

        core.step, core.step_with_batch_queue = watched, watched_queue

    def result(self, **extra) -> dict:
        if isinstance(self.exception, NotImplementedError):
            raise self.exception  # a task still to do, reported as one
        core = self.proc.engine_core
        return {"posted": self.posted, "raised": self.raised, "in_core": list(self.proc._in_core),
                "step_started": self.proc.step_started, "steps_seen": self.steps_seen,
                "step_fn_calls": self.step_fn_calls,
                "in_scheduler": len(core.scheduler.requests),
                "blocks": int(core.num_blocks_in_use), **extra}


def decode_all(posted) -> list[EngineCoreOutputs]:
    decoder = MsgpackDecoder(EngineCoreOutputs)
    return [decoder.decode(f) for f in posted]


def tokens_of(outs: list[EngineCoreOutputs]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for out in outs:
        for o in out.outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def finished_of(outs: list[EngineCoreOutputs]) -> list[str]:
    return [o.request_id for out in outs for o in out.outputs if o.finished]


# ---------------------------------------------------------------------------- task 3


def _input_queue(script):
    """Run ``_process_input_queue`` on the items of ``script``; after each call, the scheduler's
    request ids, what the call returned (or raised) and the queue's length."""
    core = Core()
    seen = []
    for items, block, later in script:
        core.put(*items)
        for delay, delayed in later:  # items put by another thread, as the input thread does
            threading.Timer(delay, core.put, args=delayed).start()
        try:
            returned = ("returned", core.proc._process_input_queue(block))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as data
            returned = (type(exc).__name__, str(exc))
        sched = core.proc.engine_core.scheduler
        seen.append({"returned": returned, "waiting": [r.request_id for r in sched.waiting],
                     "requests": sorted(sched.requests), "queued": core.proc.input_queue.qsize()})
    return seen


def _items(described):
    """Queue items built from data: ("add", specs), ("abort", ids), ("shutdown",),
    ("error", message)."""
    out = []
    for kind, *args in described:
        if kind == "add":
            out.append(add_item(args[0]))
        elif kind == "abort":
            out.append(abort_item(args[0]))
        elif kind == "shutdown":
            out.append(lab.SHUTDOWN)
        else:
            out.append(ValueError(args[0]))
    return out


@beside_the_student
def _run_queue_script(script):
    return _input_queue([(_items(items), block, [(d, _items(i)) for d, i in later or ()])
                         for items, block, later in script])


@pytest.mark.points(2)
def test_every_waiting_add_and_abort_is_applied_in_order(reference):
    seen = _run_queue_script([
        ([("add", [("a", 4), ("b", 4)]), ("add", [("c", 4)]), ("abort", ["b"])], False, None),
        ([], False, None),
    ], beside=lab)
    first = seen[0]
    assert first["returned"] == ("returned", True), (
        f"_process_input_queue(block=False) with adds and an abort waiting gave "
        f"{first['returned']}: it must apply them and return True")
    assert first["requests"] == ["a", "c"], (
        f"after adds of a, b, c and an abort of b, the scheduler holds {first['requests']}: "
        "apply every item waiting, in order, in one call")
    assert first["queued"] == 0, f"{first['queued']} item(s) left in the queue: take them all"
    assert seen[1]["returned"] == ("returned", True) and seen[1]["requests"] == ["a", "c"], (
        f"with nothing queued, _process_input_queue(block=False) gave {seen[1]['returned']} "
        "and must return True at once, changing nothing")


def test_an_abort_after_its_add_in_the_same_batch_leaves_nothing(reference):
    seen = _run_queue_script([([("add", [("a", 4)]), ("abort", ["a"])], False, None)],
                             beside=lab)
    assert seen[0]["returned"] == ("returned", True) and seen[0]["requests"] == [], (
        f"an add of a then an abort of a left {seen[0]['requests']} "
        f"(returned {seen[0]['returned']}): apply the items in the order they came")


@pytest.mark.points(2)
def test_block_waits_for_the_first_item_and_not_after_it(reference):
    # SHUTDOWN at 3 s ends a call that would wait for ever.
    seen = _run_queue_script([([], True, [(0.2, [("add", [("a", 4)])]),
                                          (1.5, [("add", [("b", 4)])]),
                                          (3.0, [("shutdown",)])])], beside=lab)
    assert seen[0]["returned"] == ("returned", True) and seen[0]["requests"] == ["a"], (
        f"_process_input_queue(block=True), an add of a arriving 0.2 s later and one of b "
        f"1.5 s later: it returned {seen[0]['returned']} holding {seen[0]['requests']}, not "
        "True holding ['a']: with block, wait for the first item only, then take what is "
        "already there without waiting")


def test_shutdown_returns_false_and_leaves_what_follows(reference):
    seen = _run_queue_script([
        ([("add", [("a", 4)]), ("shutdown",), ("add", [("b", 4)])], False, None)], beside=lab)
    assert seen[0]["returned"] == ("returned", False), (
        f"SHUTDOWN in the queue: _process_input_queue returned {seen[0]['returned']}, "
        "not False")
    assert seen[0]["requests"] == ["a"] and seen[0]["queued"] == 1, (
        f"with add a, SHUTDOWN, add b queued, the scheduler holds {seen[0]['requests']} and "
        f"{seen[0]['queued']} item(s) stay queued: apply what comes before SHUTDOWN, leave "
        "what follows it")


def test_an_unreadable_message_is_a_runtime_error(reference):
    seen = _run_queue_script([([("add", [("a", 4)]), ("error", "bad frame")], False, None)],
                             beside=lab)
    kind, message = seen[0]["returned"]
    assert seen[0]["requests"] == ["a"], (
        f"the add before the error was not applied (the scheduler holds {seen[0]['requests']})")
    assert kind == "RuntimeError" and "bad frame" in message, (
        f"an exception in the input queue gave {kind}: {message!r}: raise RuntimeError with "
        "its message")


# ---------------------------------------------------------------------------- task 4


@beside_the_student
def _serve(specs, idle_s=0.3, knobs=None):
    """Start the loop, add ``specs`` at once, wait for each to finish, stay idle ``idle_s``,
    then shut down."""
    core = Core(**(knobs or {}))
    core.watch_steps()
    core.start()
    core.put(add_item(specs))
    finished = core.wait(lambda outs: len(finished_of(outs)) >= len(specs))
    before_idle = len(core.posted)
    time.sleep(idle_s)
    idle_posts = len(core.posted) - before_idle
    returned = core.stop()
    return core.result(finished=finished, idle_posts=idle_posts, returned=returned)


@pytest.mark.points(3)
def test_the_loop_serves_every_request_with_generate_s_tokens(reference):
    specs = [("a", 12), ("b", 5), ("c", 9)]
    run = _serve(specs, beside=lab)
    assert run["raised"] is None, f"run_busy_loop raised {run['raised'][0]}: {run['raised'][1]}"
    outs = decode_all(run["posted"])
    assert run["finished"], (
        f"the loop posted {len(outs)} output(s) in {WAIT_S:.0f} s and not every request "
        "finished: step while the core has unfinished requests, post each step's outputs")
    got = tokens_of(outs)
    for rid, n in specs:
        want = expected(reference, rid, n)
        assert got.get(rid) == want, (
            f"request {rid}: the posted outputs carry tokens {got.get(rid)}, LLM.generate "
            f"makes {want}: post every step's outputs once, in order")
    assert sorted(finished_of(outs)) == sorted(r for r, _ in specs), (
        f"finished outputs for {finished_of(outs)}: one per request")
    steps = [o for o in outs if o.outputs]
    assert all(o.load is not None for o in steps), (
        "a step's post has no load: post EngineCoreOutputs(outputs=..., timestamp=..., "
        "load=self._snapshot())")
    stamps = [o.timestamp for o in outs]
    assert all(s > 0 for s in stamps) and stamps == sorted(stamps), (
        "the posts' timestamps are not time.monotonic() at each post")
    assert run["returned"], "the loop did not return after SHUTDOWN"
    assert run["in_core"] == [] and run["blocks"] == 0, (
        f"after every request finished, _in_core holds {run['in_core']} and {run['blocks']} "
        "block(s) are in use: drop each finished output's request from self._in_core")


def test_under_async_scheduling_the_loop_steps_with_step_fn(reference):
    specs = [("a", 12), ("b", 5), ("c", 9)]
    run = _serve(specs, knobs={"async_scheduling": True}, beside=lab)
    assert run["raised"] is None, f"run_busy_loop raised {run['raised'][0]}: {run['raised'][1]}"
    outs = decode_all(run["posted"])
    failed = [o.error for o in outs if o.failed]
    assert not failed, (
        f"under async scheduling a step failed: {failed[0]}. step_fn() returns None when it "
        "only started a step: nothing to post or check then, go round")
    assert run["finished"] and run["step_fn_calls"] > 0, (
        f"the loop made {run['step_fn_calls']} step_with_batch_queue call(s) and not every "
        "request finished: step with core.step_fn(), which under async scheduling is "
        "step_with_batch_queue")
    got = tokens_of(outs)
    for rid, n in specs:
        want = expected(reference, rid, n)
        assert got.get(rid) == want, (
            f"request {rid}: the posted outputs carry tokens {got.get(rid)}, LLM.generate "
            f"makes {want}")
    empty = [o for o in outs if not o.outputs and not o.failed]
    assert not empty, (
        f"{len(empty)} post(s) with no output while requests ran: a turn whose step_fn() "
        "returned None has nothing to post")


@pytest.mark.points(2)
def test_an_idle_loop_waits_and_a_step_s_age_is_kept_only_while_it_runs(reference):
    run = _serve([("a", 6)], idle_s=0.3, beside=lab)
    assert run["finished"] and run["raised"] is None, (
        f"the request did not finish (raised: {run['raised']})")
    assert run["idle_posts"] <= 1, (
        f"the loop posted {run['idle_posts']} time(s) in 0.3 s with nothing to run: an idle "
        "loop must block on the input queue (block=True when the core has no unfinished "
        "request), not spin")
    seen = run["steps_seen"]
    assert seen and all(isinstance(s, float) and s > 0 for s in seen), (
        f"during the steps step_started was {seen[:4]}: set self.step_started = "
        "time.monotonic() before each step")
    assert run["step_started"] is None, (
        f"between steps step_started is {run['step_started']}: set it back to None after the "
        "step (the heartbeat would report an ever older step, a hang)")


@beside_the_student
def _abort_mid_stream():
    core = Core()
    core.start()
    core.put(add_item([("a", 100)]))
    started = core.wait(lambda outs: len(tokens_of(outs).get("a", [])) >= 3)
    core.put(abort_item(["a"]))
    idle = core.wait(lambda outs: any(
        o.load is not None and not o.outputs and o.load.num_running_reqs == 0
        and o.load.num_kv_blocks_in_use == 0 for o in outs), timeout=5.0)
    core.put(add_item([("b", 4)]))  # the idle loop serves on
    served_on = core.wait(lambda outs: "b" in finished_of(outs))
    returned = core.stop()
    return core.result(started=started, idle=idle, served_on=served_on, returned=returned)


@pytest.mark.points(2)
def test_an_abort_mid_stream_frees_the_request_and_says_so(reference):
    run = _abort_mid_stream(beside=lab)
    assert run["started"] and run["raised"] is None, (
        f"the request made no 3 tokens (raised: {run['raised']})")
    outs = decode_all(run["posted"])
    made = len(tokens_of(outs).get("a", []))
    assert made < 100 and "a" not in finished_of(outs), (
        f"an aborted request made {made} tokens and finished: apply the abort before the next "
        "step (_process_input_queue every turn, without blocking while busy)")
    assert run["idle"], (
        "after the abort the loop posted no output with the engine's load at 0 requests and 0 "
        "blocks: with no unfinished request left, post EngineCoreOutputs(timestamp=..., "
        "load=self._snapshot()) so the client sees the blocks go back")
    assert all(o.timestamp > 0 for o in outs), (
        "a post has no timestamp: every post, the idle one too, carries "
        "timestamp=time.monotonic()")
    assert run["served_on"] and tokens_of(outs).get("b") == expected(reference, "b", 4), (
        f"after the abort left it idle, the loop served request b as {tokens_of(outs).get('b')}"
        f" (finished: {run['served_on']}): an idle loop goes round and waits for input, it "
        "does not return")
    assert run["in_scheduler"] == 0 and run["blocks"] == 0 and run["returned"], (
        f"at the end the scheduler holds {run['in_scheduler']} request(s) and "
        f"{run['blocks']} block(s)")


@beside_the_student
def _failing_step(fail_at):
    """Step ``fail_at`` (counted from 1) raises; then a new request is served."""
    core = Core()
    engine_core = core.proc.engine_core
    step, calls = engine_core.step, [0]

    def failing():
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("a planted fault")
        return step()

    engine_core.step = failing
    core.start()
    core.put(add_item([("a", 2), ("b", 20)]))
    failed = core.wait(lambda outs: any(o.error for o in outs))
    engine_core.step = step  # the old core's own step back (a rebuilt core has its own)
    core.put(add_item([("c", 6)]))
    served_on = core.wait(lambda outs: "c" in finished_of(outs))
    returned = core.stop()
    return core.result(failed=failed, served_on=served_on, returned=returned)


@pytest.mark.points(3)
def test_a_failed_step_fails_the_requests_the_core_holds_and_the_loop_serves_on(reference):
    run = _failing_step(4, beside=lab)
    assert run["raised"] is None, (
        f"run_busy_loop raised {run['raised'][0]}: {run['raised'][1]}: a step that raises must "
        "fail its requests, not end the loop")
    outs = decode_all(run["posted"])
    errors = [o for o in outs if o.error]
    assert run["failed"] and len(errors) == 1, (
        f"a step raised and {len(errors)} post(s) carried an error: post one "
        "EngineCoreOutputs with failed, error and error_kind='step'")
    err = errors[0]
    assert err.error_kind == "step" and "RuntimeError: a planted fault" in err.error, (
        f"the failure was posted as error_kind={err.error_kind!r}, error={err.error!r}: "
        "error_kind 'step', error 'the engine step failed: RuntimeError: a planted fault'")
    assert err.failed == ["b"], (
        f"the failure names {err.failed}: a had finished at step 2 and must not be named (drop "
        "finished requests from self._in_core); b was in the core and failed")
    assert err.load is not None and err.timestamp > 0, (
        "the failure's post has no load or no timestamp: timestamp=time.monotonic(), "
        "load=self._snapshot()")
    assert run["served_on"], (
        "after the failed step, a new request never finished: the loop must go on serving")
    want = expected(reference, "c", 6)
    assert tokens_of(outs).get("c") == want, (
        f"after the failed step, request c made {tokens_of(outs).get('c')}, LLM.generate "
        f"makes {want}")
    assert run["step_started"] is None, "step_started was left set after the failed step"


@beside_the_student
def _chunked(budget):
    """The loop with a token budget smaller than the prompts: the first steps of a prompt
    make progress and no token."""
    core = Core(max_num_batched_tokens=budget)
    core.start()
    core.put(add_item([("c", 5), ("a", 5)]))
    finished = core.wait(lambda outs: len(finished_of(outs)) >= 2)
    returned = core.stop()
    return core.result(finished=finished, returned=returned)


def test_steps_that_gain_no_token_but_make_progress_are_not_a_stall(reference):
    run = _chunked(2, beside=lab)
    outs = decode_all(run["posted"])
    errors = [o.error for o in outs if o.error]
    assert not errors, (
        f"prompts prefilled 2 tokens a step (no token for several steps, progress every step) "
        f"were failed: {errors[0]!r}: only an empty step that leaves the progress state as the "
        "last empty one left it is a stall")
    assert run["finished"] and run["raised"] is None, (
        f"the chunked requests did not finish (raised: {run['raised']})")
    got = tokens_of(outs)
    for rid in ("c", "a"):
        assert got.get(rid) == expected(reference, rid, 5), (
            f"request {rid}, prefilled 2 tokens a step: the posts carry {got.get(rid)}, "
            f"LLM.generate makes {expected(reference, rid, 5)}")


@beside_the_student
def _stalling_step():
    core = Core()
    core.proc.engine_core.step = lambda: []  # schedules nothing, changes nothing
    core.start()
    core.put(add_item([("a", 4)]))
    failed = core.wait(lambda outs: any(o.error for o in outs), timeout=5.0)
    returned = core.stop()
    result = core.result(failed=failed, returned=returned)
    result["posted"] = result["posted"][:50]
    return result


def test_a_step_that_changes_nothing_twice_is_a_stall_not_a_spin(reference):
    run = _stalling_step(beside=lab)
    outs = decode_all(run["posted"])
    errors = [o for o in outs if o.error]
    assert run["failed"] and errors, (
        f"steps that returned nothing and changed nothing ran for 5 s ({len(run['posted'])}+ "
        "posts) without an error: a second step with no output and the same "
        "self._progress_state() must fail as RuntimeError(core.stall_message())")
    err = errors[0]
    assert err.error_kind == "step" and "stalled" in err.error and err.failed == ["a"], (
        f"the stall was posted as error_kind={err.error_kind!r}, error={err.error!r}, "
        f"failed={err.failed}: fail it as a step raising RuntimeError(core.stall_message())")
    assert len([o for o in outs if not o.error]) <= 2, (
        "the stall was declared after more than two empty steps: the second one with the "
        "same progress state is the stall")


@beside_the_student
def _deaf_core():
    core = Core()
    core.start()
    core.put(add_item([("a", 3)]))
    core.wait(lambda outs: "a" in finished_of(outs))
    core.put(ValueError("a frame that is not msgpack"))
    core.thread.join(timeout=10)
    return core.result(alive=core.thread.is_alive())


def test_unreadable_input_ends_the_loop_with_its_error(reference):
    run = _deaf_core(beside=lab)
    assert not run["alive"], (
        "an exception in the input queue left the loop running: let the RuntimeError from "
        "_process_input_queue end it (the process around the loop tells the client)")
    assert run["raised"] and run["raised"][0] == "RuntimeError" and "not msgpack" in \
        run["raised"][1], (
        f"the loop ended with {run['raised']}: the input's error must propagate as "
        "_process_input_queue raised it")


# ---------------------------------------------------------------------------- task 5


def heartbeat(step_age: float = 0.0) -> EngineCoreOutputs:
    return EngineCoreOutputs(timestamp=time.monotonic(), step_age=step_age)


@pytest.mark.points(2)
def test_the_core_s_own_words_and_a_step_too_long():
    fatal = EngineCoreOutputs(fatal=True, error="the engine core failed to start: OSError: x")
    assert lab.core_failure(fatal, 0.0, None, 60.0) == fatal.error, (
        "a fatal message must be taken in its own words: return out.error")
    assert lab.core_failure(EngineCoreOutputs(fatal=True), 0.0, None, 60.0) == \
        "the engine core failed", "a fatal message with no error: 'the engine core failed'"
    why = lab.core_failure(heartbeat(61.4), 0.0, None, 60.0)
    assert isinstance(why, str) and "61 s" in why, (
        f"a heartbeat whose step has run 61.4 s (limit 60) gave {why!r}: say it, with the age "
        "in whole seconds ('one engine step has run for 61 s')")
    assert lab.core_failure(EngineCoreOutputs(fatal=True, error="gone", step_age=99.0), 0.0,
                            None, 60.0) == "gone", "fatal comes first, before the step's age"
    for out, limit in ((heartbeat(59.0), 60.0), (heartbeat(60.0), 60.0), (heartbeat(1e6), None),
                       (heartbeat(), 60.0)):
        assert lab.core_failure(out, 0.0, None, limit) is None, (
            f"a heartbeat with step_age {out.step_age} and limit {limit} was taken for "
            "dead: a core that talks within its limits is alive")


@pytest.mark.points(2)
def test_a_dead_or_silent_process():
    for code, words in ((-9, "killed by signal 9"), (1, "exit code 1"), (0, "exit code 0")):
        why = lab.core_failure(None, 0.2, code, 60.0)
        assert why == f"the engine core process died ({words})", (
            f"the process exited with {code} and core_failure said {why!r}: "
            f"'the engine core process died ({words})' (describe_exit)")
    why = lab.core_failure(None, lab.HEARTBEAT_TIMEOUT_S + 0.5, None, 60.0)
    assert isinstance(why, str) and f"{lab.HEARTBEAT_TIMEOUT_S:.0f} s" in why, (
        f"{lab.HEARTBEAT_TIMEOUT_S + 0.5} s without a word gave {why!r}: a silent core is "
        "dead; say the limit in whole seconds")
    why = lab.core_failure(None, 30.0, -9, 60.0)
    assert why == "the engine core process died (killed by signal 9)", (
        f"a process that was killed and is silent gave {why!r}: its exit says more than its "
        "silence: check the exit first")
    for silent in (lab.HEARTBEAT_TIMEOUT_S - 0.5, lab.HEARTBEAT_TIMEOUT_S):
        assert lab.core_failure(None, silent, None, 60.0) is None, (
            f"a core silent for {silent} s (HEARTBEAT_TIMEOUT_S = {lab.HEARTBEAT_TIMEOUT_S}) "
            "was taken for dead: only silence longer than the limit is")
    assert lab.core_failure(heartbeat(), 30.0, None, 60.0) is None, (
        "a heartbeat that just came was taken for silence: when out is not None the core talks")
