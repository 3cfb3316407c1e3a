"""Lab 02-04 starter: PagedAttention in PyTorch.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README. Each
docstring is a contract: what goes in, what comes out, what must hold afterwards, which errors. How
to get there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 02-04
N`` (a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

Layouts (``x = 16 // element_size``: 4 for float32, 8 for float16/bfloat16, 16 for the
float8_e4m3fn cache of task 7)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size,      block_size]
    flash       [num_blocks, block_size, num_kv_heads, head_size]        (keys and values alike)

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; a slot is ``block * block_size + offset``. Element ``d`` of its key for KV
head ``h`` is ``key_cache[block, h, d // x, offset, d % x]``; of its value
``value_cache[block, h, d, offset]``.

What a cache holds outside the context is junk: slots past a sequence's ``seq_len``, blocks no
sequence owns, and block-table entries past ``ceil(seq_len / block_size)`` may hold anything
(NaN, inf, -1, ids beyond the cache). The decode functions must give the same result whatever
that junk is (the tests fill it with NaN).

Rules: use tensor operations (no Python loop over tokens or sequences; a loop over v2's
partitions is fine), and do not import from ``mini_vllm.attention.paged_attn`` or ``cache_ops``
(that is the answer). The input checks in ``mini_vllm.attention.paged_checks`` are complete and
yours to use: call them first, so that a bad call raises ``ValueError`` before anything is
written. Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-02-paged-attention/labs/lab-04-paged-attention -q
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.attention.fp8 import FP8_DTYPE, FP8_E4M3_MAX  # noqa: F401  (task 7)
from mini_vllm.attention.paged_checks import (  # noqa: F401  (helpers for you to call)
    CACHE_DTYPES,
    KV_CACHE_TORCH_DTYPES,
    check_copy,
    check_decode_inputs,
    check_flash_caches,
    check_out,
    check_paged_caches,
    check_slots,
    check_swap,
    check_v2_buffers,
)

__all__ = [
    "PARTITION_SIZE",
    "kv_cache_x",
    "get_kv_cache_shape",
    "split_kv_cache",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_v2_reduce",
    "use_v1",
    "forward_decode",
    "copy_blocks",
    "swap_blocks",
    "scaled_fp8_quant",
    "scaled_fp8_dequant",
]

# Tokens per v2 partition (upstream's value). Every block size divides it.
PARTITION_SIZE = 512


def _num_partitions(max_seq_len: int) -> int:
    """Partitions of PARTITION_SIZE tokens needed for ``max_seq_len`` tokens (at least 1)."""
    return max(1, -(-int(max_seq_len) // PARTITION_SIZE))


# ------------------------------------------------------------------------------------------
# Task 1: layouts
# ------------------------------------------------------------------------------------------


def kv_cache_x(dtype: torch.dtype) -> int:
    """``x``: how many elements of ``dtype`` fill one 16-byte vector (4 for float32, 8 for
    float16 and bfloat16; 16 for ``FP8_DTYPE``, the float8_e4m3fn cache of task 7).

    Errors: a dtype outside ``CACHE_DTYPES`` and ``FP8_DTYPE`` (int64, float64, ...) raises
    ``ValueError``.
    """
    raise NotImplementedError(
        "lab 02-04, task 1: implement kv_cache_x (hint: python -m course hint 02-04 1)"
    )


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int]:
    """The shape of one layer's combined cache: ``(2, num_blocks, block_size * num_kv_heads *
    head_size)``, keys in half 0 and values in half 1, one flat row per block.

    Errors: any argument that is not a positive int (0, -1, 2.0) raises ``ValueError``.
    """
    raise NotImplementedError(
        "lab 02-04, task 1: implement get_kv_cache_shape (hint: python -m course hint 02-04 1)"
    )


def split_kv_cache(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` in the layouts above, as views of ``kv_cache`` (a tensor of
    ``get_kv_cache_shape``'s shape): a write through either lands in ``kv_cache``, keys in
    ``kv_cache[0]``, values in ``kv_cache[1]``. The block size is what the row length implies:
    ``n // (num_kv_heads * head_size)`` for rows of ``n`` elements; ``x`` is the dtype's.

    Errors (``ValueError``): ``kv_cache`` not of shape ``(2, num_blocks, n)``; ``head_size`` not
    a multiple of ``x``; ``n`` not a multiple of ``num_kv_heads * head_size``.
    """
    raise NotImplementedError(
        "lab 02-04, task 1: implement split_kv_cache (hint: python -m course hint 02-04 1)"
    )


