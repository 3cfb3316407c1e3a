"""The student's code in a process of its own: a test, its assertions and its verdict stay in the
test's process, and the student's module is reached only as data.

Why: code that shares a process with a test can forge that test's result (write its report,
replace its assertions, exit after a counterfeit). For a lab with `student_process = true` in
course/labs/labs.toml, the grader (and any pytest run with COURSE_STUDENT_PROCESS=1) loads the
lab's implementation in a process forked for each test, and `lab.<name>` is a proxy to it.

What crosses, and how (the rules hold in both directions; the test's side never unpickles,
imports or runs anything the student's side names):

- Data by value: None, bool, int, float, str, bytes, ranges, slices, and lists, tuples, dicts,
  sets of data;
  torch dtypes and devices; enum members of `mini_vllm` and of the course.
- Tensors (CPU) by storage: each storage that crosses is mirrored, one copy on each side, and
  every message carries the bytes of the mirrored storages its sender changed since the last
  one. So an in-place write (a cache filled by a kernel), a view (a split cache) and a tensor
  kept by an object keep their meaning across calls.
- Any other object of the student's process stays there: the test holds a `Remote` whose
  attribute reads, calls, items, len, iteration and isinstance are requests answered with data.
  Two Remotes of one object are the same Remote (so `is` works). `==` between Remotes compares
  data snapshots here (dataclass fields, by value), never by the student's `__eq__`: an object
  that claims to equal everything equals nothing it is not.
- The test's objects passed to student code: data as above; instances of mini_vllm's and the
  course's classes mirrored (a request handed to a student's scheduler): a copy there, kept in
  step with this one by every later message, in both directions, and named by its id when it
  crosses again, so it stays one object (`is` works); functions and other callables stay here
  and the student's side gets a handle that calls back.
- An exception raised by student code comes back as the same builtin class (or a class made
  here that carries the student's class name and derives from its nearest builtin base), with
  its message and the student's file and line; `mini_vllm`'s own exception classes are kept.

The student's process is a fork of the test's process, started on the first touch of `lab`
in a test and killed, with its process group, when the test ends (`stop_all`) or the test's
process dies; it holds no descriptor of the test's but its end of the channel. (In grading, the
test's process is the pytest session itself: course.grading.plugin.)
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import enum
import importlib
import json
import logging
import operator
import os
import signal
import socket
import struct
import sys
import threading
import traceback
import types
from pathlib import Path

ENV_VAR = "COURSE_STUDENT_PROCESS"
MAX_HEADER = 64 << 20  # bytes of JSON in one message
MAX_BLOBS = 1 << 30  # bytes of tensor data in one message
MAX_DEPTH = 64  # nesting of one value
MAX_READ_OBJECTS = 200_000  # objects in one `read`
MAX_WRITE = 1 << 16  # characters of one write of the student's stdout or stderr
# Modules whose classes and enums the test's side rebuilds from their name (its own code).
TRUSTED_MODULES = ("mini_vllm", "course", "torch")


IN_STUDENT_PROCESS = False  # True in the student's process itself


class StudentProcessError(Exception):
    """The student's process ended, or sent what the protocol does not allow."""


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def every_lab() -> bool:
    """COURSE_STUDENT_PROCESS=all: every lab, marked or not (to try a lab before marking it)."""
    return os.environ.get(ENV_VAR, "") == "all"


def _trusted(module_name: str) -> bool:
    return module_name.split(".")[0] in TRUSTED_MODULES


# --- framing ------------------------------------------------------------------------------------


