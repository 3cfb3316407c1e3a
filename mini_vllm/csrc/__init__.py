"""mini_vllm's CUDA kernels (upstream's are in csrc/): built on first use, cached, and optional.

The kernel sources (``*.cu``, ``*.cuh``, ``kernel_params.h``) include no torch header and compile
with plain ``nvcc``; ``bindings.cpp`` connects them to PyTorch. ``load_ops()`` builds both with
``torch.utils.cpp_extension`` for the GPU that is present, into a folder outside the source tree
(``~/.cache/mini_vllm/build/<name>-<hash>``, or ``$MINI_VLLM_BUILD_DIR``) keyed by the sources'
content, so an edited kernel is rebuilt and an unchanged one is loaded in a second.

The engine asks ``cuda_ops_available()`` and uses these ops when it says True, the PyTorch ops of
``mini_vllm.attention`` otherwise. The wrappers with the checked signatures are in ``ops.py``.

Backends. The same ops also run without a GPU, in the CPU emulation of ``emulation/`` (the
kernel sources compiled by the host C++ compiler; CPU tensors in and out). Each op takes a
``backend`` argument, and ``$MINI_VLLM_KERNEL_BACKEND`` sets the default:

  cuda              the nvcc build on the GPU (the default when torch sees a GPU)
  emulation         the CPU emulation (the default without a GPU)
  emulation-asan    the emulation with AddressSanitizer + UndefinedBehaviorSanitizer
  emulation-race    the emulation with ThreadSanitizer (races between the threads of a block)

upstream: none (vLLM compiles its kernels ahead of time with CMake; this JIT loader is ours)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "BACKENDS",
    "CSRC_DIR",
    "KERNEL_SOURCES",
    "HEADERS",
    "CudaBuildError",
    "build_extension",
    "cuda_ops_available",
    "first_compiler_error",
    "emulation_build",
    "load_ops",
    "resolve_backend",
]

CSRC_DIR = Path(__file__).resolve().parent
# One translation unit per kernel family, so a parallel build compiles them side by side.
KERNEL_SOURCES = (
    "paged_attention_naive.cu",  # lab 02-06's task 0: the baseline the others improve on
    "paged_attention_v1.cu",
    "paged_attention_v2.cu",
    "paged_attention_gqa.cu",
    "cache_kernels.cu",
    "attention_probes.cu",  # lab 02-06's test probes (steps 1 and 2 alone)
)
HEADERS = (
    "kernel_params.h",
    "portable.cuh",
    "common.cuh",
    "dispatch.cuh",
    "attention_core.cuh",
    "partition_reduce.cuh",
    "gqa_common.cuh",
    "gqa_scalar_kernel.cuh",
    "attention_probes.cuh",
)
BINDINGS = "bindings.cpp"
OPS_NAME = "mini_vllm_ops"

BACKENDS = ("cuda", "emulation", "emulation-asan", "emulation-race")
BACKEND_ENV = "MINI_VLLM_KERNEL_BACKEND"
# The build flavour of each emulation backend (see emulation/build.py).
EMULATION_FLAVORS = {"emulation": "plain", "emulation-asan": "asan", "emulation-race": "race"}

_lock = threading.Lock()
_ops: ModuleType | None = None
_ops_error: Exception | None = None
_emulated: dict[str, object] = {}


class CudaBuildError(RuntimeError):
    """The CUDA extension could not be built or loaded (the message holds the compiler output)."""


# A compiler's error line: gcc/clang "path:line:col: error: text", nvcc "path(line): error: text"
# (either may say "fatal error").
_ERROR_LINE = re.compile(
    r"^(?P<path>[^\s:()][^:()]*?)(?::(?P<line>\d+)(?::\d+)?|\((?P<nvline>\d+)\)):\s*"
    r"(?:fatal )?error:\s*(?P<text>.*\S)", re.M)


def first_compiler_error(output: str) -> str | None:
    """The first error of a compiler's `output` as one line, ``file:line: error: text`` with the
    file's name only; None when the output holds no error line (a linker or tool failure).

    The first error is the one to fix: later ones often follow from it."""
    m = _ERROR_LINE.search(output)
    if m is None:
        return None
    return f"{Path(m['path']).name}:{m['line'] or m['nvline']}: error: {m['text']}"


def _build_root() -> Path:
    root = os.environ.get("MINI_VLLM_BUILD_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mini_vllm" / "build"


def _gpu_arch() -> str:
    """The present GPU's compute capability as nvcc spells it ("90" for an H100)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def build_extension(
    name: str,
    sources: Sequence[str | Path],
    *,
    defines: Sequence[str] = (),
    verbose: bool = False,
) -> ModuleType:
    """Compile ``sources`` into a Python extension module called ``name`` and import it.

    ``sources`` are .cu/.cpp paths (relative ones are taken from this folder); this folder is on
    the include path. Builds for the present GPU only. Raises ``CudaBuildError`` with the
    compiler's output when the build fails, and when there is no GPU or no CUDA toolkit.
    """
    import torch

    if not torch.cuda.is_available():
        raise CudaBuildError(
            f"cannot build {name}: no CUDA GPU is visible (torch.cuda.is_available() is False). "
            "The CUDA ops need an NVIDIA GPU; on this machine use mini_vllm.attention instead."
        )
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        raise CudaBuildError(
            f"cannot build {name}: the CUDA toolkit (nvcc) was not found; install it or set "
            "CUDA_HOME"
        )
    paths = [Path(s) if Path(s).is_absolute() else CSRC_DIR / s for s in sources]
    arch = _gpu_arch()
    digest = hashlib.sha256()
    for path in sorted({*paths, *(CSRC_DIR / h for h in HEADERS)}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((sorted(defines), arch, torch.__version__, torch.version.cuda)).encode())
    build_dir = _build_root() / f"{name}-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)

    define_flags = [f"-D{d}" for d in defines]
    # Naming the architecture ourselves stops torch from adding every arch it knows about.
    cuda_flags = [
        "-O3",
        "-lineinfo",  # source lines in compute-sanitizer and profiler reports
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        *define_flags,
    ]
    old_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[:-1]}.{arch[-1]}"
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in paths],
            extra_cflags=["-O3", *define_flags],  # torch adds -std=c++20
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[str(CSRC_DIR)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as exc:  # the compiler's output is in the message
        first = first_compiler_error(str(exc))
        where = f"building the CUDA extension {name!r} for sm_{arch}"
        head = (f"{first} ({where}: fix this first error, then run again)" if first else
                f"{where} failed; fix the first compiler error below, then run again")
        raise CudaBuildError(
            f"{head}\n{exc}\n(build folder: {build_dir}; pass verbose=True to see every command)"
        ) from exc
    finally:
        if old_arch_list is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch_list


def resolve_backend(backend: str | None = None) -> str:
    """The backend to use: `backend` if given, else $MINI_VLLM_KERNEL_BACKEND, else "cuda" when
    torch sees a GPU and "emulation" when it does not ("auto" means the same)."""
    choice = backend or os.environ.get(BACKEND_ENV, "") or "auto"
    if choice == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "emulation"
    if choice not in BACKENDS:
        source = "backend" if backend else f"${BACKEND_ENV}"
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)} or auto, got {choice!r}")
    return choice


