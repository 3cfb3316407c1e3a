"""Building the emulator executables: kernel sources + runtime, compiled by the host C++ compiler.

One executable per (sources, build flavour, instantiations): the kernels are templates over the
dtype, head size and block size, and compiling all 54 combinations for the CPU takes minutes, so
a build compiles only the combination a call needs (``Variant``) and is cached on disk like the
nvcc build, under ``$MINI_VLLM_BUILD_DIR`` or ``~/.cache/mini_vllm/build``, keyed by the content
of every source and header, the flags and the compiler. An edited kernel is rebuilt; an
unchanged one is found in a few milliseconds.

Flavours:
  plain  -O2: runs the kernels, checks barriers and warp collectives, catches crashes;
  asan   AddressSanitizer + UndefinedBehaviorSanitizer: out-of-bounds and misaligned accesses,
         integer overflow, reads of freed memory;
  race   ThreadSanitizer with happens-before only at barriers, warp collectives and launches:
         data races between the threads of a block, and between blocks.

upstream: none (vLLM builds its kernels with CMake for GPUs only; this CPU build is the course's)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mini_vllm.csrc import first_compiler_error

EMULATION_DIR = Path(__file__).resolve().parent
CSRC_DIR = EMULATION_DIR.parent
FLAVORS = ("plain", "asan", "race")

_COMMON = ["-std=c++17", "-g", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
           "-Wno-unused-function", "-Wno-unused-variable"]
# Flags of the kernel translation units (the program under test).
_KERNEL_FLAGS = {
    "plain": ["-O2"],
    "asan": ["-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=all"],
    "race": ["-O1", "-fno-omit-frame-pointer", "-fsanitize=thread"],
}
# The runtime and driver are never instrumented: their bookkeeping is not under test.
_RUNTIME_DEFINES = {"plain": [], "asan": ["-DMINI_VLLM_EMU_ASAN"], "race": ["-DMINI_VLLM_EMU_TSAN"]}
_LINK_FLAGS = {"plain": [], "asan": ["-fsanitize=address,undefined"], "race": ["-fsanitize=thread"]}
_RUNTIME_SOURCES = ("runtime.cpp", "driver.cpp")
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
# KVCacheDType in kernel_params.h: "auto" is a cache in the model's dtype, "fp8" an e4m3 one.
KV_CACHE_DTYPE_CODES = {"auto": 0, "fp8": 1}


class EmulationBuildError(RuntimeError):
    """The emulator could not be built (the message holds the compiler's output)."""


@dataclass(frozen=True)
class Variant:
    """The kernel instantiations one executable contains (empty tuple: none)."""

    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    head_sizes: tuple[int, ...] = ()
    block_sizes: tuple[int, ...] = ()
    # The caches' element types (KV_CACHE_DTYPE_CODES): an attention call builds only its own.
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8")

    def defines(self) -> list[str]:
        def as_list(values, none: str = "0") -> str:
            return ",".join(str(v) for v in values) or none

        kv = as_list((KV_CACHE_DTYPE_CODES[k] for k in self.kv_cache_dtypes), none="-1")
        return [
            f"-DMINI_VLLM_DTYPES={as_list(DTYPE_CODES[d] for d in self.dtypes)}",
            f"-DMINI_VLLM_HEAD_SIZES={as_list(self.head_sizes)}",
            f"-DMINI_VLLM_BLOCK_SIZES={as_list(self.block_sizes)}",
            f"-DMINI_VLLM_KV_CACHE_DTYPES={kv}",
        ]

    def tag(self) -> str:
        dt = "-".join(d.replace("float", "f") for d in self.dtypes) or "none"
        hs = "-".join(map(str, self.head_sizes)) or "none"
        bs = "-".join(map(str, self.block_sizes)) or "none"
        kv = "-".join(self.kv_cache_dtypes) or "none"
        return f"{dt}_d{hs}_b{bs}_kv{kv}"


def compiler() -> str | None:
    """The host C++ compiler: $CXX, else c++, g++ or clang++ on PATH (None when there is none)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@cache
def _compiler_identity(cxx: str) -> str:
    proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return proc.stdout.splitlines()[0] if proc.stdout else cxx


@cache
def flavor_supported(flavor: str) -> str | None:
    """None when this machine can build `flavor`, else the reason it cannot."""
    cxx = compiler()
    if cxx is None:
        return ("no C++ compiler found (set CXX, or install g++ or clang++); the CPU emulation "
                "of the CUDA kernels needs one")
    if flavor == "plain":
        return None
    with tempfile.TemporaryDirectory(prefix="mini-vllm-probe-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        proc = subprocess.run([cxx, *_KERNEL_FLAGS[flavor], str(src), "-o", str(Path(tmp) / "a")],
                              capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tool = "AddressSanitizer" if flavor == "asan" else "ThreadSanitizer"
        return (f"{Path(cxx).name} cannot build with {tool} here ({proc.stderr.strip()[:200]}); "
                "on Debian/Ubuntu install libasan / libtsan for your g++")
    return None


def _build_root() -> Path:
    root = os.environ.get("MINI_VLLM_BUILD_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "mini_vllm" / "build") / "emulation"


def _emulation_files() -> list[Path]:
    files = [p for p in EMULATION_DIR.rglob("*") if p.suffix in (".h", ".cpp")]
    return sorted(files)


def _csrc_headers() -> list[Path]:
    return sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".h", ".cuh"))


def _digest(paths: Sequence[Path], *extra: object) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.name).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr(extra).encode())
    return h.hexdigest()[:16]


def _run_compiler(cmd: list[str], what: str) -> None:
    """Run a compile or link; on failure raise EmulationBuildError whose first line is the
    compiler's first error (file, line, text), followed by its whole output and the command."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        first = first_compiler_error(output)
        head = (f"{first} (compiling {what} for the CPU emulation: fix this first error, then "
                "run again)" if first else
                f"compiling {what} for the CPU emulation failed; fix the first error below, then "
                "run again")
        raise EmulationBuildError(f"{head}\n{output.rstrip()}\n(command: {' '.join(cmd)})")


class _Lock:
    """An exclusive lock on a build folder, so that parallel test runs build it once."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / ".lock", "w")  # noqa: SIM115 - released in __exit__

    def __enter__(self):
        fcntl.flock(self._file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def _jobs() -> int:
    return max(1, int(os.environ.get("MINI_VLLM_EMU_JOBS", os.cpu_count() or 1)))


@dataclass(frozen=True)
class Build:
    """A set of kernel sources built for emulation: ``executable(variant)`` builds on demand.

    ``name`` names the cache folders; ``sources`` are the kernel translation units (.cu, compiled
    as C++ with the flavour's instrumentation); ``bindings`` are the files that register ops
    with MINI_VLLM_EMU_OP (compiled without instrumentation; by default op_bindings.cpp, the
    mini_vllm ops; a test's own kernel file may register its ops itself and pass none);
    ``attention_only`` binds only paged_attention_naive/v1/v2 (all the lab starter provides),
    ``gqa_only`` only paged_attention_gqa (the lab's stretch starter);
    ``own_files`` are the files whose lines error messages point at first (the student's
    starter.cu, or every csrc source for the reference).
    """

    name: str
    sources: tuple[Path, ...]
    flavor: str = "plain"
    attention_only: bool = False
    gqa_only: bool = False
    bindings: tuple[Path, ...] = (EMULATION_DIR / "op_bindings.cpp",)
    own_files: tuple[Path, ...] = ()

    def __post_init__(self):
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")

    def _flags(self) -> list[str]:
        defines = ["-DMINI_VLLM_ATTENTION_ONLY"] if self.attention_only else []
        defines += ["-DMINI_VLLM_GQA_ONLY"] if self.gqa_only else []
        return [*_COMMON, f"-I{EMULATION_DIR / 'include'}", f"-I{EMULATION_DIR}", f"-I{CSRC_DIR}",
                *defines]

    def _runtime_flags(self) -> list[str]:
        return [*self._flags(), "-O2", *_RUNTIME_DEFINES[self.flavor]]

    def _runtime_objects(self, cxx: str) -> list[Path]:
        """runtime.o and driver.o: shared by every build of this flavour."""
        sources = [EMULATION_DIR / s for s in _RUNTIME_SOURCES]
        flags = self._runtime_flags()
        # They include only emulation files, so copies of the repository (a planted bug's) can
        # share them: the key leaves out the include paths.
        portable = [f for f in flags if not f.startswith("-I")]
        key = _digest(_emulation_files(), portable, _compiler_identity(cxx))
        folder = _build_root() / f"runtime-{self.flavor}-{key}"
        objects = [folder / (s.stem + ".o") for s in sources]
        if all(o.is_file() for o in objects):
            return objects
        with _Lock(folder):
            todo = [(s, o) for s, o in zip(sources, objects) if not o.is_file()]
            with ThreadPoolExecutor(max_workers=_jobs()) as pool:
                list(pool.map(lambda so: self._compile(cxx, so[0], so[1], flags), todo))
        return objects

    def _bindings_objects(self, cxx: str) -> list[Path]:
        """The op bindings' objects: shared by every instantiation (and checkout) they fit."""
        flags = self._runtime_flags()
        portable = [f for f in flags if not f.startswith("-I")]
        key = _digest([*self.bindings, *_csrc_headers(), *_emulation_files()], portable,
                      _compiler_identity(cxx))
        folder = _build_root() / f"bindings-{self.flavor}-{key}"
        objects = [folder / f"{i}-{p.stem}.o" for i, p in enumerate(self.bindings)]
        if all(o.is_file() for o in objects):
            return objects
        with _Lock(folder):
            for source, obj in zip(self.bindings, objects):
                if not obj.is_file():
                    self._compile(cxx, source, obj, flags)
        return objects

    def _compile(self, cxx: str, source: Path, obj: Path, flags: list[str]) -> None:
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        lang = ["-x", "c++"] if source.suffix in (".cu", ".cuh") else []
        _run_compiler([cxx, *lang, *flags, "-c", str(source), "-o", str(tmp)], source.name)
        tmp.replace(obj)

    def _kernel_object(self, cxx: str, source: Path, flags: list[str]) -> Path:
        """One kernel translation unit's object, cached on its own: an edit of one source (a
        student's starter.cu, a planted bug) recompiles that source only. The key holds the
        source's path and the include paths (the object's debug information names them, and
        error messages point at those lines), so a copy of the repository elsewhere builds its
        own."""
        key = _digest([source, *_csrc_headers(), *_emulation_files()], flags,
                      _compiler_identity(cxx), str(source))
        folder = _build_root() / f"object-{source.stem}-{self.flavor}-{key}"
        obj = folder / (source.stem + ".o")
        if obj.is_file():
            return obj
        with _Lock(folder):
            if not obj.is_file():
                self._compile(cxx, source, obj, flags)
        return obj

    def executable(self, variant: Variant) -> Path:
        """The emulator for `variant`, built now unless an identical build is cached: each
        kernel source is compiled (or found) alone, then linked."""
        reason = flavor_supported(self.flavor)
        if reason:
            raise EmulationBuildError(reason)
        cxx = compiler()
        assert cxx is not None
        kernel_flags = [*self._flags(), *_KERNEL_FLAGS[self.flavor], *variant.defines()]
        with ThreadPoolExecutor(max_workers=_jobs()) as pool:
            objects = list(pool.map(lambda s: self._kernel_object(cxx, s, kernel_flags),
                                    self.sources))
        runtime = self._runtime_objects(cxx) + self._bindings_objects(cxx)
        # Every object's path holds the key of its content: the paths key the link.
        key = _digest([], [str(o) for o in (*objects, *runtime)], _LINK_FLAGS[self.flavor])
        folder = _build_root() / f"{self.name}-{self.flavor}-{variant.tag()}-{key}"
        exe = folder / "emulator"
        if exe.is_file():
            return exe
        with _Lock(folder):
            if exe.is_file():
                return exe
            tmp = folder / f"emulator.{os.getpid()}.tmp"
            _run_compiler([cxx, *_LINK_FLAGS[self.flavor], *map(str, objects), *map(str, runtime),
                           "-ldl", "-o", str(tmp)], f"the {self.name} emulator (link)")
            tmp.replace(exe)
        return exe