class Reader:
    """The receiving end of the channel, buffered: a message's length, header and blobs come
    in as few reads as the socket allows (one, for a short message)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(n - len(self.buf), 1 << 16))
            if not chunk:
                raise EOFError
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def send_message(sock: socket.socket, header: dict, blobs: list[bytes]) -> None:
    head = json.dumps(dict(header, blobs=[len(b) for b in blobs])).encode()
    sock.sendall(struct.pack("!I", len(head)) + head)
    for b in blobs:
        sock.sendall(b)


def recv_message(reader: Reader) -> tuple[dict, list[bytes]]:
    (n,) = struct.unpack("!I", reader.exact(4))
    if n > MAX_HEADER:
        raise StudentProcessError(f"a message header of {n} bytes (the limit is {MAX_HEADER})")
    try:
        header = json.loads(reader.exact(n))
    except (ValueError, RecursionError) as exc:
        raise StudentProcessError(f"a message that is not JSON ({exc})") from None
    sizes = header.get("blobs") if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(type(s) is int and s >= 0 for s in sizes):
        raise StudentProcessError("a message without a valid list of blob sizes")
    if sum(sizes) > MAX_BLOBS:
        raise StudentProcessError(f"{sum(sizes)} bytes of tensor data in one message")
    return header, [reader.exact(s) for s in sizes]


# --- values -------------------------------------------------------------------------------------

_DTYPES: dict[str, object] = {}


def _dtypes() -> dict[str, object]:
    if not _DTYPES:
        import torch

        for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                     "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "complex64",
                     "uint16", "uint32", "uint64"):
            if hasattr(torch, name):
                _DTYPES[name] = getattr(torch, name)
    return _DTYPES


class _Storages:
    """The storages mirrored on this side: id -> (the storage, its bytes as last synced).

    A storage that nothing of this side uses any more but this table is dropped when this side
    next sends, and the message tells the other side (`drop`). The protocol is synchronous (one
    side speaks at a time, the other answers), so the other side learns of the drop before it
    sends anything that could name the storage."""

    def __init__(self, first_id: int):
        self.by_id: dict[int, tuple[object, object]] = {}
        self.ids: dict[int, int] = {}  # data_ptr -> id
        self.next_id = first_id  # the two sides count apart (odd for one, even for the other)

    @staticmethod
    def _bytes_view(storage):
        import torch

        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def _add(self, sid: int, storage, seen) -> None:
        self.by_id[sid] = (storage, seen)
        self.ids[storage.data_ptr()] = sid

    def id_of(self, storage, blobs: list[bytes], new: list) -> int:
        sid = self.ids.get(storage.data_ptr())
        # Empty storages share an address (often 0) without being one storage: never reuse one
        # (the other side may have dropped it already).
        if sid is not None and sid in self.by_id and storage.nbytes() and \
                self.by_id[sid][0].nbytes() == storage.nbytes():
            return sid
        sid, self.next_id = self.next_id, self.next_id + 2
        view = self._bytes_view(storage)
        self._add(sid, storage, view.clone())
        new.append({"id": sid, "b": len(blobs)})
        blobs.append(view.numpy().tobytes())
        return sid

    def drop_dead(self) -> list[int]:
        dead = [sid for sid, (storage, _) in self.by_id.items() if _only_ours(storage)]
        for sid in dead:
            del self.by_id[sid]
        if dead:
            live = set(self.by_id)
            self.ids = {ptr: sid for ptr, sid in self.ids.items() if sid in live}
        return dead

    def changed(self, blobs: list[bytes]) -> list[dict]:
        import torch

        out = []
        for sid, (storage, seen) in self.by_id.items():
            now = self._bytes_view(storage)
            if not torch.equal(now, seen):
                seen.copy_(now)
                out.append({"id": sid, "b": len(blobs)})
                blobs.append(now.numpy().tobytes())
        return out

    def receive(self, new: list, sync: list, drop: list, blobs: list[bytes],
                theirs: int) -> None:
        """`theirs`: the parity of the ids the other side may announce."""
        import torch

        for entry in new:
            sid, data = self._entry(entry, blobs)
            if sid % 2 != theirs or sid in self.by_id:
                raise StudentProcessError(f"storage {sid} announced by the wrong side or twice")
            storage = torch.UntypedStorage(len(data))
            view = self._bytes_view(storage)
            if data:
                view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._add(sid, storage, view.clone())
        for entry in sync:
            sid, data = self._entry(entry, blobs)
            if sid not in self.by_id:
                raise StudentProcessError(f"bytes for storage {sid}, which is not mirrored")
            storage = self.by_id[sid][0]
            if len(data) != storage.nbytes():
                raise StudentProcessError(f"storage {sid} changed its size")
            view = self._bytes_view(storage)
            if data:
                view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self.by_id[sid][1].copy_(view)
        # Last: the bytes the other side wrote before it let a storage go still arrive.
        for sid in drop:
            if type(sid) is int and sid in self.by_id:
                storage = self.by_id.pop(sid)[0]
                if self.ids.get(storage.data_ptr()) == sid:
                    del self.ids[storage.data_ptr()]

    @staticmethod
    def _entry(entry, blobs) -> tuple[int, bytes]:
        if not (isinstance(entry, dict) and type(entry.get("id")) is int
                and type(entry.get("b")) is int and 0 <= entry["b"] < len(blobs)):
            raise StudentProcessError("a malformed storage entry")
        return entry["id"], blobs[entry["b"]]


def _only_ours(storage) -> bool:
    """Whether the storage table's own reference is the storage's only use (no tensor holds
    it); where torch cannot tell, never."""
    try:
        import torch

        return torch._C._storage_Use_Count(storage._cdata) <= 1
    except Exception:  # noqa: BLE001 - a private call of torch's; without it, keep everything
        return False


class _Message:
    """What one message carries besides its JSON: the blobs (tensor bytes), the storages it
    announces and, for a call's arguments, the lists, dicts, sets and records sent by value
    (each with a copy id, so that the changes the call makes come back to them; the course's
    objects are mirrored instead: Side._mirror)."""

    def __init__(self, track: bool = False):
        self.blobs: list[bytes] = []
        self.new: list = []
        self.track = track
        self.copies: dict[int, object] = {}  # copy id -> the original, on the sending side
        self.copy_ids: dict[int, int] = {}  # id(original) -> copy id
        self.back: dict[int, int] = {}  # id(a received copy) -> its copy id (after a call)
        self.graph: dict[int, int] | None = None  # in a read: id(object) -> its node number
        self.graph_order: list = []

    def copy(self, value) -> int:
        cid = len(self.copies)
        self.copies[cid] = value
        self.copy_ids[id(value)] = cid
        return cid


class Side:
    """One end of the channel: the codec, the objects the other side holds handles of, the
    mirrored storages, and the request loop (both sides serve requests while they wait for a
    reply, so that calls nest: test -> student -> callback -> student ...)."""

    def __init__(self, sock: socket.socket, student: bool):
        self.sock = sock
        self.reader = Reader(sock)
        self.student = student
        self.exported: dict[int, object] = {}  # handle -> object of this side
        self.export_ids: dict[int, int] = {}  # id(object) -> handle
        self.next_handle = 1
        self.storages = _Storages(1 if student else 2)
        self.remotes: dict[int, object] = {}  # the other side's handle -> its proxy here
        self.lock = threading.Lock()  # a message is sent whole (the student's threads print)
        self.env = dict(os.environ._data)  # the environment as the other side last saw it
        self.log_level = logging.getLogger().level
        self._read_nodes: list | None = None  # while a read is decoded: its objects
        self.method_handles: set[int] = set()  # the other side's handles of bound methods
        self.methods: dict[tuple[int, str], object] = {}  # (object handle, name) -> its method
        self.epoch = 0  # requests other than reads made so far
        # The test's objects the student's side holds (see _Mirrors): mirror id -> object.
        self.mirrors: dict[int, object] = {}
        self.mirror_ids: dict[int, int] = {}  # id(object) -> mirror id
        # (mirror id, its __dict__ where that is all its state, the object), in the order
        # they crossed: what each message compares with the state last synced.
        self.mirror_watch: list[tuple[int, dict | None, object]] = []
        self.mirror_seen: dict[int, dict] = {}  # mirror id -> its state as last synced
        self.syncing = False  # while mirrored states are compared (Remote == is identity)

    # -- encoding: anything of this side -> JSON and blobs --

    def encode(self, value, msg: _Message, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("a value nested too deep to send")
        t = type(value)
        if value is None or t in (bool, int, str):
            return value
        if t is float:
            return value if value == value and value not in (float("inf"), float("-inf")) \
                else {"$": "float", "v": repr(value)}
        if t in (bytes, bytearray):
            msg.blobs.append(bytes(value))
            return {"$": "bytes", "b": len(msg.blobs) - 1}
        if t is range:
            return {"$": "range", "v": [value.start, value.stop, value.step]}
        if t is slice:  # an index (`tokens[a:b]`), its bounds as data
            return {"$": "slice", "v": [self.encode(x, msg, depth + 1)
                                        for x in (value.start, value.stop, value.step)]}
        if value is Ellipsis:
            return {"$": "ellipsis"}
        back = msg.back.get(id(value))
        if back is not None:  # a value the other side sent in this call: its own again
            return {"$": "cref", "c": back}
        if t in (list, dict, set):
            if msg.track:
                seen = msg.copy_ids.get(id(value))
                if seen is not None:
                    return {"$": "cref", "c": seen}
            items = value.items() if t is dict else value
            out = {"$": t.__name__, "c": msg.copy(value)} if msg.track else {"$": t.__name__}
            out["v"] = [[self.encode(k, msg, depth + 1), self.encode(v, msg, depth + 1)]
                        for k, v in items] if t is dict else [self.encode(v, msg, depth + 1)
                                                              for v in items]
            return out
        if t in (tuple, frozenset):
            return {"$": t.__name__, "v": [self.encode(v, msg, depth + 1) for v in value]}
        mid = self.mirror_ids.get(id(value))
        if mid is not None and self.mirrors.get(mid) is value:
            return {"$": "mirror", "m": mid}
        if isinstance(value, Remote) and value._side is self:
            return {"$": "yours", "h": value._handle}
        if isinstance(value, _Read):
            return self._encode_read(value.root, msg)
        if isinstance(value, _Method):
            return {"$": "method", "h": self._export(value.bound)}
        torch = sys.modules.get("torch")
        if torch is not None:
            if t is torch.Tensor or t is torch.nn.Parameter:
                return self._encode_tensor(value.detach(), msg.blobs, msg.new)
            if t is torch.dtype:
                return {"$": "dtype", "v": str(value).removeprefix("torch.")}
            if t is torch.device:
                return {"$": "device", "v": str(value)}
            if t is torch.Size:
                return {"$": "size", "v": list(value)}
        if isinstance(value, enum.Enum) and _trusted(t.__module__):
            return {"$": "enum", "cls": f"{t.__module__}:{t.__qualname__}", "v": value.name}
        if isinstance(value, Struct):  # a record that came from the student's side: back
            out = {"$": "obj", "cls": value._path}
            if msg.track:
                if id(value) in msg.copy_ids:
                    return {"$": "cref", "c": msg.copy_ids[id(value)]}
                out["c"] = msg.copy(value)
            out["v"] = self.encode(dict(value._fields), msg, depth + 1)
            return out
        if msg.graph is not None and _has_state(value):
            node = msg.graph.get(id(value))
            if node is None:
                node = msg.graph[id(value)] = len(msg.graph_order)
                msg.graph_order.append(value)
            return {"$": "node", "n": node}
        if self.student and _is_record(value):
            # A dataclass that only holds data (a report, a request of a simulation): by value,
            # so that the test keeps it whatever becomes of this process.
            fields = _state_of(value)
            derived = {k: v for k, v in _state_of(value, properties=True).items()
                       if k not in fields}
            pairs = lambda d: [[k, self.encode(v, msg, depth + 1)] for k, v in d.items()  # noqa: E731
                               if isinstance(k, str)]
            return {"$": "struct", "cls": f"{t.__module__}:{t.__qualname__}",
                    "v": pairs(fields), "p": pairs(derived)}
        if isinstance(value, tuple) and hasattr(t, "_fields"):  # a named tuple
            return {"$": "ntuple", "cls": f"{t.__module__}:{t.__qualname__}",
                    "f": [str(f) for f in t._fields],
                    "v": [self.encode(v, msg, depth + 1) for v in value]}
        if not self.student and not callable(value) and _trusted(t.__module__) and (
            dataclasses.is_dataclass(value) or hasattr(value, "__dict__")
        ):
            # The test's own object (a mini_vllm request, a config): mirrored, its state sent
            # with this message and its changes, on either side, with every later one.
            return {"$": "mirror", "m": self._mirror(value)}
        return {"$": "ref", "h": self._export(value)}

    def _encode_read(self, root, msg: _Message) -> dict:
        """The student's side: `root` and every object it reaches, by state (attributes and
        properties), each object once, so that identity and cycles (a linked list) hold on the
        test's side; functions, modules and classes stay here as handles."""
        msg.graph, msg.graph_order = {}, []
        top = self.encode(root, msg)
        nodes = []
        while len(nodes) < len(msg.graph_order):
            if len(nodes) >= MAX_READ_OBJECTS:
                raise ValueError(f"a read that reaches more than {MAX_READ_OBJECTS} objects")
            obj = msg.graph_order[len(nodes)]
            state = _state_of(obj, properties=True)
            t = type(obj)
            nodes.append([f"{t.__module__}:{t.__qualname__}",
                          [[k, self.encode(v, msg, 1)] for k, v in state.items()
                           if isinstance(k, str) and not k.startswith("__")]])
        msg.graph = None
        return {"$": "read", "root": top, "nodes": nodes}

    def encode_after(self, received: dict, msg: _Message) -> list:
        """The student's side, after a call: the state of every list, dict, set and object the
        test's side sent by value, so that the changes made to them reach the originals."""
        msg.back = {id(obj): cid for cid, obj in received.items()}
        out = []
        for cid, obj in received.items():
            if type(obj) is dict:
                state = [[self.encode(k, msg), self.encode(v, msg)] for k, v in obj.items()]
            elif type(obj) in (list, set):
                state = [self.encode(v, msg) for v in obj]
            else:
                state = [[k, self.encode(v, msg)] for k, v in _state_of(obj).items()
                         if isinstance(k, str) and not k.startswith("__")]
            out.append([cid, state])
        return out

    def apply_after(self, after, blobs: list[bytes], msg: _Message) -> None:
        """The test's side: the changes the student's code made to what the test passed."""
        if not isinstance(after, list):
            raise StudentProcessError("a malformed list of changed arguments")
        decoded = []
        for entry in after:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and entry[0] in msg.copies and isinstance(entry[1], list)):
                raise StudentProcessError("a malformed changed argument")
            original = msg.copies[entry[0]]
            decoded.append((original, self.decode(entry[1], blobs, refs=msg.copies)))
        for original, state in decoded:
            if type(original) is list:
                original[:] = state
            elif type(original) is dict:
                pairs = [p for p in state if isinstance(p, list) and len(p) == 2]
                original.clear()
                original.update((_hashable(k), v) for k, v in pairs)
            elif type(original) is set:
                original.clear()
                original.update(_hashable(v) for v in state)
            elif isinstance(original, Struct):
                if all(isinstance(p, list) and len(p) == 2 for p in state):
                    original._fields.update((k, v) for k, v in state if isinstance(k, str))
            else:
                for pair in state:
                    if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                            and not pair[0].startswith("__")):
                        try:
                            object.__setattr__(original, pair[0], pair[1])
                        except (AttributeError, TypeError):
                            pass

    def _encode_tensor(self, t, blobs, new):
        if t.device.type == "meta":  # no data: its shape and dtype are all there is
            return {"$": "meta", "size": list(t.shape), "stride": list(t.stride()),
                    "dtype": str(t.dtype).removeprefix("torch.")}
        if t.device.type != "cpu":
            raise ValueError("only CPU tensors cross to the student's process")
        if t.is_sparse or t.is_quantized or t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg() if not (t.is_sparse or t.is_quantized) else \
                t.to_dense()
        sid = self.storages.id_of(t.untyped_storage(), blobs, new)
        return {"$": "tensor", "s": sid, "o": t.storage_offset(), "size": list(t.shape),
                "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}

    # -- mirrors: the test's objects that the student's code holds --
    #
    # A mini_vllm request handed to a student's scheduler must stay one object: the scheduler
    # changes it in later calls, returns it in its queues, and the test reads it and compares
    # it by identity. So such an object is mirrored (as tensor storages are): the student's side
    # holds a copy, each message carries the state of every mirrored object its sender changed
    # since the last one, and a mirrored object crossing again is named by its id, so that it
    # arrives as the same object on each side. Only the test's side mirrors; from the student's
    # side a change is applied only to attributes the test's object has (never a new one that
    # would shadow a method), and only as data, handles and mirrors.

    def _mirror(self, value) -> int:
        mid = len(self.mirror_watch) + 1
        self._watch(mid, value)
        return mid

    def _watch(self, mid: int, obj) -> None:
        self.mirrors[mid] = obj
        self.mirror_ids[id(obj)] = mid
        plain = not _type_info(type(obj))[0] and hasattr(obj, "__dict__")
        self.mirror_watch.append((mid, obj.__dict__ if plain else None, obj))

    def _encode_mirrors(self, msg: _Message) -> list:
        """The state of every mirrored object that is new or changed since it was last synced;
        a new one's with its class. Its own copy ids, so lists two objects share stay shared."""
        states = _Message(track=True)
        states.blobs, states.new = msg.blobs, msg.new
        out, i = [], 0
        self.syncing = True  # a Remote held by a mirrored object compares by identity
        try:
            while i < len(self.mirror_watch):  # encoding a state may mirror more objects
                mid, state, obj = self.mirror_watch[i]
                i += 1
                if state is None:
                    state = _state_of(obj)
                seen = self.mirror_seen.get(mid)
                if seen is not None:
                    try:  # a dict comparison, in C, which skips values that are still the same
                        if state == seen:  # object; tensors cannot say: sent
                            continue
                    except Exception:  # noqa: BLE001
                        pass
                self.mirror_seen[mid] = _copied(state)
                entry = [mid, [[k, self.encode(v, states)] for k, v in state.items()
                               if isinstance(k, str) and not k.startswith("__")]]
                if seen is None and not self.student:
                    t = type(obj)
                    entry.append(f"{t.__module__}:{t.__qualname__}")
                out.append(entry)
        finally:
            self.syncing = False
        return out

    def _receive_mirrors(self, entries, blobs: list[bytes]) -> None:
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) in (2, 3) and type(e[0]) is int
                and isinstance(e[1], list) for e in entries):
            raise StudentProcessError("a message with a malformed list of mirrored objects")
        for entry in entries:  # first every new object: the states may name each other
            if len(entry) == 3:
                if not self.student or entry[0] in self.mirrors:
                    raise StudentProcessError("a mirrored object announced by the wrong side")
                obj = object.__new__(_class_named(entry[2]))
                self._watch(entry[0], obj)
            elif entry[0] not in self.mirrors:
                raise StudentProcessError(f"a change to object {entry[0]}, which is not mirrored")
        refs: dict = {}
        decoded = []
        for mid, pairs, *_ in entries:
            if not all(type(p) is list and len(p) == 2 and isinstance(p[0], str)
                       and not p[0].startswith("__") for p in pairs):
                raise StudentProcessError("a malformed state of a mirrored object")
            decoded.append((mid, [(k, self.decode(v, blobs, refs=refs, fresh=True))
                                  for k, v in pairs]))
        for mid, pairs in decoded:
            obj = self.mirrors[mid]
            have = _state_of(obj)
            for name, value in pairs:
                if not self.student and name not in have:
                    continue
                now = have.get(name)
                if type(now) is type(value) and type(value) in (list, dict, set) \
                        and now is not value:
                    # In place: another object may hold the same list (a request's tokens and
                    # the ConstantList that shows them).
                    now.clear()
                    if type(value) is list:
                        now.extend(value)
                    else:
                        now.update(value)
                else:
                    try:
                        object.__setattr__(obj, name, value)
                    except (AttributeError, TypeError):
                        pass
            self.mirror_seen[mid] = _copied(_state_of(obj))

    def _export(self, value) -> int:
        handle = self.export_ids.get(id(value))
        if handle is not None and self.exported.get(handle) is value:
            return handle
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.exported[handle] = value
        self.export_ids[id(value)] = handle
        return handle

    # -- decoding: JSON and blobs of the other side -> values here --

    def decode(self, data, blobs: list[bytes], depth: int = 0, refs: dict | None = None,
               fresh: bool = False):
        """`refs`: the values of this side the other side names by copy id ("cref"), and, on
        the student's side (or with `fresh`: mirrored states), where the copies it receives
        are recorded."""
        if depth > MAX_DEPTH:
            raise StudentProcessError("a value nested too deep")
        if data is None or type(data) in (bool, int, float, str):
            return data
        if type(data) is list:
            return [self.decode(v, blobs, depth + 1, refs) for v in data]
        if type(data) is not dict or not isinstance(data.get("$"), str):
            raise StudentProcessError(f"a value of an unknown form ({type(data).__name__})")
        tag, v = data["$"], data.get("v")
        sub = lambda x: self.decode(x, blobs, depth + 1, refs, fresh)  # noqa: E731
        if tag == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "bytes":
            return bytes(self._blob(data.get("b"), blobs))
        if tag == "cref":
            if refs is None or data.get("c") not in refs:
                raise StudentProcessError("a copy id that names nothing")
            return refs[data["c"]]
        if tag in ("list", "dict", "set") and type(v) is list:
            out = {"list": list, "dict": dict, "set": set}[tag]()
            cid = data.get("c")
            if cid is not None and (self.student or fresh) and refs is not None \
                    and type(cid) is int:
                refs[cid] = out  # registered before its items: a list may hold itself
            for item in v:
                if tag == "list":
                    out.append(sub(item))
                elif tag == "set":
                    out.add(_hashable(sub(item)))
                elif type(item) is list and len(item) == 2:
                    out[_hashable(sub(item[0]))] = sub(item[1])
                else:
                    raise StudentProcessError("a malformed dict entry")
            return out
        if tag in ("tuple", "frozenset") and type(v) is list:
            return (tuple if tag == "tuple" else frozenset)(sub(x) for x in v)
        if tag == "range" and type(v) is list and len(v) == 3 and all(type(x) is int
                                                                       for x in v):
            return range(*v)
        if tag == "slice" and type(v) is list and len(v) == 3:
            return slice(*(sub(x) for x in v))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "tensor":
            return self._decode_tensor(data)
        if tag == "meta":
            import torch

            size, stride = data.get("size"), data.get("stride")
            dtype = _dtypes().get(data.get("dtype"))
            if not (_naturals(size) and _naturals(stride) and dtype is not None):
                raise StudentProcessError("a malformed meta tensor")
            return torch.empty_strided(size, stride, dtype=dtype, device="meta")
        if tag == "dtype" and v in _dtypes():
            return _dtypes()[v]
        if tag == "device" and v in ("cpu", "meta"):
            import torch

            return torch.device(v)
        if tag == "size" and _naturals(v):
            import torch

            return torch.Size(v)
        if tag == "enum":
            cls = self._trusted_class(data.get("cls"))
            if isinstance(cls, type) and issubclass(cls, enum.Enum) and v in cls.__members__:
                return cls[v]
            raise StudentProcessError(f"an enum member that does not exist: {data.get('cls')}")
        if tag == "struct" and type(v) is list and isinstance(data.get("cls"), str):
            fields, derived = {}, {}
            for into, pairs in ((fields, v), (derived, data.get("p", []))):
                for pair in pairs if type(pairs) is list else [None]:
                    if not (type(pair) is list and len(pair) == 2 and isinstance(pair[0], str)):
                        raise StudentProcessError("a malformed record")
                    into[pair[0]] = sub(pair[1])
            return _record(data["cls"], fields, derived, self)
        if tag == "ntuple" and type(v) is list and isinstance(data.get("cls"), str):
            items = [sub(x) for x in v]
            if self.student:  # the test's side names its own classes
                cls = _class_named(data["cls"])
            else:
                cls = self._trusted_class(data["cls"]) if _trusted(data["cls"].split(":")[0]) \
                    else None
            if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                try:
                    return cls(*items)
                except TypeError:
                    pass
            fields = data.get("f")
            if type(fields) is list and len(fields) == len(items):
                return _named_tuple_class(data["cls"], fields)(items)
            return tuple(items)
        if tag == "mirror":
            if data.get("m") not in self.mirrors:
                raise StudentProcessError("a mirrored object that was never announced")
            return self.mirrors[data["m"]]
        if tag == "ref" and type(data.get("h")) is int:
            return self._remote(data["h"])
        if tag == "method" and not self.student and type(data.get("h")) is int:
            self.method_handles.add(data["h"])
            return self._remote(data["h"])
        if tag == "read" and not self.student and type(data.get("nodes")) is list:
            return self._decode_read(data, blobs)
        if tag == "node" and self._read_nodes is not None:
            if type(data.get("n")) is not int or not 0 <= data["n"] < len(self._read_nodes):
                raise StudentProcessError("a read that names an object it does not hold")
            return self._read_nodes[data["n"]]
        if tag == "yours" and type(data.get("h")) is int:
            if data["h"] not in self.exported:
                raise StudentProcessError("a handle of this side that it never gave out")
            return self.exported[data["h"]]
        if tag == "obj" and self.student:  # only the test's side sends objects by state
            obj = object.__new__(_class_named(data.get("cls")))
            if type(data.get("c")) is int and refs is not None:
                refs[data["c"]] = obj
            for name, value in sub(v).items():
                object.__setattr__(obj, name, value)
            return obj
        raise StudentProcessError(f"a value of an unknown form ({tag!r})")

    def _decode_read(self, data, blobs) -> object:
        nodes = data["nodes"]
        if len(nodes) > MAX_READ_OBJECTS or not all(
                type(n) is list and len(n) == 2 and isinstance(n[0], str) and type(n[1]) is list
                for n in nodes):
            raise StudentProcessError("a malformed read")
        self._read_nodes = [ReadObject(n[0]) for n in nodes]  # first: they refer to each other
        try:
            for obj, (_, pairs) in zip(self._read_nodes, nodes):
                for pair in pairs:
                    if not (type(pair) is list and len(pair) == 2 and isinstance(pair[0], str)):
                        raise StudentProcessError("a malformed read")
                    obj._state[pair[0]] = self.decode(pair[1], blobs, 1)
            return self.decode(data.get("root"), blobs)
        finally:
            self._read_nodes = None

    def _blob(self, index, blobs):
        if type(index) is not int or not 0 <= index < len(blobs):
            raise StudentProcessError("a reference to a blob that is not there")
        return blobs[index]

    def _trusted_class(self, path):
        if not isinstance(path, str) or ":" not in path:
            raise StudentProcessError("a malformed class name")
        module, _, qualname = path.partition(":")
        if not _trusted(module):
            raise StudentProcessError(f"a class of an untrusted module: {path}")
        try:  # the instructor's own code (mini_vllm, the course), imported here if not yet
            obj = importlib.import_module(module)
        except ImportError:
            raise StudentProcessError(f"a class of a module that does not exist: {path}") \
                from None
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        return obj

    def _decode_tensor(self, data):
        import torch

        sid, offset = data.get("s"), data.get("o")
        size, stride, dtype = data.get("size"), data.get("stride"), _dtypes().get(data.get("dtype"))
        if (type(sid) is not int or sid not in self.storages.by_id or type(offset) is not int
                or offset < 0 or not _naturals(size) or not _naturals(stride)
                or len(size) != len(stride)
                or dtype is None):
            raise StudentProcessError("a malformed tensor")
        storage = self.storages.by_id[sid][0]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        extent = 0 if 0 in size else offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if extent * itemsize > storage.nbytes():
            raise StudentProcessError("a tensor that reaches past its storage")
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)

    def _remote(self, handle: int):
        proxy = self.remotes.get(handle)
        if proxy is None:
            proxy = self.remotes[handle] = Remote(self, handle)
        return proxy

    # -- messages --

    def send(self, header: dict, values: dict, msg: _Message | None = None) -> None:
        """`values`: the header's fields that hold values of this side (encoded here)."""
        msg = msg or _Message()
        body = {k: self.encode(v, msg) for k, v in values.items()}
        if "after" in header:
            body["after"] = header.pop("after")
        mirrors = self._encode_mirrors(msg)
        # The bytes of every mirrored storage this side changed, including those just announced.
        sync = self.storages.changed(msg.blobs)
        drop = self.storages.drop_dead()
        with self.lock:
            send_message(self.sock, dict(header, **body, new=msg.new, sync=sync, drop=drop,
                                          mirrors=mirrors), msg.blobs)

    def receive(self) -> tuple[dict, list[bytes]]:
        try:
            header, blobs = recv_message(self.reader)
        except (EOFError, ConnectionError, OSError) as exc:
            raise EOFError(str(exc)) from None
        new, sync, drop = header.get("new", []), header.get("sync", []), header.get("drop", [])
        if not all(isinstance(x, list) for x in (new, sync, drop)):
            raise StudentProcessError("a message with malformed storage lists")
        self.storages.receive(new, sync, drop, blobs, theirs=0 if self.student else 1)
        self._receive_mirrors(header.get("mirrors", []), blobs)
        return header, blobs

    def request(self, op: str, **values):
        """Ask the other side to do `op`; serve its requests until the reply comes. A call's
        arguments sent by value get their changes back (`apply_after`)."""
        msg = _Message(track=(op == "call" and not self.student))
        if op != "read":
            self.epoch += 1  # the student's state may change from here on
        header = {"op": op}
        if not self.student:
            header.update(self._context_changes())
        self.send(header, values, msg)
        return self.serve(until_reply=True, msg=msg)

    def _context_changes(self) -> dict:
        """What the test changed since its last request that the student's code reads from its
        process: environment variables (`monkeypatch.setenv`) and the root logger's level
        (`caplog.at_level`)."""
        out = {}
        if os.environ._data != self.env:  # compared as bytes: no copy while nothing changed
            env = dict(os.environ._data)
            diff = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()
                    if self.env.get(k) != v}
            diff.update({os.fsdecode(k): None for k in self.env if k not in env})
            out["env"], self.env = diff, env
        level = logging.getLogger().level
        if level != self.log_level:
            out["log_level"] = self.log_level = level
        return out

    def serve(self, until_reply: bool = False, msg: _Message | None = None):
        while True:
            try:
                header, blobs = self.receive()
            except EOFError:
                if until_reply:
                    raise self.ended() from None
                return None
            op = header.get("op")
            if op == "write" and not self.student:  # the student's print(): no reply
                stream, text = header.get("stream"), header.get("text")
                if stream in ("stdout", "stderr") and isinstance(text, str):
                    getattr(sys, stream).write(text[:MAX_WRITE])
                continue
            if op == "log" and not self.student:  # the student's logging: no reply
                _log_here(header)
                continue
            if self.student:
                _apply_context(header)
            if op == "reply":
                if not until_reply:
                    raise StudentProcessError("a reply to a request never made")
                if msg is not None and msg.copies and "after" in header:
                    self.apply_after(header["after"], blobs, msg)
                if "error" in header:
                    raise self.rebuild_error(header["error"])
                return self.decode(header.get("value"), blobs,
                                   refs=msg.copies if msg is not None else None)
            received: dict = {}
            reply = _Message()
            try:
                value = self.handle(op, header, blobs, received)
            except StudentProcessError:
                raise
            except BaseException as exc:  # noqa: B036 - it goes back as the reply
                self._reply_error(exc, received)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)) and not self.student:
                    raise
                continue
            try:
                after = self.encode_after(received, reply) if received else []
                self.send({"op": "reply", "after": after}, {"value": value}, reply)
            except (ValueError, TypeError, RuntimeError) as exc:  # a value that cannot cross
                self._reply_error(exc, received)

    def _reply_error(self, exc: BaseException, received: dict) -> None:
        reply = _Message()
        try:
            after = self.encode_after(received, reply) if received else []
        except (ValueError, TypeError, RuntimeError):
            after, reply = [], _Message()
        self.send({"op": "reply", "error": describe_error(exc), "after": after}, {}, reply)

    def ended(self) -> Exception:
        return StudentProcessError("the student's process ended")

    def handle(self, op, header, blobs, received: dict):
        """Do a request of the other side. `received`: where the student's side records the
        copies a call's arguments arrive as."""
        arg = lambda key: self.decode(header.get(key), blobs, refs=received)  # noqa: E731
        if op == "call":
            target = arg("target")
            return target(*arg("args"), **arg("kwargs"))
        if self.student:
            return self.handle_student(op, arg)
        if op == "getattr":
            # The student's code may read the public attributes of the test's objects it was
            # given; never a name with an underscore, which is the way to frames, globals,
            # classes and so to the test's machinery.
            name = arg("name")
            if not isinstance(name, str) or name.startswith("_"):
                raise AttributeError(f"{name!r}: not readable from the student's process")
            return getattr(arg("target"), name)
        if op == "op" and arg("name") in _OPS_ON_THE_TESTS_OBJECTS:
            # An iterator, a sequence or a mapping the test passed (`reversed(blocks)`).
            return _OPS[arg("name")](arg("target"), *arg("args"))
        raise StudentProcessError(f"a request the test's side does not take: {op!r}")

    def handle_student(self, op, arg):
        obj = arg("target")
        if op == "getattr":
            name = arg("name")
            value = getattr(obj, name)
            if isinstance(value, types.MethodType) and value.__self__ is obj \
                    and name not in getattr(obj, "__dict__", {}):
                return _Method(value)  # a method of its class: the test's side keeps it
            return value
        if op == "setattr":
            setattr(obj, arg("name"), arg("value"))
            return None
        if op == "delattr":
            delattr(obj, arg("name"))
            return None
        if op == "op":
            return _OPS[arg("name")](obj, *arg("args"))
        if op == "isinstance":
            return isinstance(obj, arg("cls"))
        if op == "snapshot":
            return _snapshot(obj)
        if op == "read":
            return _Read(obj)
        if op == "module_of":
            return sys.modules[getattr(obj, "__module__", None) or ""]
        if op == "run":  # a helper of the course's, asked for by the test's side (trusted)
            return _class_named(arg("name"))(*arg("args"), **arg("kwargs"))
        raise ValueError(f"unknown request {op!r}")

    def rebuild_error(self, info) -> BaseException:
        return rebuild_student_error(info)


