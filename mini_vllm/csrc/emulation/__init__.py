"""CPU emulation of mini_vllm's CUDA kernels: the unmodified sources, the host C++ compiler.

The kernel sources in ``mini_vllm/csrc`` compile with g++/clang++ against ``cuda_emulation.h``
(a small CUDA subset) and run on the CPU: blocks one after another, each CUDA thread a
cooperative fiber, ``__syncthreads()`` and warp shuffles as rendezvous points that report
misuse instead of hanging (``runtime.cpp``). Three builds: ``plain``, ``asan``
(AddressSanitizer + UndefinedBehaviorSanitizer) and ``race`` (ThreadSanitizer, ordering only at
barriers and collectives). See the lab 02-06 README for what this proves and what only a GPU
shows.

Use it through the ops' backend choice (``mini_vllm.csrc.ops.paged_attention_v1(...,
backend="emulation")`` or ``MINI_VLLM_KERNEL_BACKEND=emulation``), or directly::

    ops = EmulatedOps(Build("mini_vllm_ops", sources, flavor="asan"))
    ops.paged_attention_v1(out, query, key_cache, ...)   # CPU tensors, written in place

upstream: none (vLLM tests its kernels on GPUs only)

upstream: none (course-only: vLLM's kernels run on GPUs alone)
"""

from __future__ import annotations

from mini_vllm.csrc.emulation.build import (
    FLAVORS,
    Build,
    EmulationBuildError,
    Variant,
    compiler,
    flavor_supported,
)
from mini_vllm.csrc.emulation.emulated_ops import EmulatedOps
from mini_vllm.csrc.emulation.reports import EmulationError
from mini_vllm.csrc.emulation.run import DEVICES, Arg, run_op, shared_empty

__all__ = [
    "DEVICES",
    "FLAVORS",
    "Arg",
    "Build",
    "EmulatedOps",
    "EmulationBuildError",
    "EmulationError",
    "Variant",
    "compiler",
    "flavor_supported",
    "run_op",
    "shared_empty",
]
