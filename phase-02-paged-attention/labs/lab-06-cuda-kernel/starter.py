"""Lab 02-06: PagedAttention in CUDA. This file builds and calls *your* kernels.

There is nothing to write here: your work is in ``starter.cu`` (tasks 1-4 of the README). This
module compiles ``starter.cu`` together with mini_vllm's bindings into its own extension
(``lab_02_06_starter``, cached under ``~/.cache/mini_vllm/build``) the first time an op is
called, checks every call's inputs exactly as the reference does, and runs your kernels.

While a task is not marked done in starter.cu (``LAB_TASK_N_DONE``), calling an op raises
``NotImplementedError`` naming that task.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from mini_vllm.csrc import CSRC_DIR, build_extension
from mini_vllm.csrc.ops import PARTITION_SIZE, check_attention_inputs

__all__ = [
    "PARTITION_SIZE",
    "build",
    "kernel_sources",
    "paged_attention_v1",
    "paged_attention_v2",
]

LAB_DIR = Path(__file__).resolve().parent
EXTENSION_NAME = "lab_02_06_starter"
_module: ModuleType | None = None


def build(verbose: bool = False) -> ModuleType:
    """Compile starter.cu (once per content, then cached) and import it.

    A compiler error comes back as ``mini_vllm.csrc.CudaBuildError`` with nvcc's output.
    """
    global _module
    if _module is None:
        _module = build_extension(
            EXTENSION_NAME,
            [LAB_DIR / "starter.cu", CSRC_DIR / "bindings.cpp"],
            defines=["MINI_VLLM_ATTENTION_ONLY"],  # bind only v1 and v2
            verbose=verbose,
        )
    return _module


def kernel_sources() -> list[Path]:
    """The CUDA translation units this implementation is built from (no torch headers)."""
    return [LAB_DIR / "starter.cu"]


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Your v1 kernel (tasks 1-3): decode attention over the paged cache, written to ``out``."""
    check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads, block_tables,
                           seq_lens, block_size, max_seq_len, alibi_slopes)
    build().paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                               block_tables, seq_lens, block_size, max_seq_len, alibi_slopes)


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Your v2 kernels (tasks 1-4): partitioned attention, then the merge, written to ``out``."""
    check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads, block_tables,
                           seq_lens, block_size, max_seq_len, alibi_slopes,
                           (exp_sums, max_logits, tmp_out))
    build().paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache,
                               value_cache, num_kv_heads, scale, block_tables, seq_lens,
                               block_size, max_seq_len, alibi_slopes)