def _iterate(obj):
    """`iter` asked from the test's side: a builtin container's items come back at once, as
    data (a scheduler's queue is a deque: one round trip, not one an item); anything else
    stays an iterator there, asked for each item."""
    if type(obj) in (list, tuple, dict, set, frozenset, range, collections.deque):
        return list(obj)
    return iter(obj)


_OPS = {
    "len": len, "bool": bool, "repr": repr, "str": str, "iter": _iterate, "next": next,
    "getitem": lambda o, k: o[k], "setitem": lambda o, k, v: o.__setitem__(k, v),
    "delitem": lambda o, k: o.__delitem__(k), "contains": lambda o, k: k in o,
    "int": int, "float": float, "index": lambda o: o.__index__(), "hash": hash,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "enter": lambda o: o.__enter__(),
    "exit": lambda o, *a: o.__exit__(*a), "dir": dir,
    "path": lambda o: f"{o.__module__}:{o.__qualname__}",
}
# What the student's code may do with an object of the test's (beyond calling it and reading its
# public attributes): use it as the iterable, sequence or mapping it was given as.
_OPS_ON_THE_TESTS_OBJECTS = {"len", "bool", "iter", "next", "getitem", "contains", "repr", "str"}


def _apply_context(header: dict) -> None:
    """The student's side: the test's environment and root log level, as of its request."""
    env = header.get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(key, str) and value is None:
                os.environ.pop(key, None)
            elif isinstance(key, str) and isinstance(value, str):
                os.environ[key] = value
    if type(header.get("log_level")) is int:
        logging.getLogger().setLevel(header["log_level"])


