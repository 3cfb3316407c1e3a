"""Lab 02-06 reference: mini_vllm's own CUDA paged attention (``mini_vllm/csrc``).

The kernels live once, in ``mini_vllm/csrc``; this file only exposes them with the lab's API.
Nothing is compiled at import: ``build()`` (called by the ops on first use) compiles the
kernels for the chosen backend (the GPU that is present, or the CPU emulation) and caches them
outside the source tree.
"""

from __future__ import annotations

from pathlib import Path

from mini_vllm.csrc import CSRC_DIR, KERNEL_SOURCES, load_ops
from mini_vllm.csrc.ops import (
    PARTITION_SIZE,
    paged_attention_naive,
    paged_attention_v1,
    paged_attention_v2,
)
from mini_vllm.csrc.probes import qk_logits_probe, softmax_probe

__all__ = [
    "PARTITION_SIZE",
    "build",
    "kernel_sources",
    "paged_attention_naive",
    "paged_attention_v1",
    "paged_attention_v2",
    "qk_logits_probe",
    "softmax_probe",
]


def build(verbose: bool = False, backend: str | None = None):
    """Compile (once, then cached) the kernels for `backend` and return their ops."""
    return load_ops(verbose=verbose, backend=backend)


def kernel_sources() -> list[Path]:
    """The CUDA translation units this implementation is built from (no torch headers)."""
    return [CSRC_DIR / name for name in KERNEL_SOURCES]
