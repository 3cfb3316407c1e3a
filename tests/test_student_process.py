"""The student's process (course/labs/student_process.py): what crosses, what comes back, and
what a hostile student's process can and cannot make the test's side believe.

Each test starts a student's process on a small module written to a temporary folder, as the
loader does for a lab marked `student_process`."""

from __future__ import annotations

import json
import socket
import struct
import textwrap

import pytest
import torch

from course.labs import student_process as sp
from course.labs.loader import _load_module

MODULE = '''
import dataclasses, enum, os, sys, threading
import torch
from mini_vllm.request import RequestStatus

@dataclasses.dataclass
class Report:
    total: int
    items: list

    @property
    def mean(self):
        return self.total / len(self.items)

class Bag:
    def __init__(self):
        self.items = []
    def add(self, x):
        self.items.append(x)
        return len(self.items)

class Liar:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__

def liar():
    return Liar()

def liar_list():
    class L(list):
        def __eq__(self, other):
            return True
    return L([1])

def fill(cache, slots, value):
    cache[slots] = value          # in place, as a kernel writes a cache

def halves(t):
    return t[: len(t) // 2], t[len(t) // 2 :]   # views of the argument

def reorder(items):
    items.reverse()               # the argument list, in place

def report(xs):
    return Report(sum(xs), list(xs))

def status():
    return RequestStatus.RUNNING

def call_back(f, x):
    return f(x) + 1

def fails(kind):
    if kind == "value":
        raise ValueError("bad input: 3")
    if kind == "todo":
        raise NotImplementedError("lab 09-09, task 1: implement it")
    class OwnError(KeyError):
        pass
    raise OwnError("mine")

def shout(text):
    print(text)
    return None

def leave():
    os._exit(3)

class Node:
    def __init__(self, key):
        self.key, self.prev, self.next = key, None, None
    @property
    def twice(self):
        return 2 * self.key

def chain(n):
    nodes = [Node(i) for i in range(n)]
    for a, b in zip(nodes, nodes[1:]):
        a.next, b.prev = b, a
    return nodes

def take(items):
    return [x * 10 for x in items], list(items)   # the second pass sees what the first left

def warn(text):
    import logging
    logging.getLogger("starter").warning("careful: %s", text)
    logging.getLogger("starter").debug("quiet: %s", text)

def env(name):
    return os.environ.get(name)

class Counter:
    def __init__(self):
        self.n = 0
    def bump(self):
        self.n += 1
        return self.n
    def swap(self):
        self.bump = lambda: -1          # an instance rebinding its own method

def exact():
    raise ValueError("No free blocks")

def nap():
    import time
    time.sleep(600)

class Queue:
    def __init__(self):
        self.held = []
    def add(self, request):
        self.held.append(request)
    def step(self):               # a later call changes what an earlier one was given
        for r in self.held:
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        return self.held
    def computed(self):
        return [r.num_computed_tokens for r in self.held]

def shadow(request):
    request.is_finished = lambda: True   # a new attribute that would hide a method
    request.num_computed_tokens = 5

def spawn():
    pid = os.fork()               # a process of the student's own, left running
    if pid == 0:
        import time
        time.sleep(600)
        os._exit(0)
    return pid
'''


@pytest.fixture
def student(tmp_path):
    (tmp_path / "solution.py").write_text(textwrap.dedent(MODULE))
    proc = sp.StudentProcess(tmp_path, "solution", "09-09", _load_module)
    yield proc
    proc.stop()


def test_data_crosses_by_value_and_objects_stay_in_the_students_process(student):
    m = student.module
    bag = m.Bag()
    assert isinstance(bag, sp.Remote) and bag.add((1, "a")) == 1 and bag.add(None) == 2
    assert bag.items == [(1, "a"), None]
    assert isinstance(bag, m.Bag) and not isinstance(bag, m.Report)
    assert m.status() is __import__("mini_vllm.request").request.RequestStatus.RUNNING


def test_a_record_comes_back_as_data_with_its_properties(student):
    r = student.module.report([1, 2, 3])
    assert isinstance(r, sp.Struct) and (r.total, r.items, r.mean) == (6, [1, 2, 3], 2.0)
    assert r != student.module.report([3, 2, 1])
    assert r == student.module.report([1, 2, 3])
    assert isinstance(r, student.module.Report)