def _log_here(header: dict) -> None:
    """The test's side: a log record of the student's code, handled by the test's own loggers
    (pytest's caplog, the grader's log) as data: a name, a level and the formatted text."""
    name, level, text = header.get("name"), header.get("level"), header.get("text")
    if not (isinstance(name, str) and type(level) is int and isinstance(text, str)):
        return
    logger = logging.getLogger(name) if name and name != "root" else logging.getLogger()
    if logger.isEnabledFor(level):
        logger.handle(logging.makeLogRecord({
            "name": name, "levelno": level, "levelname": logging.getLevelName(level),
            "msg": text[:MAX_WRITE], "args": None,
            "pathname": str(header.get("where", "")), "lineno": 0}))


class _ForwardLog(logging.Handler):
    """The student's process's only log handler: each record is a message to the test's side."""

    def __init__(self, side):
        super().__init__(logging.NOTSET)
        self.side = side

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format
            text = str(record.msg)
        try:
            with self.side.lock:
                send_message(self.side.sock, {"op": "log", "name": record.name,
                                               "level": record.levelno, "text": text[:MAX_WRITE],
                                               "where": f"{record.filename}:{record.lineno}"},
                              [])
        except OSError:
            pass


def _hashable(value):
    """A key or set item that arrived as a list (JSON has no tuples at the top) as a tuple."""
    return tuple(_hashable(v) for v in value) if type(value) is list else value


