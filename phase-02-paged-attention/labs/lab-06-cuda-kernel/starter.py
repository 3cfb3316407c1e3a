"""Lab 02-06: PagedAttention in CUDA. This file builds and calls *your* kernels.

There is nothing to write here: your work is in ``starter.cu`` (tasks 0-4 of the README). This
module compiles ``starter.cu`` the first time an op is called, checks every call's inputs exactly
as the reference does, and runs your kernels, on one of two backends (the ``backend`` argument,
or ``$MINI_VLLM_KERNEL_BACKEND``; see ``mini_vllm.csrc.resolve_backend``):

* ``cuda`` (the default on a machine with a GPU): nvcc builds starter.cu with mini_vllm's
  bindings into its own extension, ``lab_02_06_starter``;
* ``emulation`` (the default without a GPU), ``emulation-asan``, ``emulation-race``: the host
  C++ compiler builds the same starter.cu against a CUDA emulation and runs it on the CPU, with
  AddressSanitizer or ThreadSanitizer for the last two.

Builds are cached under ``~/.cache/mini_vllm/build``. While a task is not marked done in
starter.cu (``LAB_TASK_N_DONE``), calling an op raises ``NotImplementedError`` naming that task
(without building anything).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mini_vllm.csrc import CSRC_DIR, build_extension, emulation_build, resolve_backend
from mini_vllm.csrc.ops import PARTITION_SIZE, check_attention_inputs, check_naive_inputs
from mini_vllm.csrc.probes import check_qk_logits_probe, check_softmax_probe

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

LAB_DIR = Path(__file__).resolve().parent
STARTER_CU = LAB_DIR / "starter.cu"
EXTENSION_NAME = "lab_02_06_starter"
_built: dict[str, object] = {}


def build(verbose: bool = False, backend: str | None = None):
    """Compile starter.cu for `backend` (once per content, then cached) and return its ops.

    On "cuda", a compiler error comes back as ``mini_vllm.csrc.CudaBuildError`` with nvcc's
    output; on the emulation backends as ``EmulationBuildError`` with the host compiler's.
    """
    backend = resolve_backend(backend)
    if backend not in _built:
        if backend == "cuda":
            _built[backend] = build_extension(
                EXTENSION_NAME,
                [STARTER_CU, CSRC_DIR / "bindings.cpp"],
                defines=["MINI_VLLM_ATTENTION_ONLY"],  # bind only naive, v1, v2, the probes
                verbose=verbose,
            )
        else:
            from mini_vllm.csrc.emulation import EmulatedOps

            _built[backend] = EmulatedOps(emulation_build(
                EXTENSION_NAME, [STARTER_CU], backend, attention_only=True, own_files=[STARTER_CU]
            ))
    return _built[backend]


def _check_tasks_done(tasks: tuple[int, ...]) -> None:
    """Raise the launchers' NotImplementedError for the first of `tasks` that starter.cu does
    not mark done, before anything is compiled (the message is the one starter.cu returns)."""
    text = STARTER_CU.read_text(encoding="utf-8")
    for task in tasks:
        done = re.search(rf"^#define LAB_TASK_{task}_DONE\s+(\d+)", text, re.M)
        if done and done.group(1) == "0":
            said = re.search(rf'"(lab 02-06, task {task}: [^"]*)"', text)
            # The message is starter.cu's own "lab 02-06, task N: ..." for that task.
            error = NotImplementedError(
                said.group(1) if said else f"lab 02-06, task {task}: finish it in starter.cu, "
                f"then set LAB_TASK_{task}_DONE to 1 (hint: python -m course hint 02-06 {task})"
            )
            raise error


def _refuse_fp8(kv_cache_dtype: str) -> None:
    """The lab's kernels read a cache in the model's dtype; the fp8 cache is the reference's."""
    if kv_cache_dtype != "auto":
        raise ValueError("lab 02-06's kernels read a KV cache in the model's dtype only "
                         f"(unsupported: kv_cache_dtype={kv_cache_dtype!r}); the fp8 path is "
                         "the reference's, in mini_vllm.csrc.ops")


def kernel_sources() -> list[Path]:
    """The CUDA translation units this implementation is built from (no torch headers)."""
    return [LAB_DIR / "starter.cu"]


def paged_attention_naive(
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
    backend: str | None = None,
) -> None:
    """Your naive kernel (task 0): v1's contract, one thread per token or output row, for
    contexts up to ``mini_vllm.csrc.ops.naive_max_seq_len(head_size)`` tokens."""
    backend = check_naive_inputs(out, query, key_cache, value_cache, num_kv_heads, block_tables,
                                 seq_lens, block_size, max_seq_len, alibi_slopes, backend=backend)
    _check_tasks_done((0,))
    build(backend=backend).paged_attention_naive(out, query, key_cache, value_cache,
                                                 num_kv_heads, scale, block_tables, seq_lens,
                                                 block_size, max_seq_len, alibi_slopes)


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
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    backend: str | None = None,
) -> None:
    """Your v1 kernel (tasks 1-3): decode attention over the paged cache, written to ``out``.

    The caches hold the model's dtype: an fp8 cache (``kv_cache_dtype="fp8"``) is the
    reference's path (``mini_vllm.csrc.ops``) and is refused here."""
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, backend=backend, kv_cache_dtype=kv_cache_dtype,
                                     k_scale=k_scale, v_scale=v_scale)
    _refuse_fp8(kv_cache_dtype)
    _check_tasks_done((1, 2, 3))
    build(backend=backend).paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads,
                                              scale, block_tables, seq_lens, block_size,
                                              max_seq_len, alibi_slopes)


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
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    backend: str | None = None,
) -> None:
    """Your v2 kernels (tasks 1-4): partitioned attention, then the merge, written to ``out``.
    Caches in the model's dtype only, as ``paged_attention_v1``."""
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, (exp_sums, max_logits, tmp_out), backend,
                                     kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                                     v_scale=v_scale)
    _refuse_fp8(kv_cache_dtype)
    _check_tasks_done((1, 2, 3, 4))
    build(backend=backend).paged_attention_v2(out, exp_sums, max_logits, tmp_out, query,
                                              key_cache, value_cache, num_kv_heads, scale,
                                              block_tables, seq_lens, block_size, max_seq_len,
                                              alibi_slopes)


def qk_logits_probe(
    logits: torch.Tensor,
    range_max: torch.Tensor,
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
    range_tokens: int = 0,
    backend: str | None = None,
) -> None:
    """Your task 1 alone, for the tests (``mini_vllm/csrc/attention_probes.cuh``): every slot's
    logit to ``logits``, each range's max valid logit to ``range_max``."""
    backend, tokens = check_qk_logits_probe(
        logits, range_max, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, range_tokens, backend)
    _check_tasks_done((1,))
    build(backend=backend).qk_logits_probe(logits, range_max, query, key_cache, value_cache,
                                           num_kv_heads, scale, block_tables, seq_lens,
                                           block_size, max_seq_len, alibi_slopes, tokens)


def softmax_probe(rows: torch.Tensor, lengths: torch.Tensor, stats: torch.Tensor,
                  backend: str | None = None) -> None:
    """Your task 2 alone, for the tests: the softmax numerators of each row's first
    ``lengths[r]`` entries in place, and the (max, sum) each thread got in ``stats``."""
    backend = check_softmax_probe(rows, lengths, stats, backend)
    _check_tasks_done((2,))
    build(backend=backend).softmax_probe(rows, lengths, stats)
