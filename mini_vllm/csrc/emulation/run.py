"""Running one op in an emulator process: buffers, the request, and the outcome.

Every call starts the emulator executable afresh (a few milliseconds): a kernel that corrupts
memory, crashes or never ends cannot harm the Python process, and each call is a complete,
deterministic program run for the sanitizers.

Tensors travel as shared-memory files that the emulator maps: no copy for a tensor made with
``shared_empty`` (a block pool of gigabytes whose untouched pages cost nothing), one copy in and
(for outputs) one out for any other tensor. A copied tensor's bytes are placed so that they end
at a page boundary, where the emulator puts an inaccessible page: reading past the end of such a
buffer crashes even without a sanitizer.

upstream: none (the CPU emulation is this course's)
"""

from __future__ import annotations

import mmap
import os
import subprocess
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from mini_vllm.csrc.emulation.reports import EmulationError, describe_failure

PAGE = mmap.PAGESIZE
DEVICES = ("default", "t4", "a100", "h100")
ENV_DEVICE = "MINI_VLLM_EMU_DEVICE"
ENV_TIMEOUT = "MINI_VLLM_EMU_TIMEOUT"
# What fresh shared memory holds (runtime.cpp, shared_fill_byte): "nan" (the default) makes a sum
# over entries nobody wrote show, "huge" (3.4e38) a max over them, which fmaxf hides from "nan".
ENV_SHARED_FILL = "MINI_VLLM_EMU_SHARED_FILL"
SHARED_FILLS = ("nan", "huge")
_SANITIZER_OPTIONS = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:"
    "detect_stack_use_after_return=0:handle_segv=1:allow_user_segv_handler=0:"
    "fast_unwind_on_fatal=0:symbolize=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87:symbolize=1",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=88:report_signal_unsafe=0:history_size=4",
}


def _new_file(nbytes: int) -> int:
    """A file descriptor of a fresh, sparse, unnamed shared-memory file of `nbytes` bytes."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("mini_vllm_emulation", 0)
    else:  # macOS and others: an unlinked temporary file
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="mini_vllm_emulation-", dir=folder)
        os.unlink(path)
    os.ftruncate(fd, max(nbytes, 1))
    return fd


@dataclass
class _SharedFile:
    fd: int
    base: int
    length: int


# Files behind tensors made by shared_empty, by the address of their mapping. An entry dies with
# the mapping (the tensor holds the mmap object; the finalizer closes the descriptor).
_shared: dict[int, tuple[weakref.ref, _SharedFile]] = {}


def _padded(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def _region(nbytes: int) -> int:
    """Bytes of file that hold `nbytes` ending at a page boundary (16-byte aligned start)."""
    return max(-(-_padded(nbytes) // PAGE) * PAGE, PAGE)


def shared_empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory the emulator maps instead of copying.

    Use it for large inputs (a block pool of billions of elements): the operating system
    commits memory only for the pages that are written, in this process or the emulator's.
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    length = _region(nbytes)
    fd = _new_file(length)
    mm = mmap.mmap(fd, length)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    base = whole.data_ptr()
    _shared[base] = (weakref.ref(mm), _SharedFile(fd, base, length))
    weakref.finalize(mm, _forget, base, fd)
    start = length - _padded(nbytes)
    return whole[start : start + nbytes].view(dtype).view(shape)


def _forget(base: int, fd: int) -> None:
    _shared.pop(base, None)
    os.close(fd)


def _shared_file_of(ptr: int, nbytes: int) -> _SharedFile | None:
    for ref, sf in list(_shared.values()):
        if ref() is not None and sf.base <= ptr and ptr + nbytes <= sf.base + sf.length:
            return sf
    return None


def _span(t: torch.Tensor) -> torch.Tensor:
    """The bytes from the tensor's first element to its last (strides preserved), as uint8."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return torch.as_strided(t, (last + 1,), (1,)).view(torch.uint8)


@dataclass
class Arg:
    """A tensor argument: `writable` ones are copied back (unless shared) after the call."""

    tensor: torch.Tensor
    writable: bool = False