def _naturals(xs) -> bool:
    return type(xs) is list and len(xs) <= 64 and all(type(x) is int and x >= 0 for x in xs)


_TYPE_INFO: dict[type, tuple[tuple[str, ...], tuple[str, ...], bool]] = {}


def _type_info(t: type) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """A class's slot names, property names, and whether its instances hold state (a
    __dict__ or slots, and are not callables, classes or modules): looked up once per class."""
    info = _TYPE_INFO.get(t)
    if info is None:
        slots, props = [], []
        for klass in t.__mro__[:-1]:
            names = getattr(klass, "__slots__", ())
            for name in (names,) if isinstance(names, str) else names:
                if isinstance(name, str) and name not in ("__weakref__", "__dict__"):
                    slots.append(name)
            props += [name for name, member in vars(klass).items()
                      if isinstance(member, property)]
        callable_instances = any("__call__" in vars(k) for k in t.__mro__)
        stateful = (t.__dictoffset__ != 0 or bool(slots)) and not callable_instances \
            and not issubclass(t, (type, types.ModuleType))
        info = _TYPE_INFO[t] = (tuple(slots), tuple(dict.fromkeys(props)), stateful)
    return info


def _state_of(obj, properties: bool = False) -> dict:
    """An object's attributes (its __dict__ and slots); with `properties`, the values of its
    class's properties too (a record's derived fields, read once, as data)."""
    state = dict(getattr(obj, "__dict__", {}))
    slots, props, _ = _type_info(type(obj))
    for name in slots:
        if name not in state and hasattr(obj, name):
            state[name] = getattr(obj, name)
    for name in props if properties else ():
        if name not in state:
            try:
                state[name] = getattr(obj, name)
            except Exception:  # noqa: BLE001 - a property that fails is left out
                pass
    return state