def emulation_build(name: str, sources: Sequence[str | Path], backend: str, *,
                    attention_only: bool = False, gqa_only: bool = False,
                    own_files: Sequence[Path] = ()):
    """The emulation build of `sources` for an emulation `backend` (see emulation/build.py)."""
    from mini_vllm.csrc.emulation import Build

    paths = tuple(Path(s) if Path(s).is_absolute() else CSRC_DIR / s for s in sources)
    return Build(name, paths, flavor=EMULATION_FLAVORS[backend], attention_only=attention_only,
                 gqa_only=gqa_only, own_files=tuple(own_files) or paths)


def load_ops(verbose: bool = False, backend: str | None = None):
    """The mini_vllm ops for `backend` (see resolve_backend): the compiled extension module for
    "cuda" (built on the first call, then cached for the process), an ``EmulatedOps`` with the
    same functions for the emulation backends (each kernel instantiation built on first use).

    Raises ``CudaBuildError`` (with the compiler output) when the CUDA ops cannot be built; a
    failed build is remembered and re-raised rather than retried on every call.
    """
    backend = resolve_backend(backend)
    if backend != "cuda":
        with _lock:
            if backend not in _emulated:
                from mini_vllm.csrc.emulation import EmulatedOps

                own = sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".cu", ".cuh"))
                _emulated[backend] = EmulatedOps(
                    emulation_build(OPS_NAME, KERNEL_SOURCES, backend, own_files=own)
                )
            return _emulated[backend]
    global _ops, _ops_error
    with _lock:
        if _ops is not None:
            return _ops
        if _ops_error is not None:
            raise _ops_error
        try:
            _ops = build_extension(OPS_NAME, [*KERNEL_SOURCES, BINDINGS], verbose=verbose)
        except Exception as exc:
            _ops_error = exc if isinstance(exc, CudaBuildError) else CudaBuildError(str(exc))
            raise _ops_error from exc
        return _ops


def cuda_ops_available() -> bool:
    """True when a CUDA GPU is present and the ops build and load; never raises.

    Set MINI_VLLM_DISABLE_CUDA_OPS=1 to force the PyTorch ops.
    """
    if os.environ.get("MINI_VLLM_DISABLE_CUDA_OPS", "") not in ("", "0"):
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        load_ops()
        return True
    except Exception:
        return False
