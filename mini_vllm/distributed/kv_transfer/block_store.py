"""Where a prefill engine leaves KV blocks for a decode engine: one blob of bytes per block,
keyed by the block's hash (the prefix-cache chain of lab 02-01, so a key names the block's tokens
*and* every token before them).

Two transports, one interface (:class:`KVBlockStore`): :meth:`~KVBlockStore.put` on the
producer, :meth:`~KVBlockStore.fetch_prefix` on the consumer, which returns the blobs of the
longest leading run of keys the store holds (a chain is only useful from its start).

* :class:`SharedMemoryBlockStore`: one POSIX shared-memory segment per block, named
  ``{prefix}_{key}``; engines on one host. A segment's first 8 bytes hold the blob's length and
  are written last, so a reader never takes a half-written block.
* :class:`TcpBlockStore`: the producer keeps its blocks in memory and serves them over ZeroMQ on
  ``host:port``; the consumer pulls (as upstream's NIXL connector has the decode side read from
  the prefill side). A producer that does not answer counts as holding nothing: the consumer
  computes those tokens itself.

Both keep at most ``capacity`` blocks on the producer, dropping the oldest first.

upstream: none (vLLM's connectors move KV over NIXL, NCCL, Mooncake, LMCache, or files in
ExampleConnector; these two stores are the course's, in the same pull-by-key shape)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.shared_memory import SharedMemory

import zmq

__all__ = ["KVBlockStore", "MemoryBlockStore", "SharedMemoryBlockStore", "TcpBlockStore",
           "remove_shm_segments"]

logger = logging.getLogger(__name__)

_posixshmem = shared_memory._posixshmem  # noqa: SLF001 - the C module SharedMemory wraps
_HEADER = 8  # bytes: the blob's length, little-endian; 0 while the producer is still writing
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX segments (for the sweep after a crash)


class KVBlockStore(ABC):
    """Blobs of KV blocks by key: the producer puts, the consumer fetches a leading run.

    upstream: none (see the module docstring)
    """

    @abstractmethod
    def put(self, key: bytes, blob: memoryview | bytes) -> None:
        """Keep ``blob`` under ``key`` (a key already held is kept as it is)."""

    @abstractmethod
    def fetch_prefix(self, keys: list[bytes]) -> list[bytes]:
        """The blobs of ``keys[0]``, ``keys[1]``, ... up to the first key not held."""

    @abstractmethod
    def close(self) -> None:
        """Release the store (a producer removes what it put). Safe to call twice."""


class MemoryBlockStore(KVBlockStore):
    """Blocks in this process's memory: for engines that share a process (``kv_both``, tests).

    upstream: none (see the module docstring)
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.blobs: dict[bytes, bytes] = {}  # oldest first

    def put(self, key: bytes, blob: memoryview | bytes) -> None:
        if key in self.blobs:
            self.blobs[key] = self.blobs.pop(key)  # now the newest
            return
        self.blobs[key] = bytes(blob)
        while len(self.blobs) > self.capacity:
            del self.blobs[next(iter(self.blobs))]

    def fetch_prefix(self, keys: list[bytes]) -> list[bytes]:
        out = []
        for key in keys:
            if key not in self.blobs:
                break
            out.append(self.blobs[key])
        return out

    def close(self) -> None:
        self.blobs.clear()


def _segment(prefix: str, key: bytes) -> str:
    return f"{prefix}_{key.hex()[:48]}"