def test_in_place_writes_and_views_keep_their_meaning(student):
    cache = torch.zeros(8)
    student.module.fill(cache, torch.tensor([1, 5]), 7.0)
    assert cache.tolist() == [0, 7, 0, 0, 0, 7, 0, 0]
    a, b = student.module.halves(cache)
    assert a.data_ptr() == cache.data_ptr() and b.data_ptr() == cache.data_ptr() + 16
    b.fill_(1.0)  # a view of the test's own tensor: the test's tensor changes
    assert cache.tolist() == [0, 7, 0, 0, 1, 1, 1, 1]
    items = [1, 2, 3]
    student.module.reorder(items)
    assert items == [3, 2, 1]


def test_the_students_eq_decides_nothing(student):
    """An object that claims to equal everything equals nothing here, list or not."""
    m = student.module
    assert m.liar() != 1 and m.liar() != m.liar() and not (m.liar() == [1])
    assert m.liar_list() != [1]


def _request(request_id="a"):
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    return Request(request_id, [1, 2, 3], SamplingParams(), eos_token_id=None)


def test_the_tests_objects_stay_one_object_across_calls(student):
    """A request handed to a student's queue is mirrored: the queue's later calls change it
    here too, it comes back as the test's own object, and the test's changes reach it there."""
    req = _request()
    queue = student.module.Queue()
    queue.add(req)
    held = queue.step()
    assert held[0] is req and req.num_computed_tokens == 1, held
    assert list(req.output_token_ids) == [7] and req.all_token_ids == [1, 2, 3, 7]
    assert req.output_token_ids._x is req._output_token_ids  # still one list, shown by both
    req.num_computed_tokens = 10
    assert queue.computed() == [10]
    queue.step()
    assert req.num_computed_tokens == 11 and list(req.output_token_ids) == [7, 7]


def test_a_mirrored_object_takes_only_data_for_the_attributes_it_has(student):
    req = _request()
    student.module.shadow(req)
    assert req.num_computed_tokens == 5
    assert "is_finished" not in vars(req) and req.is_finished() is False


def test_a_function_of_the_test_is_called_back_with_data(student):
    seen = []

    def double(x):
        seen.append(x)
        return 2 * x

    assert student.module.call_back(double, 20) == 41 and seen == [20]


def test_errors_come_back_as_their_builtin_classes_with_the_students_line(student):
    with pytest.raises(ValueError, match="bad input: 3") as info:
        student.module.fails("value")
    assert info.value.student_where.startswith("solution.py:")
    with pytest.raises(NotImplementedError, match="lab 09-09, task 1"):
        student.module.fails("todo")
    with pytest.raises(KeyError) as info:
        student.module.fails("own")
    assert type(info.value).__name__ == "OwnError"
    with pytest.raises(AttributeError):
        student.module.no_such_name  # noqa: B018


def test_prints_reach_the_tests_output(student, capsys):
    student.module.shout("hello from the student")
    assert "hello from the student" in capsys.readouterr().out


def test_a_student_process_that_exits_fails_the_call_with_the_reason(student):
    with pytest.raises(sp.StudentProcessError, match=r"ended \(exit code 3\)"):
        student.module.leave()


def test_a_read_copies_a_whole_linked_structure_in_one_request(student, monkeypatch):
    """`read`: identity and cycles hold among the copies; they are of that moment only."""
    nodes = student.module.chain(3)
    asked = []
    monkeypatch.setattr(sp.Side, "send", lambda self, h, v, m=None, _send=sp.Side.send: (
        asked.append(h.get("op")), _send(self, h, v, m))[1])
    copy = student.read(nodes)
    assert asked == ["read"]
    assert [n.key for n in copy] == [0, 1, 2] and copy[0].next is copy[1]
    assert copy[1].prev is copy[0] and copy[2].next is None and copy[2].twice == 4
    assert isinstance(copy[0], student.module.Node)
    with pytest.raises(AttributeError, match="cannot be changed"):
        copy[0].key = 5
    nodes[0].key = 9  # a change in the student's process: the copy keeps its moment
    assert copy[0].key == 0 and student.read(nodes)[0].key == 9


def test_the_students_code_iterates_what_the_test_passes(student):
    """An iterator the test passes is iterated in the test's process, once, like any iterator."""
    assert student.module.take(reversed([1, 2, 3])) == ([30, 20, 10], [])
    assert student.module.take(x for x in (4, 5)) == ([40, 50], [])


def test_the_students_log_records_reach_the_tests_loggers(student, caplog):
    with caplog.at_level("INFO"):
        student.module.warn("3 blocks in use")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("starter", "WARNING", "careful: 3 blocks in use")]