def _copied(state: dict) -> dict:
    """A state as it can be compared with later: its lists, dicts and sets copied (one level:
    a list held in a list is compared by identity)."""
    return {k: v.copy() if type(v) in (list, dict, set) else v for k, v in state.items()}


def _class_named(path):
    """What "module:qualname" names (the student's side only: it trusts the test's side)."""
    module, _, qualname = str(path).partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _snapshot(obj, depth: int = 0):
    """What `==` compares on the test's side: dataclass instances as (class, fields), lists,
    tuples and dicts element by element, everything else as itself (data by value, objects by
    handle, compared by identity there)."""
    if depth > MAX_DEPTH:
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        t = type(obj)
        return ["dataclass", f"{t.__module__}:{t.__qualname__}",
                {f.name: _snapshot(getattr(obj, f.name), depth + 1)
                 for f in dataclasses.fields(obj) if f.compare}]
    if type(obj) in (list, tuple):
        return type(obj)(_snapshot(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return {k: _snapshot(v, depth + 1) for k, v in obj.items()}
    return obj


# --- errors -------------------------------------------------------------------------------------


def describe_error(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f"{Path(last.filename).name}:{last.lineno}, in {last.name}"
    t = type(exc)
    return {
        "type": t.__name__,
        "module": t.__module__,
        "bases": [c.__name__ for c in t.__mro__ if c.__module__ == "builtins"],
        "message": str(exc)[:4000],
        "where": where,
        "traceback": "".join(traceback.format_exception(t, exc, exc.__traceback__,
                                                        limit=-12))[-6000:],
    }


_MADE: dict[tuple[str, str, str], type] = {}


def rebuild_student_error(info) -> BaseException:
    """The exception a student's call raised, as a class of this side: a builtin one by name,
    `mini_vllm`'s or the course's own class, or a class made here with the student's name that
    derives from its nearest builtin base (so `pytest.raises(ValueError)` still matches)."""
    if not isinstance(info, dict):
        return StudentProcessError("a malformed error report")
    name, module = str(info.get("type", "Exception")), str(info.get("module", ""))
    message = str(info.get("message", ""))
    cls = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif _trusted(module) and module in sys.modules:
        cls = getattr(sys.modules[module], name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        base = Exception
        for base_name in info.get("bases", []) if isinstance(info.get("bases"), list) else []:
            candidate = getattr(builtins, str(base_name), None)
            if isinstance(candidate, type) and issubclass(candidate, Exception):
                base = candidate
                break
        key = (module, name, base.__name__)
        if key not in _MADE:
            _MADE[key] = type(name, (base,), {"__module__": f"student:{module}"})
        cls = _MADE[key]
    try:
        exc = cls(message)
    except Exception:
        exc = _MADE.setdefault(("", name, "Exception"), type(name, (Exception,), {}))(message)
    exc.student_where = str(info.get("where", ""))
    exc.student_traceback = str(info.get("traceback", ""))
    if exc.student_traceback:  # pytest prints the cause; `raises(match=)` reads only the message
        exc.__cause__ = StudentTraceback("In the student's process:\n"
                                         + exc.student_traceback.rstrip())
    return exc


class StudentTraceback(Exception):
    """The traceback of an error raised in the student's process, as text: the cause of the
    exception it became on the test's side."""


# --- the test's side: records and proxies -------------------------------------------------------


def _is_record(value) -> bool:
    """A dataclass instance whose class defines no methods of its own (generated ones and
    properties aside): a record of data, not an object with behaviour."""
    t = type(value)
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return False
    for klass in t.__mro__[:-1]:
        for name, member in vars(klass).items():
            if callable(member) and not (name.startswith("__") and name.endswith("__")) \
                    and not isinstance(member, type):
                return False
    return True


def _record(path: str, fields: dict, derived: dict, side: Side):
    """A record of the student's side: an instance of the same class where that class is the
    course's own (mini_vllm), else a Struct."""
    if _trusted(path.partition(":")[0]):
        cls = side._trusted_class(path)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            obj = object.__new__(cls)
            for name, value in fields.items():
                if not name.startswith("__"):
                    object.__setattr__(obj, name, value)
            return obj
    return Struct(path, fields, derived)


_NAMED: dict[tuple, type] = {}


def _named_tuple_class(path: str, fields: list) -> type:
    """A named tuple of the student's side (its class is not the course's): a tuple class made
    here with the same field names, as properties (no code of theirs, no generated source)."""
    key = (path, tuple(fields))
    if key not in _NAMED:
        if not all(isinstance(f, str) and f.isidentifier() and not f.startswith("_")
                   for f in fields):
            raise StudentProcessError(f"a named tuple with odd field names: {path}")
        module, _, qualname = path.partition(":")
        members = {f: property(operator.itemgetter(i)) for i, f in enumerate(fields)}
        members.update(_fields=tuple(fields), __slots__=(), __module__=module,
                       __qualname__=qualname)
        _NAMED[key] = type(qualname.rsplit(".", 1)[-1], (tuple,), members)
    return _NAMED[key]


class Struct:
    """A record (a dataclass instance holding data) of the student's process, by value: its
    fields read and set here, compared here field by field; its properties as they were when
    it crossed (`derived`, read-only)."""

    __slots__ = ("_path", "_fields", "_derived")

    def __init__(self, path: str, fields: dict, derived: dict | None = None):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_derived", derived or {})

    def __getattr__(self, name):
        if name in self._fields:
            return self._fields[name]
        if name in self._derived:
            return self._derived[name]
        raise AttributeError(f"{self._path.split(':')[-1]} has no field {name!r}")

    def __setattr__(self, name, value):
        self._fields[name] = value

    def __eq__(self, other):
        if isinstance(other, Struct):
            return self._path == other._path and _data_equal(self._fields, other._fields)
        return NotImplemented

    def __hash__(self):
        return hash((self._path, tuple(sorted(self._fields.items(), key=lambda kv: kv[0]))))

    def __repr__(self):
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"{self._path.split(':')[-1]}({inner})"


class _Method:
    """The student's side: a reply that is a method of the object's class, bound to it."""

    def __init__(self, bound):
        self.bound = bound


class _Read:
    """The student's side: a reply that is the whole object graph of `root`, by state."""

    def __init__(self, root):
        self.root = root


def _has_state(value) -> bool:
    return _type_info(type(value))[2]


class ReadObject:
    """An object of the student's process as it was when the test read it (`lab.read`): its
    attributes and properties, read-only; other objects it refers to are ReadObjects too (the
    same object, the same ReadObject), so `is` and walks along links work here, at no cost."""

    __slots__ = ("_path", "_state")

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_state", {})

    def __getattr__(self, name):
        try:
            return self._state[name]
        except KeyError:
            raise AttributeError(f"{self._path.split(':')[-1]} (as read) has no attribute "
                                 f"{name!r}; call methods on the object itself") from None

    def __setattr__(self, name, value):
        raise AttributeError("an object as read is a record of a moment: it cannot be changed")

    def __repr__(self):
        shown = [f"{k}={v!r}" for k, v in self._state.items()
                 if v is None or type(v) in (bool, int, float, str)][:6]
        return f"{self._path.split(':')[-1]}({', '.join(shown)})"


# --- the test's side: proxies -------------------------------------------------------------------


class Remote:
    """An object of the student's process. Every operation is a request; what comes back is
    data or another Remote."""

    __slots__ = ("_side", "_handle", "__weakref__")

    def __init__(self, side: Side, handle: int):
        object.__setattr__(self, "_side", side)
        object.__setattr__(self, "_handle", handle)

    def _ask(self, op, **values):
        return self._side.request(op, target=self, **values)

    def _op(self, name, *args):
        return self._ask("op", name=name, args=list(args))

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in (
                "__name__", "__qualname__", "__doc__", "__module__", "__wrapped__", "__func__",
                "__self__", "__dict__", "__class__"):
            raise AttributeError(name)
        # A method of the object's class, read once, is not asked for again (a call is then
        # one request, not two) until the test sets or deletes an attribute of any object,
        # as monkeypatch does. Not seen: a method the student's code rebinds on the object
        # itself after the test has read it.
        key = (self._handle, name)
        method = self._side.methods.get(key)
        if method is not None:
            return method
        value = self._ask("getattr", name=name)
        if isinstance(value, Remote) and value._handle in self._side.method_handles:
            self._side.methods[key] = value
        return value

    def __setattr__(self, name, value):
        self._side.methods.clear()
        self._ask("setattr", name=name, value=value)

    def __delattr__(self, name):
        self._side.methods.clear()
        self._ask("delattr", name=name)

    def __call__(self, *args, **kwargs):
        return self._side.request("call", target=self, args=list(args), kwargs=kwargs)

    def __len__(self):
        n = self._op("len")
        if type(n) is not int:
            raise TypeError("len() of a student object did not return an int")
        return n

    def __bool__(self):
        return self._op("bool") is True

    def __iter__(self):
        it = self._op("iter")
        if not isinstance(it, Remote):  # data came back (it should not): iterate it here
            yield from it
            return
        while True:
            try:
                item = it._op("next")
            except StopIteration:
                return
            yield item

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __setitem__(self, key, value):
        self._op("setitem", key, value)

    def __delitem__(self, key):
        self._op("delitem", key)

    def __contains__(self, key):
        return self._op("contains", key) is True

    def __int__(self):
        return int(self._op("int"))

    def __float__(self):
        return float(self._op("float"))

    def __index__(self):
        return int(self._op("index"))

    def __lt__(self, other):
        return self._op("lt", other) is True

    def __le__(self, other):
        return self._op("le", other) is True

    def __gt__(self, other):
        return self._op("gt", other) is True

    def __ge__(self, other):
        return self._op("ge", other) is True

    def __enter__(self):
        return self._op("enter")

    def __exit__(self, *exc):
        return self._op("exit", None, None, None)

    def __dir__(self):
        names = self._op("dir")
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def __eq__(self, other):
        if other is self or self._side.syncing:
            return other is self
        mine = self._ask("snapshot")
        theirs = other._ask("snapshot") if isinstance(other, Remote) else other
        if isinstance(theirs, Struct):
            theirs = ["dataclass", theirs._path, theirs._fields]
        if isinstance(mine, Remote) or isinstance(theirs, Remote):
            return False  # distinct objects that are not dataclasses: identity only
        return _data_equal(mine, theirs)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash((id(self._side), self._handle))

    def __repr__(self):
        text = self._op("repr")
        return text if isinstance(text, str) else "<a student object>"

    def __str__(self):
        text = self._op("str")
        return text if isinstance(text, str) else "<a student object>"

    def __instancecheck__(self, instance):
        if isinstance(instance, Remote):
            return instance._side.request("isinstance", target=instance, cls=self) is True
        if isinstance(instance, (Struct, ReadObject)):  # the same class path (asked as data)
            return instance._path == self._side.request("op", target=self, name="path",
                                                        args=[])
        return False


def _data_equal(a, b) -> bool:
    """Equality of two snapshots, here: lists from the other side may stand for tuples of this
    one (a dataclass snapshot is a list) but otherwise types must agree as Python's do."""
    if isinstance(a, list) and len(a) == 3 and a[0] == "dataclass":
        return isinstance(b, list) and len(b) == 3 and b[0] == "dataclass" and a[1] == b[1] \
            and _data_equal(a[2], b[2])
    try:
        result = a == b
    except Exception:
        return False
    if isinstance(result, bool):
        return result
    try:  # tensors: equal when every element is
        return bool(result.all())
    except Exception:
        return False


# --- starting and stopping ----------------------------------------------------------------------


class StudentProcess:
    """The student's process of one lab, for one test."""

    def __init__(self, lab_dir: Path, impl: str, lab_id: str, load):
        """`load(lab_dir, impl, lab_id)`: the loader's function that imports the lab's file
        (course.labs.loader), called in the student's process only."""
        self.lab_dir, self.impl, self.lab_id = lab_dir, impl, lab_id
        parent, child = socket.socketpair()
        test_pid = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # the student's process
            parent.close()
            on_its_own(test_pid)
            _serve_forever(child, lambda: load(lab_dir, impl, lab_id))
        try:
            os.setpgid(self.pid, self.pid)  # as the child does: whichever runs first
        except OSError:
            pass
        child.close()
        self.side = Side(parent, student=False)
        self.side.ended = self._ended
        self.module = self.side._remote(0)
        self.reads: dict[int, tuple[int, object]] = {}  # handle -> (epoch, what was read)

    def _ended(self) -> Exception:
        status = None
        try:
            done, st = os.waitpid(self.pid, 0)
            status = st if done else None
        except ChildProcessError:
            pass
        how, outcome = "", "crashed"
        if status is not None and os.WIFSIGNALED(status):
            how = f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
        elif status is not None:
            how, outcome = f" (exit code {os.WEXITSTATUS(status)})", "exited"
        error = StudentProcessError(
            f"lab {self.lab_id}: the student's process ended{how} while the test waited for "
            "it: code in starter.py exited, crashed or was killed")
        error.outcome = outcome  # what the grader calls it, as for a test's own process
        return error

    def module_of(self, function) -> Remote:
        """The student's module a function of theirs lives in (to patch a name there)."""
        return self.side.request("module_of", target=function)

    def read(self, obj):
        """`obj` (a Remote) and all it reaches, as they are now, in one request: ReadObjects.
        Read again with nothing asked of the student's process in between, an object is not
        read again: the copy of the last read is the same (the invariants of a test's state
        machine read one pool three times after each step)."""
        if not isinstance(obj, Remote):
            return self.side.request("read", target=obj)
        cached = self.reads.get(obj._handle)
        if cached is not None and cached[0] == self.side.epoch:
            return cached[1]
        value = self.side.request("read", target=obj)
        self.reads[obj._handle] = (self.side.epoch, value)
        return value

    def stop(self) -> None:
        try:
            self.side.sock.close()
        except OSError:
            pass
        _kill(self.pid)
        _ZOMBIES.append(self.pid)  # reaped later: its memory takes the kernel a while to free
        _reap()


def _kill(pid: int) -> None:
    """The student's process and whatever it started in its group."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except OSError:
            pass


def on_its_own(test_pid: int) -> None:
    """Before any student code: a process group of its own (so `stop` ends the processes it
    starts too, and a kill of its own group reaches no test), killed when the test's process
    dies, first to go when memory runs out, and no terminal to read."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the socket's end still ends it
        pass
    if os.getppid() != test_pid:  # the test's process died before the line above
        os._exit(1)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _serve_forever(sock: socket.socket, load) -> None:
    """The student's process: keep only the channel, load the module, answer until the test's
    side hangs up."""
    global IN_STUDENT_PROCESS
    IN_STUDENT_PROCESS = True
    code = 0
    try:
        keep_only_descriptors({0, 1, 2, sock.fileno()})
        try:
            import torch

            torch.set_num_threads(1)
        except Exception:
            pass
        side = Side(sock, student=True)
        # What the student's code prints goes to the test's side, which shows it as its own
        # (pytest's capture, capsys, the grader's log).
        sys.stdout = _Forward(side, "stdout")
        sys.stderr = _Forward(side, "stderr")
        root = logging.getLogger()
        root.handlers[:] = [_ForwardLog(side)]
        try:
            module = load()
        except BaseException as exc:  # noqa: B036 - reported on every request
            side.exported[0] = _Unloadable(exc)
        else:
            side.exported[0] = module
        side.serve()
    except BaseException:  # noqa: B036 - said on the process's own stderr, for whoever reads it
        code = 1
        try:
            os.write(2, ("the student's process stopped on an error of the channel:\n"
                         + traceback.format_exc()).encode())
        except OSError:
            pass
    finally:
        os._exit(code)


class _Forward:
    """sys.stdout or sys.stderr of the student's process: each write is a message."""

    def __init__(self, side: Side, stream: str):
        self.side, self.stream = side, stream

    def write(self, text) -> int:
        text = str(text)
        if text:
            try:
                with self.side.lock:
                    send_message(self.side.sock, {"op": "write", "stream": self.stream,
                                                   "text": text[:MAX_WRITE]}, [])
            except OSError:
                pass
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def keep_only_descriptors(keep: set[int]) -> None:
    """Close every file descriptor of this process but ``keep``: a process that runs student
    code must hold no pipe, file or socket of the process that judges it."""
    for other in range(3, _max_fd()):
        if other not in keep:
            try:
                os.close(other)
            except OSError:
                pass


def _max_fd() -> int:
    try:
        return max(int(n) for n in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 1024


def not_dumpable() -> None:
    """Processes of the same user cannot ptrace this one or read its /proc/PID/fd and mem (a
    process that decides verdicts calls it before it forks anything that runs student code)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:  # noqa: BLE001 - not Linux
        pass


class _Unloadable:
    """Stands for a module that did not load: every request raises its error again."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __getattr__(self, name):
        raise self.exc


_CURRENT: dict[tuple[str, str], StudentProcess] = {}
_WARM: set[tuple[int, str]] = set()


def warm(lab_dir: Path | None = None) -> None:
    """Pay here, once, the start-up costs every student's process (a fresh fork for each test)
    would otherwise pay again: torch's first operation on the meta device (it imports some 800
    modules, about 3 s), and the course's own modules the lab's files import (read with `ast`,
    nothing of them run; only `mini_vllm` modules are imported)."""
    key = (os.getpid(), str(lab_dir))
    if key in _WARM:
        return
    _WARM.add(key)
    try:
        import torch

        torch.ones(2, 2, device="meta").tril()
    except Exception:  # noqa: BLE001 - a warm-up only
        pass
    for name in ("starter.py", "solution.py") if lab_dir is not None else ():
        for module in _mini_vllm_imports(Path(lab_dir) / name):
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - the test will say what is wrong, not this
                pass


def _mini_vllm_imports(path: Path) -> list[str]:
    import ast

    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "mini_vllm" or n.startswith("mini_vllm.")]


_ZOMBIES: list[int] = []


def current(lab_dir: Path, impl: str, lab_id: str, load) -> StudentProcess:
    """The student's process of this lab for the running test (started on first use)."""
    warm(lab_dir)
    _reap()
    key = (str(lab_dir), impl)
    proc = _CURRENT.get(key)
    if proc is None or proc.pid_owner != os.getpid():
        proc = _CURRENT[key] = StudentProcess(lab_dir, impl, lab_id, load)
        proc.pid_owner = os.getpid()
    return proc


def _reap() -> None:
    for pid in list(_ZOMBIES):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _ZOMBIES.remove(pid)


def beside_the_student(function):
    """For a course helper that must run where the student's objects live: one that watches how
    the code runs (what it allocates, what it calls), or one that builds or arranges them for a
    test (a scheduler class made from the student's, a request put in `running` by hand). While
    a student's process is running, the helper runs there, beside that code, and its result
    comes back as data. Such a result is the student's process's word, unlike a test's
    assertions: a test may rest on it only for how the code works or for its set-up, never for
    what it computes."""

    def wrapper(*args, beside=None, **kwargs):
        """`beside`: the lab (a `load_lab` handle) whose code the helper watches; its student's
        process is started if the test has not touched it yet."""
        if beside is not None and not IN_STUDENT_PROCESS and beside.in_student_process:
            beside.module  # noqa: B018 - starts the lab's student process
        live = [p for p in _CURRENT.values() if getattr(p, "pid_owner", None) == os.getpid()]
        if not live or IN_STUDENT_PROCESS:
            return function(*args, **kwargs)
        name = f"{function.__module__}:{function.__qualname__}"
        return live[-1].side.request("run", target=None, name=name, args=list(args),
                                     kwargs=kwargs)

    wrapper.__wrapped__ = function
    wrapper.__name__, wrapper.__qualname__ = function.__name__, function.__qualname__
    wrapper.__doc__ = function.__doc__
    return wrapper


def read(obj):
    """`obj`, an object of the lab's code (or a list, tuple or dict of them), for a test that
    reads many of its attributes at once (a check of a whole data structure). While the lab's
    code runs in a student's process, one request brings `obj` and everything it reaches as
    read-only copies of this moment (ReadObject): read again after any call that changes it.
    Elsewhere it is `obj` itself."""
    if IN_STUDENT_PROCESS or not isinstance(obj, (Remote, list, tuple, dict)):
        return obj
    live = [p for p in _CURRENT.values() if getattr(p, "pid_owner", None) == os.getpid()]
    if isinstance(obj, Remote):
        live = [p for p in live if p.side is obj._side]
    return live[-1].read(obj) if live else obj


def kill_all() -> None:
    """Kill every student's process this process started, leaving the bookkeeping to
    `stop_all` (safe from another thread: a watchdog's)."""
    for proc in list(_CURRENT.values()):
        if getattr(proc, "pid_owner", None) == os.getpid():
            _kill(proc.pid)


def stop_all() -> None:
    """Kill every student's process this process started (at the end of each test)."""
    for key, proc in list(_CURRENT.items()):
        if getattr(proc, "pid_owner", None) == os.getpid():
            proc.stop()
        del _CURRENT[key]