def run_op(
    exe: Path,
    op: str,
    buffers: dict[str, Arg],
    scalars: dict[str, int | float],
    *,
    device: str | None = None,
    own_files: tuple[Path, ...] = (),
    timeout: float | None = None,
) -> None:
    """Run `op` of emulator `exe` on `buffers` and `scalars`; outputs are written in place.

    Raises NotImplementedError / ValueError / RuntimeError for a launcher's Status (as the CUDA
    bindings do), and EmulationError when a kernel misbehaves (the message names the kernel,
    block, threads and source line).
    """
    device = device or os.environ.get(ENV_DEVICE) or "default"
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if timeout is None:
        timeout = float(os.environ.get(ENV_TIMEOUT, "600"))
    fill = os.environ.get(ENV_SHARED_FILL) or "nan"
    if fill not in SHARED_FILLS:
        raise ValueError(f"${ENV_SHARED_FILL} must be one of {SHARED_FILLS}, got {fill!r}")

    lines = [f"op {op}"]
    fds: list[int] = []
    copies: list[tuple[Arg, torch.Tensor]] = []
    plan: list[tuple[str, Arg, torch.Tensor, int]] = []  # name, arg, bytes view, offset in arena
    arena_len = 0
    for name, arg in buffers.items():
        t = arg.tensor
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the emulation backend needs CPU tensors")
        span = _span(t)
        nbytes = span.numel()
        sf = _shared_file_of(t.data_ptr(), nbytes) if nbytes else None
        if sf is not None:
            lines.append(f"buf {name} {sf.fd} {t.data_ptr() - sf.base} {nbytes} "
                         f"{'rw' if arg.writable else 'ro'}")
            if sf.fd not in fds:
                fds.append(sf.fd)
        else:
            region = _region(nbytes)
            plan.append((name, arg, span, arena_len + region - _padded(nbytes)))
            arena_len += region
    arena_fd = -1
    arena = None
    try:
        if plan:
            arena_fd = _new_file(arena_len)
            mm = mmap.mmap(arena_fd, arena_len)
            arena = torch.frombuffer(mm, dtype=torch.uint8)
            fds.append(arena_fd)
            for name, arg, span, offset in plan:
                n = span.numel()
                if n:
                    arena[offset : offset + n].copy_(span)
                lines.append(f"buf {name} {arena_fd} {offset} {n} {'rw' if arg.writable else 'ro'}")
                if arg.writable:
                    copies.append((arg, arena[offset : offset + n]))
        for name, value in scalars.items():
            kind = "float" if isinstance(value, float) else "int"
            lines.append(f"{kind} {name} {float(value)!r}" if kind == "float" else
                         f"int {name} {int(value)}")
        env = dict(os.environ, **_SANITIZER_OPTIONS)
        env[ENV_DEVICE] = device
        try:
            proc = subprocess.run([str(exe)], input="\n".join(lines) + "\n", pass_fds=fds,
                                  capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            raise EmulationError(
                f"{op}: the emulated kernel did not finish within {timeout:.0f} s (an endless "
                f"loop, or a wait that never ends?). Set {ENV_TIMEOUT} to allow longer.",
                report=(exc.stderr or b"").decode(errors="replace")
                if isinstance(exc.stderr, bytes) else (exc.stderr or ""),
            ) from None
        status = _status(proc.stdout)
        if proc.returncode != 0 or status is None:
            raise EmulationError(
                describe_failure(op, exe, proc.returncode, proc.stderr, own_files),
                report=proc.stderr,
            )
        # Only a completed op writes its outputs back, as the CUDA ops leave them on an error.
        code, message = status
        if code == 0:
            for arg, data in copies:
                _span(arg.tensor).copy_(data)
        _raise_for_status(op, code, message)
    finally:
        del arena
        if arena_fd >= 0:
            os.close(arena_fd)


def _status(stdout: str) -> tuple[int, str] | None:
    for line in stdout.splitlines():
        if line.startswith("MINI_VLLM_EMU_STATUS "):
            _, code, *rest = line.split(" ", 2)
            return int(code), (rest[0] if rest else "")
    return None


def _raise_for_status(op: str, code: int, message: str) -> None:
    """The same exceptions as bindings.cpp's raise_if_error (kernel_params.h's StatusCode)."""
    if code == 0:
        return
    if code == 1:
        raise NotImplementedError(message)
    if code == 2:
        raise ValueError(f"{op}: {message}")
    if code == 3:
        raise RuntimeError(f"{op}: CUDA error: {message}")
    raise RuntimeError(f"{op}: unknown status {code}: {message}")