def test_the_tests_environment_reaches_the_students_code(student, monkeypatch):
    assert student.module.env("COURSE_TRY") is None
    monkeypatch.setenv("COURSE_TRY", "seed 1")
    assert student.module.env("COURSE_TRY") == "seed 1"
    monkeypatch.delenv("COURSE_TRY")
    assert student.module.env("COURSE_TRY") is None


def test_a_function_read_before_a_patch_is_the_function_it_was(student, monkeypatch):
    """A method or function the test holds is the one it read (Python's own rule), and a patch
    the test makes is seen at the next read."""
    c = student.module.Counter()
    bump = c.bump
    assert bump() == 1 and c.bump() == 2 and c.bump is bump
    original = student.module.env
    monkeypatch.setattr(student.module, "env", lambda name: "patched")
    assert student.module.env("HOME") == "patched" and original("COURSE_NONE") is None
    monkeypatch.setattr(c, "bump", lambda: -1)
    assert c.bump() == -1 and bump() == 3


def test_an_error_keeps_the_students_message_and_shows_their_traceback(student):
    """The message alone (an anchored `match` holds); the student's frames are its cause."""
    with pytest.raises(ValueError, match=r"^No free blocks$") as info:
        student.module.exact()
    assert isinstance(info.value.__cause__, sp.StudentTraceback)
    assert "in exact" in str(info.value.__cause__)


# --- a hostile student's process: raw messages to the test's side --------------------------------


def _raw(header: dict, blobs=()) -> bytes:
    head = json.dumps(dict(header, blobs=[len(b) for b in blobs])).encode()
    return struct.pack("!I", len(head)) + head + b"".join(blobs)


@pytest.mark.parametrize("reply", [
    {"op": "reply", "value": {"$": "obj", "cls": "os:system", "v": {"$": "dict", "v": []}}},
    {"op": "reply", "value": {"$": "enum", "cls": "subprocess:Popen", "v": "x"}},
    {"op": "reply", "value": {"$": "yours", "h": 12345}},
    {"op": "reply", "value": {"$": "tensor", "s": 1, "o": 0, "size": [10], "stride": [1],
                              "dtype": "float32"}},
    {"op": "reply", "value": {"$": "pickle", "v": "gASVAAAA"}},
    {"op": "reply", "value": 1, "new": [{"id": 2, "b": 0}]},
    {"op": "call", "target": {"$": "yours", "h": 99}, "args": [],
     "kwargs": {"$": "dict", "v": []}},
    {"op": "reply", "value": 1, "mirrors": [[1, [], "os:system"]]},
    {"op": "reply", "value": 1, "mirrors": [[3, [["x", 1]]]]},
    {"op": "reply", "value": {"$": "mirror", "m": 3}},
], ids=["object-by-state", "untrusted-enum", "unknown-handle", "tensor-without-storage",
        "pickle", "storage-of-the-wrong-side", "call-of-a-test-object-it-never-got",
        "mirror-announced-by-the-student", "change-to-an-object-never-mirrored",
        "mirror-never-announced"])
def test_the_tests_side_refuses_what_the_protocol_does_not_allow(reply):
    """Whatever the student's side sends, the test's side builds data or refuses: nothing is
    imported, unpickled or called on its word."""
    mine, theirs = socket.socketpair()
    side = sp.Side(mine, student=False)
    theirs.sendall(_raw(reply, [b"\0" * 40]))
    with pytest.raises((sp.StudentProcessError, TypeError)):
        side.serve(until_reply=True)
    mine.close()
    theirs.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid: int, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_stopping_ends_what_the_students_process_started(student):
    """The student's process leads a process group of its own: stopping it ends the processes
    it started too (and a kill of its own group reaches no test)."""
    pid = student.module.spawn()
    assert _alive(pid)
    student.stop()
    assert _gone(pid), "a process the student's code started outlived its test"


def test_the_students_process_dies_with_the_tests_process(tmp_path):
    """A test's process that dies without stopping it (killed at a timeout, while the student's
    code is busy and would not notice the channel close) takes the student's process with it."""
    import os
    import signal

    (tmp_path / "solution.py").write_text(textwrap.dedent(MODULE))
    r, w = os.pipe()
    test_pid = os.fork()
    if test_pid == 0:  # a test's process: start the student's, say its pid, die
        try:
            proc = sp.StudentProcess(tmp_path, "solution", "09-09", _load_module)
            proc.module.env("HOME")  # it runs
            os.write(w, str(proc.pid).encode())
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(1)  # dies of it in a second, waiting on the student's nap
            proc.module.nap()
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        student_pid = int(f.read())
    os.waitpid(test_pid, 0)
    assert _gone(student_pid), "the student's process outlived the test's process"
