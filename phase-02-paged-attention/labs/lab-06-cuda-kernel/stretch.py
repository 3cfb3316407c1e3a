"""Lab 02-06, stretch (optional): builds and calls *your* GQA-aware kernel, ``stretch_gqa.cu``.

Nothing to write here. Like ``starter.py`` for the graded tasks, this module compiles
``stretch_gqa.cu`` on the first call (nvcc with a GPU, the CPU emulation without one; see
``starter.py``), checks every call's inputs exactly as the reference ``paged_attention_gqa``
does, and runs your kernel. While a stretch task is not marked done (``STRETCH_TASK_N_DONE``), a
call raises ``NotImplementedError`` naming it, without building anything.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mini_vllm.csrc import CSRC_DIR, build_extension, emulation_build, resolve_backend
from mini_vllm.csrc.ops import check_gqa_inputs

__all__ = ["STRETCH_CU", "build", "paged_attention_gqa", "stretch_started"]

STRETCH_CU = Path(__file__).resolve().parent / "stretch_gqa.cu"
EXTENSION_NAME = "lab_02_06_stretch"
_DONE_RE = re.compile(r"^#define STRETCH_TASK_(\d)_DONE\s+(\d+)", re.M)
_built: dict[str, object] = {}


def build(verbose: bool = False, backend: str | None = None):
    """Compile stretch_gqa.cu for `backend` (once per content, then cached) and return its ops."""
    backend = resolve_backend(backend)
    if backend not in _built:
        if backend == "cuda":
            _built[backend] = build_extension(
                EXTENSION_NAME, [STRETCH_CU, CSRC_DIR / "bindings.cpp"],
                defines=["MINI_VLLM_GQA_ONLY"], verbose=verbose)
        else:
            from mini_vllm.csrc.emulation import EmulatedOps

            _built[backend] = EmulatedOps(emulation_build(
                EXTENSION_NAME, [STRETCH_CU], backend, gqa_only=True, own_files=[STRETCH_CU]))
    return _built[backend]


def _marks() -> dict[int, bool]:
    return {int(n): v != "0" for n, v in _DONE_RE.findall(STRETCH_CU.read_text("utf-8"))}


def stretch_started() -> bool:
    """Whether stretch_gqa.cu marks any stretch task done (the tests skip until it does)."""
    return any(_marks().values())


def paged_attention_gqa(
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
    backend: str | None = None,
    partition_size: int | None = None,
) -> None:
    """Your GQA-aware kernel: ``mini_vllm.csrc.ops.paged_attention_gqa``'s contract for fp16 and
    bf16 with a cache in the model's dtype (fp32 decode runs v2; the fp8 cache is the
    reference's)."""
    backend, partition_size = check_gqa_inputs(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, backend=backend,
        partition_size=partition_size)
    if query.dtype == torch.float32:
        raise ValueError("the stretch kernel is for float16 and bfloat16; float32 decode runs "
                         "paged_attention_v2")
    for task, done in sorted(_marks().items()):
        if not done:  # the launcher's own message for that task, read from stretch_gqa.cu
            said = re.search(rf'"(lab 02-06, stretch task {task}: [^"]*)"',
                             STRETCH_CU.read_text("utf-8"))
            raise NotImplementedError(said.group(1) if said else
                                      f"lab 02-06, stretch task {task}: finish it in "
                                      f"stretch_gqa.cu, then set STRETCH_TASK_{task}_DONE to 1")
    build(backend=backend).paged_attention_gqa(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, partition_size)