def _attach(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    """A segment that Python's resource tracker does not own: the store unlinks its own, and a
    reader must not unlink the producer's when it exits (Python < 3.13 tracks every attach)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name, create=create, size=size, track=False)
    shm = SharedMemory(name, create=create, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the tracker's key
    return shm


def remove_shm_segments(prefix: str) -> int:
    """Unlink every segment named ``{prefix}_...`` (after a producer died without closing its
    store); returns how many. Linux only (elsewhere there is no folder to list: 0).

    upstream: none (see the module docstring)
    """
    if not os.path.isdir(_SHM_DIR):
        return 0
    removed = 0
    for name in os.listdir(_SHM_DIR):
        if name.startswith(prefix + "_"):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class SharedMemoryBlockStore(KVBlockStore):
    """One shared-memory segment per block (see the module docstring).

    upstream: none (see the module docstring)
    """

    def __init__(self, prefix: str, capacity: int = 4096) -> None:
        self.prefix = prefix
        self.capacity = capacity
        self._owned: OrderedDict[bytes, str] = OrderedDict()  # what this process put, oldest first

    def put(self, key: bytes, blob: memoryview | bytes) -> None:
        if key in self._owned:
            self._owned.move_to_end(key)
            return
        name = _segment(self.prefix, key)
        n = len(blob)
        try:
            shm = _attach(name, create=True, size=_HEADER + n)
        except FileExistsError:
            return  # another producer holds these tokens' KV already
        try:
            shm.buf[_HEADER:_HEADER + n] = blob
            shm.buf[:_HEADER] = n.to_bytes(_HEADER, "little")  # last: the block is ready
        finally:
            shm.close()
        self._owned[key] = name
        while len(self._owned) > self.capacity:
            _, oldest = self._owned.popitem(last=False)
            _unlink(oldest)

    def fetch_prefix(self, keys: list[bytes]) -> list[bytes]:
        blobs = []
        for key in keys:
            try:
                shm = _attach(_segment(self.prefix, key))
            except FileNotFoundError:
                break
            try:
                n = int.from_bytes(shm.buf[:_HEADER], "little")
                if n == 0 or n > len(shm.buf) - _HEADER:
                    break  # still being written
                blobs.append(bytes(shm.buf[_HEADER:_HEADER + n]))
            finally:
                shm.close()
        return blobs

    def close(self) -> None:
        while self._owned:
            _unlink(self._owned.popitem()[1])


def _unlink(name: str) -> None:
    try:
        shm = _attach(name)
    except FileNotFoundError:
        return
    shm.close()
    if sys.version_info >= (3, 13):
        shm.unlink()
    else:  # SharedMemory.unlink would untrack the segment a second time (the tracker fails)
        _posixshmem.shm_unlink(shm._name)  # noqa: SLF001


class TcpBlockStore(KVBlockStore):
    """The producer serves its blocks on ``address`` (``host:port``); the consumer pulls.

    ``serve=True`` (the producer): blocks live in this process, and a thread answers requests.
    ``serve=False`` (the consumer): each fetch is one round trip; if the producer does not
    answer within ``timeout_s``, the fetch returns nothing and the store stays quiet for
    ``retry_after_s`` (so that every admission does not wait out the timeout again).

    upstream: none (see the module docstring)
    """

    def __init__(self, address: str, capacity: int = 4096, *, serve: bool,
                 timeout_s: float = 5.0, retry_after_s: float = 5.0) -> None:
        self.endpoint = f"tcp://{address}"
        self.capacity = capacity
        self.timeout_ms = int(timeout_s * 1000)
        self.retry_after_s = retry_after_s
        self._ctx = zmq.Context()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._client: zmq.Socket | None = None
        self._quiet_until = 0.0
        if serve:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(self.endpoint)
            except zmq.ZMQError as exc:
                router.close()
                self._ctx.term()
                raise RuntimeError(f"TcpBlockStore: cannot serve KV blocks on {address} "
                                   f"({exc}); pick a free port for kv_store") from exc
            self._server = threading.Thread(target=self._serve, args=(router,), daemon=True,
                                            name="mini_vllm-kv-store")
            self._server.start()

    def put(self, key: bytes, blob: memoryview | bytes) -> None:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = bytes(blob)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)

    def _leading(self, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            blobs = []
            for key in keys:
                blob = self._blocks.get(key)
                if blob is None:
                    break
                blobs.append(blob)
            return blobs

    def _serve(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                ident, _, _op, *keys = router.recv_multipart()  # a REQ socket's envelope
                router.send_multipart([ident, b"", b"OK", *self._leading(keys)], copy=False)
        finally:
            router.close()

    def fetch_prefix(self, keys: list[bytes]) -> list[bytes]:
        if self._server is not None:
            return self._leading(keys)
        if not keys or time.monotonic() < self._quiet_until:
            return []
        if self._client is None:
            self._client = self._ctx.socket(zmq.REQ)
            self._client.setsockopt(zmq.LINGER, 0)
            self._client.connect(self.endpoint)
        self._client.send_multipart([b"GET", *keys])
        if not self._client.poll(self.timeout_ms):
            # A REQ socket that sent and got no answer cannot send again: start a new one.
            self._client.close()
            self._client = None
            self._quiet_until = time.monotonic() + self.retry_after_s
            logger.warning("the KV producer at %s did not answer in %d ms; computing the "
                           "prompt here instead", self.endpoint, self.timeout_ms)
            return []
        _, *blobs = self._client.recv_multipart()
        return blobs

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._lock:
            self._blocks.clear()
        if not self._ctx.closed:
            self._ctx.term()
