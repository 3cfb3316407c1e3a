"""Turning what an emulator process printed into one message a student can act on.

The runtime (runtime.cpp) and the sanitizers print machine-oriented reports: addresses, stack
frames through the emulation headers, offsets in the executable. A student needs the kind of
mistake, the buffer, the line of *their* file and which thread of which block, e.g.

    out-of-bounds read of key_cache at starter.cu:142, block (3,0,1), thread 17
    thread 5 left the kernel while threads 0-4 wait at the barrier at starter.cu:120

The whole report stays available as ``EmulationError.report`` (and is appended to the message
when MINI_VLLM_EMU_VERBOSE=1).

upstream: none (the CPU emulation is this course's)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

EMULATION_DIR = Path(__file__).resolve().parent
ENV_VERBOSE = "MINI_VLLM_EMU_VERBOSE"


class EmulationError(RuntimeError):
    """A kernel misbehaved in the CPU emulation; ``report`` holds the emulator's full output."""

    def __init__(self, message: str, report: str = ""):
        if report and os.environ.get(ENV_VERBOSE, "") not in ("", "0"):
            message += "\n--- emulator report ---\n" + report
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line}"


# ---- symbolization ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _symbolize(exe: str, offset: int) -> tuple[Frame, ...]:
    """The inline chain at `offset` of `exe`, innermost first (empty without addr2line)."""
    tool = shutil.which("addr2line")
    if tool is None:
        return ()
    try:
        out = subprocess.run([tool, "-e", exe, "-f", "-i", "-C", hex(offset)],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    lines = out.strip().splitlines()
    frames = []
    for fn, loc in zip(lines[0::2], lines[1::2]):
        path, _, line = loc.rpartition(":")
        line = line.split(" ")[0]
        if path in ("", "??") or not line.isdigit():
            continue
        frames.append(Frame(fn, path, int(line)))
    return tuple(frames)


def _short_function(name: str) -> str:
    """`void mini_vllm::foo<float, 128>(mini_vllm::P const&)` -> `foo<float, 128>`."""
    name = name.strip()
    for prefix in ("(anonymous namespace)::", "mini_vllm::", "mini_vllm_emu::"):
        name = name.replace(prefix, "")
    # Drop the parameter list: the parenthesised group that ends the name.
    if name.endswith(")") or name.endswith(") const"):
        end = name.rfind(")")
        depth = 0
        for i in range(end, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    # Drop a return type: the last space outside template brackets.
    depth, cut = 0, -1
    for i, c in enumerate(name):
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == " " and depth == 0:
            cut = i
    return name[cut + 1 :] if cut >= 0 else name


def _is_emulation(path: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(EMULATION_DIR)
    except OSError:
        return False


def _is_user(path: str, own: tuple[Path, ...]) -> bool:
    try:
        p = Path(path).resolve()
    except OSError:
        return False
    return p in own


def _pick(frames: list[Frame], own: tuple[Path, ...]) -> tuple[Frame | None, Frame | None]:
    """(the innermost frame in the student's own files, the innermost kernel-side frame)."""
    kernel_side = [f for f in frames if not _is_emulation(f.file) and "/usr/" not in f.file]
    mine = next((f for f in kernel_side if _is_user(f.file, own)), None)
    return mine, (kernel_side[0] if kernel_side else None)


def _location(frames: list[Frame], own: tuple[Path, ...], fallback: str = "") -> str:
    """"starter.cu:142" or "starter.cu:80 (in group_sum, common.cuh:67)"."""
    mine, inner = _pick(frames, own)
    if mine is None and inner is None:
        return fallback or "an unknown line"
    if mine is None:
        return inner.where
    if inner is not None and inner != mine:
        return f"{mine.where} (in {_short_function(inner.function)}, {inner.where})"
    return mine.where


_TOKEN = re.compile(r"\{\{(site|func):0x([0-9a-f]+)\|([^}]*)\}\}")


def _expand_tokens(text: str, exe: Path, own: tuple[Path, ...]) -> str:
    def sub(m: re.Match) -> str:
        kind, offset, rest = m.group(1), int(m.group(2), 16), m.group(3)
        frames = list(_symbolize(str(exe), offset))
        if kind == "func":
            return _short_function(frames[-1].function) if frames else rest
        file, _, line = rest.rpartition("|")
        called = Frame("", file, int(line)) if line.isdigit() else None
        # The call site as written (file:line) is exact; the inline chain adds the caller.
        if called is not None and _is_user(called.file, own):
            return called.where
        chain = [f for f in frames if not _is_emulation(f.file)]
        if called is not None and (not chain or chain[0].where != called.where):
            chain.insert(0, Frame("", called.file, called.line))
        return _location(chain, own, called.where if called else "")

    return _TOKEN.sub(sub, text)


# ---- the emulator's own lines ----------------------------------------------------------------


@dataclass
class _Context:
    kernel: str = ""
    block: str = ""
    thread: str = ""
    device: str = ""


_CONTEXT = re.compile(
    r"MINI_VLLM_EMU_CONTEXT (?:(?P<kernel>\{\{func:[^}]*\}\}) block (?P<block>\([0-9,]+\))"
    r"(?: (?P<thread>thread (?:\d+|\([0-9,]+\))))?|host) device (?P<device>\w+)"
)
_REGION = re.compile(r"MINI_VLLM_EMU_REGION 0x([0-9a-f]+) (\d+) (.+)")


def _context(stderr: str, exe: Path, own: tuple[Path, ...]) -> _Context:
    ctx = _Context()
    for m in _CONTEXT.finditer(stderr):
        ctx = _Context(
            kernel=_expand_tokens(m.group("kernel"), exe, own) if m.group("kernel") else "",
            block=m.group("block") or "",
            thread=m.group("thread") or "",
            device=m.group("device"),
        )
    return ctx


def _regions(stderr: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _REGION.finditer(stderr):
        out.append((int(m.group(1), 16), int(m.group(2)), m.group(3).strip()))
    return out


def _describe_address(addr: int, regions: list[tuple[int, int, str]]) -> tuple[str, str]:
    """(buffer name, where in it), e.g. ("key_cache", "32 bytes past its end")."""
    best = None
    for begin, size, name in regions:
        if begin <= addr < begin + max(size, 1):
            return name, f"byte {addr - begin} of {size}"
        dist = addr - (begin + size) if addr >= begin + size else begin - addr
        if best is None or dist < best[0]:
            best = (dist, begin, size, name)
    if best is None:
        return "", ""
    dist, begin, size, name = best
    if dist > 1 << 20:
        # Far from everything: name the buffer the address most likely derives from.
        below = [(b, s, n) for b, s, n in regions if b <= addr]
        if below:
            b, s, n = max(below)
            return n, f"{addr - (b + s)} bytes past its end, far outside it"
        return "", ""
    if addr == begin + size:
        return name, "just past its end"
    if addr >= begin + size:
        return name, f"{addr - (begin + size)} bytes past its end"
    return name, f"{begin - addr} bytes before its start"


def _where_suffix(ctx: _Context) -> str:
    parts = [p for p in (f"block {ctx.block}" if ctx.block else "", ctx.thread) if p]
    return ", " + ", ".join(parts) if parts else ""


def _kernel_suffix(ctx: _Context) -> str:
    return f" (kernel {ctx.kernel})" if ctx.kernel else ""


# ---- sanitizer reports -----------------------------------------------------------------------

_FRAME = re.compile(r"^\s*#\d+ 0x[0-9a-f]+ in (?P<fn>.+?) (?P<file>/[^\s:]+):(?P<line>\d+)")
_TSAN_FRAME = re.compile(r"^\s*#\d+ (?P<fn>.+?) (?P<file>/[^\s:]+):(?P<line>\d+)")


def _frames(block: str, pattern: re.Pattern = _FRAME) -> list[Frame]:
    out = []
    for line in block.splitlines():
        m = pattern.match(line)
        if m:
            out.append(Frame(m.group("fn"), m.group("file"), int(m.group("line"))))
    return out


def _asan(stderr: str, exe: Path, own, ctx: _Context) -> str | None:
    m = re.search(r"ERROR: AddressSanitizer: ([\w-]+)", stderr)
    if not m:
        return None
    kind = m.group(1)
    info = re.search(r"MINI_VLLM_EMU_ASAN addr=0x([0-9a-f]+) write=(\d) size=(\d+)", stderr)
    frames = _frames(stderr[m.start():])
    where = _location(frames, own)
    regions = _regions(stderr)
    if info:
        addr, write, size = int(info.group(1), 16), info.group(2) == "1", int(info.group(3))
    else:  # a deadly signal rather than an access ASan checked
        am = re.search(r"on unknown address (?:0x)?([0-9a-f]+)", stderr[m.start():])
        addr, size = (int(am.group(1), 16) if am else 0), 0
        write = bool(re.search(r"caused by a WRITE", stderr))
    access = "write" if write else "read"
    buffer, detail = _describe_address(addr, regions)
    if kind == "SEGV" and write and buffer.endswith(READ_ONLY) and detail.startswith("byte "):
        return (f"write to {_pretty_buffer(buffer)}, an input the op must not change, at {where}"
                f"{_where_suffix(ctx)}{_kernel_suffix(ctx)}")
    if kind in ("heap-buffer-overflow", "use-after-poison", "SEGV", "stack-buffer-overflow",
                "global-buffer-overflow", "unknown-crash"):
        what = f"out-of-bounds {access}"
        if kind == "SEGV":
            what = f"{access} of an invalid address (0x{addr:x})"
        target = f" of {_pretty_buffer(buffer)}" if buffer else ""
        extra = f" ({size} bytes, {detail})" if detail and size else ""
        extra = extra or (f" ({detail})" if detail else "")
        return f"{what}{target} at {where}{_where_suffix(ctx)}{extra}{_kernel_suffix(ctx)}"
    suffix = f"{_where_suffix(ctx)}{_kernel_suffix(ctx)}"
    return f"{kind.replace('-', ' ')} ({access}) at {where}{suffix}"


READ_ONLY = " (read-only)"


def _pretty_buffer(name: str) -> str:
    name = name.removesuffix(READ_ONLY)
    if name.startswith("shared "):
        return f"shared memory '{name[len('shared '):]}'"
    return name


def _ubsan(stderr: str, exe: Path, own, ctx: _Context) -> str | None:
    m = re.search(r"^(?P<file>[^\s:]+):(?P<line>\d+):\d+: runtime error: (?P<what>.+)$", stderr,
                  re.M)
    if not m:
        return None
    frames = [Frame("", m.group("file"), int(m.group("line"))), *_frames(stderr[m.end():])]
    where = _location(frames, own)
    what = m.group("what").strip()
    if "misaligned address" in what:
        am = re.search(r"misaligned address 0x([0-9a-f]+)", what)
        buffer, _ = _describe_address(int(am.group(1), 16), _regions(stderr)) if am else ("", "")
        target = f" of {_pretty_buffer(buffer)}" if buffer else ""
        return (f"misaligned access{target} at {where}{_where_suffix(ctx)} ({what})"
                f"{_kernel_suffix(ctx)}")
    return f"undefined behaviour at {where}{_where_suffix(ctx)}: {what}{_kernel_suffix(ctx)}"


_TSAN_ACCESS = re.compile(
    r"^\s*(?P<prev>Previous )?(?P<kind>[Aa]tomic )?(?P<rw>[Rr]ead|[Ww]rite) of size (?P<size>\d+) "
    r"at 0x(?P<addr>[0-9a-f]+) by (?P<who>[^:]+):", re.M)


def _tsan(stderr: str, exe: Path, own, ctx: _Context) -> str | None:
    m = re.search(r"WARNING: ThreadSanitizer: ([\w -]+)", stderr)
    if not m:
        return None
    accesses = list(_TSAN_ACCESS.finditer(stderr))
    if m.group(1).strip() != "data race" or len(accesses) < 2:
        return f"ThreadSanitizer: {m.group(1).strip()}{_where_suffix(ctx)}{_kernel_suffix(ctx)}"
    names = dict(re.findall(r"Thread (T\d+) '([^']+)'", stderr))

    def side(i: int) -> tuple[str, str, str]:
        a = accesses[i]
        end = accesses[i + 1].start() if i + 1 < len(accesses) else len(stderr)
        frames = _frames(stderr[a.end():end], _TSAN_FRAME)
        who = a.group("who").strip()
        tid = re.search(r"T\d+", who)
        name = names.get(tid.group(0), who) if tid else who
        if who.startswith("main thread"):
            name = "the host"
        verb = "writes" if a.group("rw").lower() == "write" else "reads"
        return name, verb, _location(frames, own)

    now, before = side(0), side(1)
    addr = int(accesses[0].group("addr"), 16)
    buffer, _ = _describe_address(addr, _regions(stderr))
    target = _pretty_buffer(buffer) if buffer else f"address 0x{addr:x}"
    # Fiber names are "thread 33 of block (0,0,0)": say the block once when it is the same.
    blocks = {re.sub(r".* of block ", "", n) for n in (now[0], before[0]) if " of block " in n}
    where = ""
    if len(blocks) == 1:
        where = f" in block {blocks.pop()}"
        now = (now[0].split(" of block ")[0], *now[1:])
        before = (before[0].split(" of block ")[0], *before[1:])
        between = "with no __syncthreads() (or warp collective) between them"
    else:
        between = ("but different blocks of a launch run in no particular order: one block "
                   "cannot wait for another")
    return (
        f"data race on {target}{where}: {before[0]} {before[1]} it at {before[2]} and "
        f"{now[0]} {now[1]} it at {now[2]} {between}{_kernel_suffix(ctx)}"
    )


def _signal(stderr: str, exe: Path, own, ctx: _Context) -> str | None:
    m = re.search(r"MINI_VLLM_EMU_SIGNAL (\d+) addr=0x([0-9a-f]+) pc=0x([0-9a-f]+) write=(-?\d)"
                  r"(?: stack-overflow=(\d+))?", stderr)
    if not m:
        return None
    sig, addr, pc = int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)
    frames = list(_symbolize(str(exe), pc)) if pc else []
    where = _location(frames, own)
    if m.group(5):
        return (f"stack overflow at {where}{_where_suffix(ctx)}: a thread used more than "
                f"{int(m.group(5)) // 1024} KB of stack (a huge local array, or recursion?)"
                f"{_kernel_suffix(ctx)}")
    if sig == 6:  # abort(): the C library found its own data corrupted
        said = re.search(r"^(?!MINI_VLLM)(.+)$", stderr, re.M)
        why = f" ({said.group(1).strip()})" if said else ""
        return (f"the emulator aborted{why} at {where}{_where_suffix(ctx)}: memory outside the "
                f"buffers was overwritten, most likely by an out-of-bounds write; "
                f"backend='emulation-asan' names the exact access{_kernel_suffix(ctx)}")
    names = {11: "segmentation fault", 7: "bus error", 8: "arithmetic exception",
             4: "illegal instruction"}
    buffer, detail = _describe_address(addr, _regions(stderr))
    if m.group(4) == "1" and buffer.endswith(READ_ONLY) and detail.startswith("byte "):
        return (f"write to {_pretty_buffer(buffer)}, an input the op must not change, at {where}"
                f"{_where_suffix(ctx)}{_kernel_suffix(ctx)}")
    access = {"1": "a write to", "0": "a read of"}.get(m.group(4), "an access to")
    target = f" near {_pretty_buffer(buffer)} ({detail})" if buffer else ""
    return (f"{names.get(sig, f'signal {sig}')} at {where}{_where_suffix(ctx)}: {access} "
            f"address 0x{addr:x}{target}. Out-of-bounds indexing? backend='emulation-asan' "
            f"names the exact access{_kernel_suffix(ctx)}")


def describe_failure(op: str, exe: Path, returncode: int, stderr: str,
                     own_files: tuple[Path, ...]) -> str:
    """One message for a failed emulator run (the kind of error, where, which thread)."""
    own = tuple(Path(p).resolve() for p in own_files)
    ctx = _context(stderr, exe, own)
    for line in stderr.splitlines():
        if line.startswith("MINI_VLLM_EMU_ERROR "):
            return f"{op}: {_expand_tokens(line[len('MINI_VLLM_EMU_ERROR '):], exe, own)}"
        if line.startswith("MINI_VLLM_EMU_BAD_REQUEST "):
            return f"{op}: the emulator rejected its request: {line.split(' ', 1)[1]}"
    for parse in (_ubsan, _asan, _tsan, _signal):
        message = parse(stderr, exe, own, ctx)
        if message:
            return f"{op}: {message}"
    tail = "\n".join(stderr.strip().splitlines()[-20:])
    return f"{op}: the emulator exited with status {returncode}:\n{tail}"