# ------------------------------------------------------------------------------------------
# Task 2: writing the cache
# ------------------------------------------------------------------------------------------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Write token ``i``'s key and value into slot ``slot_mapping[i]`` of the x-split caches.

    Inputs: ``key``, ``value`` ``[num_tokens, num_kv_heads, head_size]`` in the caches' dtype;
    ``slot_mapping`` 1-D int64 or int32 with at most ``num_tokens`` entries; slot ``s`` is block
    ``s // block_size``, offset ``s % block_size``.

    Afterwards, for every ``i < len(slot_mapping)`` with ``s = slot_mapping[i] >= 0``:
    ``key_cache[s // block_size, h, d // x, s % block_size, d % x] == key[i, h, d]`` and
    ``value_cache[s // block_size, h, d, s % block_size] == value[i, h, d]`` for every ``h, d``.
    Nothing else changes: a negative slot marks a padding token, which writes nothing (slot -1
    is not the last slot), and tokens past ``len(slot_mapping)`` are not written.

    Errors (``ValueError``, raised before anything is written; ``check_paged_caches`` and
    ``check_slots`` do it): caches of another shape, ``x`` or dtype; a slot beyond the cache;
    two tokens in one slot; a slot mapping longer than ``key``. Tensor ops only.

    Task 7 (FP8 cache): with ``kv_cache_dtype="fp8"`` (or ``"fp8_e4m3"``) the caches are
    float8_e4m3fn (``x = 16``) and the stored values are ``scaled_fp8_quant(key, k_scale)`` and
    ``scaled_fp8_quant(value, v_scale)``. With ``"auto"`` (the default) the scales are ignored.
    Pass ``kv_cache_dtype, k_scale, v_scale`` to ``check_paged_caches``: it refuses an fp8
    cache under ``"auto"``, a model-dtype cache under ``"fp8"``, and a scale that is zero,
    negative or not finite.
    """
    raise NotImplementedError(
        "lab 02-04, task 2: implement reshape_and_cache (hint: python -m course hint 02-04 2)"
    )


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``reshape_and_cache`` for the flash layout ``[num_blocks, block_size, num_kv_heads,
    head_size]``: afterwards ``key_cache[s // block_size, s % block_size] == key[i]`` (and the
    same for values) for every ``i < len(slot_mapping)`` with ``s = slot_mapping[i] >= 0``;
    nothing else changes. Errors as ``reshape_and_cache`` (``check_flash_caches`` and
    ``check_slots``), before anything is written.
    """
    raise NotImplementedError(
        "lab 02-04, task 2: implement reshape_and_cache_flash "
        "(hint: python -m course hint 02-04 2)"
    )


# ------------------------------------------------------------------------------------------
# Task 3: paged_attention_v1
# ------------------------------------------------------------------------------------------


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
) -> None:
    """Decode attention over the paged cache, one query token per sequence, into ``out``.

    Inputs: ``query`` and ``out`` ``[num_seqs, num_heads, head_size]`` (one dtype); the x-split
    caches; ``block_tables`` int32 ``[num_seqs, >= ceil(seq_len / block_size)]``; ``seq_lens``
    int32 ``[num_seqs]``, each ``>= 1`` and ``<= max_seq_len`` (which may exceed them all);
    ``alibi_slopes`` float ``[num_heads]`` or ``None`` (the default: no bias).

    Output, for sequence ``s`` with ``L = seq_lens[s]`` and query head ``h``, written into
    ``out[s, h]`` in place (every entry; ``out`` keeps its identity and dtype)::

        logit[t] = scale * (query[s, h] . k_t) + alibi_slopes[h] * (t - (L - 1))   t = 0..L-1
        out[s, h] = sum_t softmax(logit)[t] * v_t

    where ``k_t``, ``v_t`` are token ``t``'s key and value for KV head
    ``h // (num_heads // num_kv_heads)`` (consecutive query heads share a KV head), read through
    ``block_tables[s]``. ``scale`` is used as given. Logits, softmax and the weighted sum are
    float32; only the result is rounded to ``out``'s dtype.

    Junk: positions ``>= L``, blocks no sequence owns and table entries past ``ceil(L /
    block_size)`` may hold anything, NaN included; ``out`` must not depend on them.

    Errors (``ValueError`` before ``out`` is written; ``check_decode_inputs`` and ``check_out``
    do it): mismatched shapes, dtypes or devices, a block id in use that is outside the cache,
    too few table columns, a ``seq_len < 1`` or ``> max_seq_len``. A batch of no sequences is
    valid and leaves nothing to do. Tensor ops only: the whole batch at once, no loop over
    sequences or tokens.

    Task 7 (FP8 cache): with ``kv_cache_dtype="fp8"`` the caches are float8_e4m3fn (``x = 16``)
    and every key element read stands for ``scaled_fp8_dequant(stored, k_scale, float32)``
    (values: ``v_scale``); the rest of the maths is unchanged. Pass ``kv_cache_dtype, k_scale,
    v_scale`` to ``check_decode_inputs`` (same refusals as ``reshape_and_cache``).
    """
    raise NotImplementedError(
        "lab 02-04, task 3: implement paged_attention_v1 (hint: python -m course hint 02-04 3)"
    )


# ------------------------------------------------------------------------------------------
# Task 4: paged_attention_v2 and its reduce
# ------------------------------------------------------------------------------------------


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
) -> None:
    """v1's result (same inputs, same ``out``), computed partition by partition.

    Partition ``p`` is the positions ``[p * PARTITION_SIZE, (p + 1) * PARTITION_SIZE)``;
    sequence ``s`` has ``n_s = ceil(seq_lens[s] / PARTITION_SIZE)`` of them. The buffers are
    ``exp_sums``, ``max_logits`` float32 ``[num_seqs, num_heads, P]`` and ``tmp_out``
    ``[num_seqs, num_heads, P, head_size]`` in ``out``'s dtype, with ``P >=
    _num_partitions(max_seq_len)``; they come in holding anything.

    Afterwards, with v1's logits and values of sequence ``s``, query head ``h``:

    * for ``p < n_s``: ``max_logits[s, h, p] = m_p``, the largest logit of partition ``p``
      (ALiBi included); ``exp_sums[s, h, p] = sum exp(logit - m_p)`` over its positions below
      ``seq_len``; ``tmp_out[s, h, p] = sum exp(logit - m_p) * v / exp_sums[s, h, p]``;
    * for every other ``p < P`` (past the sequence's end, and every column past
      ``_num_partitions(max_seq_len)`` of a wider buffer): ``-inf``, ``0`` and zeros, so that
      the buffers are fully defined;
    * ``out`` holds the merge of the ``n_s`` partitions (``paged_attention_v2_reduce``).

    Junk as in v1: nothing may depend on it. Errors (``ValueError`` before anything is
    written): v1's, a ``block_size`` that does not divide ``PARTITION_SIZE``, and buffers of the
    wrong dtype, device or shape or too few partitions (``check_v2_buffers``). A Python loop
    over partitions is fine; none over tokens. ``kv_cache_dtype``, ``k_scale``, ``v_scale``
    (task 7): as in v1.
    """
    raise NotImplementedError(
        "lab 02-04, task 4: implement paged_attention_v2 (hint: python -m course hint 02-04 4)"
    )


def paged_attention_v2_reduce(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Merge each sequence's partitions into ``out`` (in place, every entry).

    Input: the buffers of ``paged_attention_v2`` for the first ``n_s = ceil(seq_lens[s] /
    PARTITION_SIZE)`` partitions of sequence ``s``; its other partitions may hold anything
    (NaN, inf, stale numbers) and must not affect ``out``.

    Output: ``out[s, h]`` is what softmax over all of the sequence's logits times its values
    would give, i.e. the mean of ``tmp_out[s, h, p]`` over ``p < n_s`` weighted by each
    partition's share of the total exp sum. The ``exp_sums`` are relative to each partition's
    own max ``max_logits[s, h, p]``, which can be large (logits near 100 are normal with ALiBi
    or big scales) and differ a lot from one sequence to the next: the merge must not overflow
    or underflow float32. One partition gives its ``tmp_out``.
    """
    raise NotImplementedError(
        "lab 02-04, task 4: implement paged_attention_v2_reduce "
        "(hint: python -m course hint 02-04 4)"
    )


# ------------------------------------------------------------------------------------------
# Task 5: choosing v1 or v2
# ------------------------------------------------------------------------------------------


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """True (a bool) when v0.11.0 runs v1 for this batch, False for v2.

    The rule: v1 exactly when ``max_seq_len <= 8192`` and either the longest context fits one
    partition (``_num_partitions(max_seq_len) == 1``) or the batch has more than 512
    (sequence, head) pairs (``num_seqs * num_heads > 512``). The README says why each part.
    """
    raise NotImplementedError(
        "lab 02-04, task 5: implement use_v1 (hint: python -m course hint 02-04 5)"
    )


def forward_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_kv_heads: int,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Allocate the output (and v2's buffers), pick v1 or v2 with ``use_v1`` and run it.

    Complete: it works once tasks 3 to 5 do.
    """
    if query.dim() != 3 or value_cache.dim() != 4:
        raise ValueError(
            "query must be [num_seqs, num_heads, head_size] and value_cache "
            "[num_blocks, num_kv_heads, head_size, block_size]"
        )
    out = torch.empty_like(query)
    num_seqs, num_heads, head_size = query.shape
    block_size = value_cache.shape[-1]
    if use_v1(max_seq_len, num_seqs, num_heads):
        paged_attention_v1(
            out,
            query,
            key_cache,
            value_cache,
            num_kv_heads,
            scale,
            block_tables,
            seq_lens,
            block_size,
            max_seq_len,
            alibi_slopes,
            kv_cache_dtype,
            k_scale,
            v_scale,
        )
        return out
    parts = _num_partitions(max_seq_len)
    exp_sums = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(
        num_seqs, num_heads, parts, head_size, dtype=query.dtype, device=query.device
    )
    paged_attention_v2(
        out,
        exp_sums,
        max_logits,
        tmp_out,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )
    return out


# ------------------------------------------------------------------------------------------
# Task 6: moving blocks
# ------------------------------------------------------------------------------------------


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every ``(src, dst)`` row of ``block_mapping`` (int64 ``[n, 2]``), make block ``dst``
    of every layer's key cache and value cache a copy of block ``src`` of the same cache.
    Nothing else changes; ``n == 0`` changes nothing. Errors (``ValueError``, nothing copied;
    ``check_copy``): one key cache per value cache, ids inside every cache, each ``dst`` once,
    no block both a source and a destination.
    """
    raise NotImplementedError(
        "lab 02-04, task 6: implement copy_blocks (hint: python -m course hint 02-04 6)"
    )


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """For every row ``(a, b)`` of ``block_mapping`` (int64 ``[n, 2]``), make block ``b`` of
    ``dst`` a copy of block ``a`` of ``src``. The two pools may differ in size and live on
    different devices (a GPU cache and a CPU pool); ``src`` and every other block of ``dst``
    stay as they were; ``n == 0`` changes nothing. Errors (``ValueError``, nothing copied;
    ``check_swap``): blocks of another shape or dtype, ids outside either pool, a ``dst`` twice.
    """
    raise NotImplementedError(
        "lab 02-04, task 6: implement swap_blocks (hint: python -m course hint 02-04 6)"
    )


# ------------------------------------------------------------------------------------------
# Task 7 (extension): the FP8 KV cache
# ------------------------------------------------------------------------------------------


def scaled_fp8_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache stores for ``x``: ``float8_e4m3fn(clamp(x / scale, -448, 448))``.

    Inputs: ``x`` of any shape in float32, float16 or bfloat16; ``scale`` a float > 0 (the
    callers have checked it). Output: a new tensor of ``x``'s shape in ``torch.float8_e4m3fn``
    (``FP8_DTYPE``); ``x`` is not changed.

    Divide in float32, then clamp to ``+-FP8_E4M3_MAX`` (448, e4m3's largest finite value),
    then cast (which rounds to the nearest e4m3 value). So a value within ``448 * scale`` reads
    back within 2**-4 of itself (relative; ``2**-10 * scale`` absolute below
    ``2**-6 * scale``), and anything beyond, inf included, reads back as ``+-448 * scale``. NaN
    stays NaN. The clamp must apply to ``x / scale``, not to ``x``.

    Then give ``reshape_and_cache`` (task 2) its fp8 branch: see its docstring.
    """
    raise NotImplementedError(
        "lab 02-04, task 7: implement scaled_fp8_quant (hint: python -m course hint 02-04 7)"
    )


def scaled_fp8_dequant(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The value an FP8 cache entry stands for: ``q * scale``, in ``dtype``.

    Inputs: ``q`` float8_e4m3fn of any shape; ``scale`` the float it was quantized with;
    ``dtype`` float32, float16 or bfloat16. Output: a new tensor of ``q``'s shape in
    ``dtype``, the product taken in float32 and then cast to ``dtype``.

    Then give ``paged_attention_v1`` and ``v2`` (tasks 3 and 4) their fp8 branch: dequantize
    the key and value blocks you gather (only those), before any arithmetic.
    """
    raise NotImplementedError(
        "lab 02-04, task 7: implement scaled_fp8_dequant (hint: python -m course hint 02-04 7)"
    )
