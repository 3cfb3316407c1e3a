"""The CUDA ops with the same signatures as mini_vllm.attention's PyTorch ops.

Each function checks its inputs (shapes, dtypes, layouts, devices: metadata only, no GPU sync)
and raises ``ValueError`` saying what to change before anything is built or written; then it
builds the extension if needed (``load_ops``) and calls the kernel. ``backend`` picks where the
kernels run (see ``mini_vllm.csrc.resolve_backend``): "cuda" takes CUDA tensors, the emulation
backends take CPU tensors and run the same kernel sources on the CPU. As upstream does, the
*values* of ``seq_lens``, ``block_tables`` and ``slot_mapping`` are trusted: checking them would
copy them to the CPU on every call. The kernels clamp lengths so that bad values cannot make
them touch memory outside the given tensors.
"""

from __future__ import annotations

import torch

# Through the package, not `from ... import load_ops`: a test (or a user) that replaces
# mini_vllm.csrc.load_ops is then obeyed here too.
import mini_vllm.csrc as _csrc
from mini_vllm.attention.fp8 import is_fp8
from mini_vllm.attention.paged_checks import check_cache_dtype

__all__ = [
    "PARTITION_SIZE",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "check_attention_inputs",
    "check_gqa_inputs",
    "check_naive_inputs",
    "check_partition_buffers",
    "choose_decode_kernel",
    "copy_blocks",
    "device_sm_count",
    "device_smem_optin",
    "gqa_num_partitions",
    "gqa_partition_size",
    "naive_max_seq_len",
    "paged_attention_gqa",
    "paged_attention_naive",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_decode",
    "reshape_and_cache",
    "v1_fits",
    "swap_blocks",
]

PARTITION_SIZE = 512  # tokens per v2 partition; kPartitionSize in kernel_params.h
MIN_PARTITION_SIZE = 64  # the GQA-aware kernel's smallest partition; kMinPartitionSize
# Thread blocks of the GQA-aware kernel that one SM holds at once (its __launch_bounds__ minimum
# for the common head sizes; scripts/gqa_sass_report.py computes the occupancy).
GQA_BLOCKS_PER_SM = 4
# SMs and opt-in shared memory per block of the GPUs the CPU emulation models
# (mini_vllm/csrc/emulation/runtime.cpp).
EMULATED_SM_COUNT = {"default": 1, "t4": 40, "a100": 108, "h100": 132}
EMULATED_SMEM_OPTIN = {"default": 48 * 1024, "t4": 64 * 1024, "a100": 163 * 1024,
                       "h100": 227 * 1024}
# Query heads per KV head from which decode takes the GQA-aware kernel: each K/V block is then
# read once instead of `group` times. (A design choice to be checked by the benchmark on a GPU.)
GQA_MIN_GROUP = 2
V1_THREADS = 128
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector: the innermost dimension of the key cache."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _require_device(tensors: dict[str, torch.Tensor], ref: str, backend: str | None) -> str:
    """Every tensor on the backend's device: one CUDA device for "cuda", the CPU for the
    emulation. Checked last, so that every other check also runs on a machine without a GPU.
    Returns the resolved backend."""
    backend = _csrc.resolve_backend(backend)
    device = tensors[ref].device
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(
            f"{ref} is on {device}; the CUDA ops need CUDA tensors (without a GPU, pass CPU "
            "tensors with backend='emulation', or use mini_vllm.attention's PyTorch ops)"
        )
    if backend != "cuda" and device.type != "cpu":
        raise ValueError(
            f"{ref} is on {device}; the {backend} backend runs the kernels on the CPU: pass CPU "
            "tensors (or backend='cuda')"
        )
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {ref} is on {device}; move it there")
    return backend


def _kv_args(kv_cache_dtype: str, k_scale, v_scale) -> dict:
    return {"kv_cache_dtype": kv_cache_dtype, "k_scale": k_scale, "v_scale": v_scale}


def _kv_call(kv_cache_dtype: str, k_scale, v_scale) -> tuple:
    """The cache-dtype arguments as the extension takes them (already checked): nothing for a
    cache in the model's dtype, so an extension built before the fp8 path still runs it;
    ("fp8", k_scale, v_scale) as floats for an fp8 cache."""
    if not is_fp8(kv_cache_dtype):
        return ()
    return ("fp8", float(k_scale), float(v_scale))


def check_attention_inputs(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    partition_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> str:
    """Raise ValueError unless the decode inputs fit the kernels; never writes anything.

    ``partition_buffers`` are v2's (exp_sums, max_logits, tmp_out). The caches hold the query's
    dtype (``kv_cache_dtype="auto"``) or float8_e4m3fn (``"fp8"``, x = 16), and the scales must
    be finite and > 0 either way, as the PyTorch ops check. Devices are checked last
    (against ``backend``'s device), so that every other check also runs on a machine without a
    GPU. Returns the resolved backend.

    upstream: none (upstream checks with TORCH_CHECK inside each C++ op)
    """
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_seqs, num_heads, head_size], got shape {tuple(query.shape)}"
        )
    num_seqs, num_heads, head_size = query.shape
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not supported; use float32, float16 or "
                         "bfloat16")
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_size {head_size} has no compiled kernel; supported: "
                         f"{SUPPORTED_HEAD_SIZES}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} has no compiled kernel; supported: "
                         f"{SUPPORTED_BLOCK_SIZES}")
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads} (each KV head serves a group of query heads)")
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if query.stride(2) != 1 or query.stride(1) != head_size or (
        query.stride(0) * query.element_size() % 16
    ):
        raise ValueError("query rows must be contiguous [num_heads, head_size] blocks starting "
                         "on 16-byte boundaries; pass query.contiguous()")
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {query.dtype} tensor of shape "
                         f"{tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}")
    check_cache_dtype(query.dtype, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    x = _x(key_cache.dtype)
    num_blocks = key_cache.shape[0] if key_cache.dim() == 5 else -1
    want_k = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    want_v = (num_blocks, num_kv_heads, head_size, block_size)
    for name, cache, want in (("key_cache", key_cache, want_k), ("value_cache", value_cache,
                                                                  want_v)):
        if tuple(cache.shape) != want:
            raise ValueError(f"{name} must have shape {want} for these inputs, got "
                             f"{tuple(cache.shape)}")
        if not cache.is_contiguous() or not _aligned(cache):
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    if not _aligned(query):
        raise ValueError("query must start on a 16-byte boundary; pass query.contiguous()")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or (
        block_tables.shape[0] != num_seqs
    ) or not block_tables.is_contiguous():
        raise ValueError(f"block_tables must be a contiguous int32 tensor [num_seqs={num_seqs}, "
                         f"max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,) or (
        not seq_lens.is_contiguous()
    ):
        raise ValueError(f"seq_lens must be a contiguous int32 tensor of shape ({num_seqs},), "
                         f"got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    tensors = {"query": query, "out": out, "key_cache": key_cache, "value_cache": value_cache,
               "block_tables": block_tables, "seq_lens": seq_lens}
    if partition_buffers is not None:
        check_partition_buffers(out, *partition_buffers, max_seq_len)
        tensors.update(zip(("exp_sums", "max_logits", "tmp_out"), partition_buffers))
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) != (num_heads,) or (
            not alibi_slopes.is_contiguous()
        ):
            raise ValueError(f"alibi_slopes must be a contiguous float32 tensor of shape "
                             f"({num_heads},), got {alibi_slopes.dtype} "
                             f"{tuple(alibi_slopes.shape)}")
        tensors["alibi_slopes"] = alibi_slopes
    return _require_device(tensors, "query", backend)


def gqa_num_partitions(max_seq_len: int, partition_size: int) -> int:
    """Partitions of ``partition_size`` tokens that a context of ``max_seq_len`` needs: the
    width dim 2 of the partition buffers must have.

    upstream: none (this course's kernel)
    """
    return -(-max_seq_len // partition_size)


def gqa_partition_size(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    blocks_per_sm: int = GQA_BLOCKS_PER_SM,
    max_num_partitions: int | None = None,
) -> int:
    """Tokens per partition for the GQA-aware kernel: the largest power of two from 512 down to
    64 whose grid still fills the GPU.

    The kernel's grid has one thread block per (KV head, chunk of up to 8 query heads, sequence,
    partition), so a small batch or a short context gives few blocks: at batch 1 and 8 KV heads,
    512-token partitions of a 4096-token context are 64 blocks for 132 SMs. Halving the partition
    doubles the blocks (and the partial results the merge reads, which stay small beside the
    K/V). "Fills" means at least 90% of one wave, ``num_sms * blocks_per_sm`` resident blocks:
    a grid of 0.97 waves runs as well as one of 1.94. When no size fills the GPU the smallest is
    taken. ``max_num_partitions`` (the width of given partition buffers) rules out sizes whose
    partitions would not fit in them; the 512-token size always fits buffers sized for v2.

    upstream: none (upstream's v2 always uses 512-token partitions, one block per query head)
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads or max_seq_len < 1 or num_sms < 1:
        raise ValueError(f"gqa_partition_size: bad shape (num_heads={num_heads}, num_kv_heads="
                         f"{num_kv_heads}, max_seq_len={max_seq_len}, num_sms={num_sms})")
    chunks = -(-(num_heads // num_kv_heads) // 8)  # query heads per block: at most 8
    slots = num_sms * blocks_per_sm
    size = PARTITION_SIZE
    while size > MIN_PARTITION_SIZE:
        blocks = num_kv_heads * chunks * num_seqs * gqa_num_partitions(max_seq_len, size)
        smaller = size // 2
        fits = max_num_partitions is None or (
            gqa_num_partitions(max_seq_len, smaller) <= max_num_partitions
        )
        if blocks >= 0.9 * slots or not fits:
            break
        size = smaller
    # The same number of partitions with larger ones is the same grid with less merging.
    while size < PARTITION_SIZE and (
        gqa_num_partitions(max_seq_len, 2 * size) == gqa_num_partitions(max_seq_len, size)
    ):
        size *= 2
    return size


def device_sm_count(device: torch.device, backend: str) -> int:
    """SMs of the GPU that runs the kernels: the real one for "cuda", the modelled one for the
    emulation ($MINI_VLLM_EMU_DEVICE).

    upstream: none (upstream's v2 launcher does not look at the SM count)
    """
    if backend == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    import os

    return EMULATED_SM_COUNT.get(os.environ.get("MINI_VLLM_EMU_DEVICE") or "default", 1)


def check_partition_buffers(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    max_seq_len: int,
    partition_size: int = PARTITION_SIZE,
) -> None:
    """Raise ValueError unless the v2 partition buffers fit ``out`` and ``max_seq_len``
    (partitions of ``partition_size`` tokens: 512 for v2, see ``gqa_partition_size``).

    upstream: none (upstream trusts its caller, vllm/attention/ops/paged_attn.py, to size them)
    """
    num_seqs, num_heads, head_size = out.shape
    parts = -(-max_seq_len // partition_size) if isinstance(max_seq_len, int) else 0
    width = exp_sums.shape[2] if exp_sums.dim() == 3 else -1
    for name, t, dtype, shape in (
        ("exp_sums", exp_sums, torch.float32, (num_seqs, num_heads, width)),
        ("max_logits", max_logits, torch.float32, (num_seqs, num_heads, width)),
        ("tmp_out", tmp_out, out.dtype, (num_seqs, num_heads, width, head_size)),
    ):
        if t.dtype != dtype or tuple(t.shape) != shape or width < parts or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape "
                f"{shape[:2] + ('P',) + shape[3:]} with the same P >= {parts} "
                f"(= ceil(max_seq_len / {partition_size})) as exp_sums; got {t.dtype} "
                f"{tuple(t.shape)}"
            )


def naive_max_seq_len(head_size: int) -> int:
    """The longest context the naive kernel takes: its fp32 logits, beside its query row, two
    4-float scratch arrays and 64 bytes for their alignment, must fit the 48 KB of shared memory
    a block gets without opting in (naive_max_seq_len in paged_attention_naive.cu).

    upstream: none (upstream has no naive kernel)
    """
    return (48 * 1024 - 4 * head_size - 2 * 4 * 4 - 64) // 4


def check_naive_inputs(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, backend=None) -> str:
    """``check_attention_inputs`` for the naive kernel (a cache in the model's dtype) plus its
    context limit; returns the backend. The reference and lab 02-06's starter both call it.

    upstream: none (upstream has no naive kernel)
    """
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, backend=backend)
    limit = naive_max_seq_len(query.shape[2])
    if max_seq_len > limit:
        raise ValueError(
            f"max_seq_len={max_seq_len} is too long for paged_attention_naive: its logits must "
            f"fit in 48 KB of shared memory, at most {limit} tokens with head size "
            f"{query.shape[2]}; use paged_attention_v1 or v2 for longer contexts")
    return backend


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
    """The naive decode kernel (lab 02-06's task 0): v1's contract for a cache in the model's
    dtype, with contexts up to ``naive_max_seq_len(head_size)`` tokens; writes ``out``.

    The baseline of the lab's timing table, not for serving: the engine never calls it.

    upstream: none (the loop of tests/kernels/attention/test_attention.py:65 @ v0.11.0 as a
    kernel)
    """
    backend = check_naive_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                 block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                                 backend=backend)
    _csrc.load_ops(backend=backend).paged_attention_naive(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
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
    """Decode attention over the paged cache, one thread block per (head, sequence).

    Same contract as ``mini_vllm.attention.paged_attn.paged_attention_v1``, the fp8 cache
    included (``kv_cache_dtype="fp8"``: float8_e4m3fn caches read as ``stored * k_scale`` and
    ``stored * v_scale``); writes ``out``.

    upstream: vllm/_custom_ops.py:39 @ v0.11.0
    """
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, backend=backend,
                                     **_kv_args(kv_cache_dtype, k_scale, v_scale))
    _csrc.load_ops(backend=backend).paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, *_kv_call(kv_cache_dtype, k_scale, v_scale))


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
    """Partitioned decode attention (512-token partitions, then a merge); writes ``out``.

    Same contract as ``mini_vllm.attention.paged_attn.paged_attention_v2`` (the fp8 cache
    included, as in ``paged_attention_v1``). Only the partitions that hold tokens are written in
    ``exp_sums``, ``max_logits`` and ``tmp_out``.

    upstream: vllm/_custom_ops.py:68 @ v0.11.0
    """
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, (exp_sums, max_logits, tmp_out), backend,
                                     **_kv_args(kv_cache_dtype, k_scale, v_scale))
    _csrc.load_ops(backend=backend).paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
        *_kv_call(kv_cache_dtype, k_scale, v_scale))


def check_gqa_inputs(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                     num_kv_heads, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                     kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, backend=None,
                     partition_size=None) -> tuple[str, int]:
    """``paged_attention_gqa``'s checks; returns (backend, partition size), the size chosen by
    ``gqa_partition_size`` when ``partition_size`` is None. Never writes anything. The reference
    and lab 02-06's stretch starter both call it.

    upstream: none (the GQA-aware kernel is this course's)
    """
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, (exp_sums, max_logits, tmp_out), backend,
                                     **_kv_args(kv_cache_dtype, k_scale, v_scale))
    if partition_size is None:
        partition_size = PARTITION_SIZE
        if query.dtype != torch.float32:  # fp32 runs v2, whose partitions are 512 tokens
            partition_size = gqa_partition_size(
                query.shape[0], query.shape[1], num_kv_heads, max_seq_len,
                device_sm_count(query.device, backend), max_num_partitions=exp_sums.shape[2])
    elif partition_size not in (64, 128, 256, 512) or (
        query.dtype == torch.float32 and partition_size != PARTITION_SIZE
    ):
        raise ValueError(f"partition_size must be 64, 128, 256 or 512 (512 for float32, which "
                         f"runs v2), got {partition_size!r}")
    check_partition_buffers(out, exp_sums, max_logits, tmp_out, max_seq_len, partition_size)
    return backend, partition_size


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
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    backend: str | None = None,
    partition_size: int | None = None,
) -> None:
    """Like ``paged_attention_v2`` (same arguments, same result), but one thread block serves
    all query heads of a KV head, so each K/V block is read once per KV head, not once per
    query head. fp32 inputs are handed to v2. See paged_attention_gqa.cu.

    ``partition_size`` (tokens per partition: 64, 128, 256 or 512) defaults to
    ``gqa_partition_size`` for this shape and GPU, within the width of the given buffers (buffers
    sized for v2 allow 512 only; size them with ``gqa_num_partitions`` to let it choose).

    An fp8 cache (``kv_cache_dtype="fp8"``) is read as in v1 and v2, by the kernel's scalar
    path (the tensor-core path reads model-dtype caches only).

    upstream: none (this course's kernel; upstream's grid re-reads K/V once per query head)
    """
    backend, partition_size = check_gqa_inputs(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
        v_scale, backend, partition_size)
    _csrc.load_ops(backend=backend).paged_attention_gqa(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, partition_size,
        *_kv_call(kv_cache_dtype, k_scale, v_scale))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    backend: str | None = None,
) -> None:
    """Write token ``i``'s key and value into cache slot ``slot_mapping[i]`` (negative: skip).

    As upstream (and the PyTorch op), the slot mapping's length is the number of real tokens:
    ``key`` and ``value`` may be longer (a padded batch), and their rows past it are ignored.
    ``kv_cache_dtype="fp8"``: the caches are float8_e4m3fn (x = 16) and store
    ``e4m3(clamp(key / k_scale, -448, 448))`` (values with ``v_scale``), byte for byte what
    ``mini_vllm.attention.cache_ops.reshape_and_cache`` stores.

    upstream: vllm/_custom_ops.py:1590 @ v0.11.0
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_size], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape
    if key.dtype not in SUPPORTED_DTYPES or value.dtype != key.dtype:
        raise ValueError(f"key and value must share a dtype among float32, float16, bfloat16; "
                         f"got {key.dtype} and {value.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_size:
            raise ValueError(f"{name}'s rows must be contiguous [num_kv_heads, head_size] blocks; "
                             f"pass {name}.contiguous()")
    check_cache_dtype(key.dtype, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    x = _x(key_cache.dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} must be a multiple of x={x} for "
                         f"{key_cache.dtype}")
    num_blocks = key_cache.shape[0] if key_cache.dim() == 5 else -1
    block_size = key_cache.shape[3] if key_cache.dim() == 5 else -1
    want_k = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    want_v = (num_blocks, num_kv_heads, head_size, block_size)
    for name, cache, want in (("key_cache", key_cache, want_k), ("value_cache", value_cache,
                                                                  want_v)):
        if tuple(cache.shape) != want or not cache.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {cache.dtype} tensor of shape {want}, "
                             f"got {cache.dtype} {tuple(cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > num_tokens or (
        slot_mapping.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"slot_mapping must be a 1-D int64 (or int32) tensor of at most "
                         f"{num_tokens} slots (one per real token; key may be padded), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    backend = _require_device({"key": key, "value": value, "key_cache": key_cache,
                               "value_cache": value_cache, "slot_mapping": slot_mapping}, "key",
                              backend)
    slots = slot_mapping.to(torch.int64).contiguous()  # a new tensor when it converts
    _csrc.load_ops(backend=backend).reshape_and_cache(
        key, value, key_cache, value_cache, slots, *_kv_call(kv_cache_dtype, k_scale, v_scale))


def _check_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> torch.Tensor:
    """The (src, dst) pairs as a CPU int64 tensor, after checking ids and unique destinations."""
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or (
        block_mapping.shape[1] != 2
    ):
        raise ValueError(f"block_mapping must be an int64 tensor [n, 2] of (src, dst) pairs, got "
                         f"{block_mapping.dtype} {tuple(block_mapping.shape)}")
    mapping = block_mapping.to("cpu").contiguous()
    src, dst = mapping[:, 0], mapping[:, 1]
    for name, ids, limit in (("source", src, num_src), ("destination", dst, num_dst)):
        bad = ids[(ids < 0) | (ids >= limit)]
        if bad.numel():
            raise ValueError(f"block_mapping names {name} block {int(bad[0])}, outside the "
                             f"cache's {limit} blocks")
    if dst.unique().numel() != dst.numel():
        raise ValueError("block_mapping writes a destination block twice; make each dst unique")
    return mapping


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """For every (src, dst) pair, copy block src onto block dst in every layer's caches.

    upstream: vllm/_custom_ops.py:1634 @ v0.11.0
    """
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{len(key_caches)} key caches but {len(value_caches)} value caches; "
                         "pass one of each per layer")
    if not key_caches:
        return
    first = key_caches[0]
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        for name, t in ((f"key_caches[{i}]", k), (f"value_caches[{i}]", v)):
            if t.dtype != first.dtype or t.shape[0] != first.shape[0] or (
                t.numel() != first.numel()
            ) or not t.is_contiguous() or not _aligned(t):
                raise ValueError(f"{name} must be a contiguous, 16-byte aligned {first.dtype} "
                                 f"cache with {first.shape[0]} blocks like key_caches[0]")
    mapping = _check_mapping(block_mapping, first.shape[0], first.shape[0])
    caches = {f"caches[{i}]": t for i, t in enumerate((*key_caches, *value_caches))}
    backend = _require_device(caches, "caches[0]", backend)
    if backend != "cuda":
        mapping = mapping.to(first.device)
    _csrc.load_ops(backend=backend).copy_blocks(key_caches, value_caches, mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                backend: str | None = None) -> None:
    """Copy block ``s`` of ``src`` to block ``d`` of ``dst`` for every (s, d) pair; one of the
    two caches may be on the CPU (pinned memory makes the copy asynchronous).

    upstream: vllm/_custom_ops.py:1645 @ v0.11.0
    """
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or src.dim() < 1:
        raise ValueError(f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} "
                         f"{tuple(dst.shape)} must have the same dtype and block shape")
    if not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError("src and dst must be contiguous")
    mapping = _check_mapping(block_mapping, src.shape[0], dst.shape[0])
    backend = _csrc.resolve_backend(backend)
    if backend == "cuda":
        if "cuda" not in (src.device.type, dst.device.type):
            raise ValueError("swap_blocks needs at least one CUDA cache (GPU <-> CPU or GPU <-> "
                             "GPU)")
        if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
            raise ValueError(f"src is on {src.device} and dst on {dst.device}; use one GPU")
    else:
        _require_device({"src": src, "dst": dst}, "src", backend)
    _csrc.load_ops(backend=backend).swap_blocks(src, dst, mapping)


# --------------------------------------------------------------------------------------------
# The engine's decode on a GPU: which kernel
# --------------------------------------------------------------------------------------------


def v1_fits(max_seq_len: int, head_size: int, block_size: int, smem_optin: int) -> bool:
    """Whether ``paged_attention_v1``'s shared memory fits a block on a GPU that lets a block opt
    in to ``smem_optin`` bytes (every GPU allows 48 KB): one fp32 logit per token slot of the
    longest sequence (or the warps' partial rows, if larger), plus the static query row and
    reduction scratch (``attention_smem_bytes`` + ``attention_static_smem_bytes`` in
    attention_core.cuh). Its launcher refuses past this ("use paged_attention_v2").

    upstream: none (upstream's v1 launcher sets the attribute and lets a launch fail)
    """
    slots = -(-max_seq_len // block_size) * block_size
    dynamic = 4 * max(slots, (V1_THREADS // 32) * head_size)
    static = 4 * head_size + 2 * 4 * (V1_THREADS // 32)
    return dynamic + static <= max(smem_optin, 48 * 1024)


def choose_decode_kernel(
    max_seq_len: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    smem_optin: int,
    gqa: bool = True,
) -> str:
    """"gqa", "v1" or "v2": the kernel the engine's decode runs on a GPU.

    The GQA-aware kernel when ``gqa`` is allowed, the model groups at least GQA_MIN_GROUP query
    heads per KV head and the dtype is fp16 or bf16 (it hands fp32 to v2 anyway): it reads each
    K/V block once per KV head instead of once per query head. Otherwise the PyTorch path's rule,
    ``mini_vllm.attention.paged_attn.use_v1`` (upstream's heuristic), picks v1 or v2; v1 also
    needs its logits to fit in the shared memory of one block (``v1_fits``).

    upstream: vllm/attention/ops/paged_attn.py:135 @ v0.11.0 (the v1/v2 rule; GQA is ours)
    """
    from mini_vllm.attention.paged_attn import use_v1

    group = num_heads // max(num_kv_heads, 1)
    if gqa and group >= GQA_MIN_GROUP and dtype in (torch.float16, torch.bfloat16):
        return "gqa"
    if use_v1(max_seq_len, num_seqs, num_heads) and v1_fits(max_seq_len, head_size, block_size,
                                                            smem_optin):
        return "v1"
    return "v2"


def device_smem_optin(device: torch.device, backend: str) -> int:
    """Shared memory a block may opt in to on the GPU that runs the kernels (modelled in the
    emulation).

    upstream: none (upstream's v1 launcher sets the attribute without checking it)
    """
    if backend == "cuda":
        return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)
    import os

    return EMULATED_SMEM_OPTIN.get(os.environ.get("MINI_VLLM_EMU_DEVICE") or "default", 48 * 1024)


def paged_decode(
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
) -> str:
    """Decode attention as the engine runs it on a GPU: v1, v2 or the GQA-aware kernel, chosen by
    ``choose_decode_kernel``; writes ``out`` (v1's contract) and returns the kernel's name.

    The kernels are looked up in this module at call time, so an engine composed with a student's
    lab 02-06 (``python -m course engine``) runs the student's v1 and v2; the GQA-aware kernel
    stands in for v2 only while v2 is the reference's. Should v1 refuse a context that its shared
    memory cannot hold, v2 does the step.

    upstream: vllm/attention/ops/paged_attn.py:96 @ v0.11.0 (forward_decode)
    """
    import sys

    me = sys.modules[__name__]
    backend = _csrc.resolve_backend(backend)
    num_seqs, num_heads, head_size = query.shape
    kernel = choose_decode_kernel(
        max_seq_len, num_seqs, num_heads, num_kv_heads, head_size, block_size, query.dtype,
        device_smem_optin(query.device, backend),
        gqa=me.paged_attention_v2 is _REFERENCE["paged_attention_v2"],
    )
    args = (query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            block_size, max_seq_len, alibi_slopes)
    # Passed only for an fp8 cache, so that a student's v1/v2 (lab 02-06) keep their own API.
    kv = _kv_args(kv_cache_dtype, k_scale, v_scale) if is_fp8(kv_cache_dtype) else {}
    if kernel == "v1":
        try:
            me.paged_attention_v1(out, *args, **kv, backend=backend)
            return kernel
        except ValueError as exc:
            if "use paged_attention_v2" not in str(exc):
                raise
            kernel = "v2"
    partition = PARTITION_SIZE
    if kernel == "gqa":
        partition = gqa_partition_size(num_seqs, num_heads, num_kv_heads, max_seq_len,
                                       device_sm_count(query.device, backend))
    parts = gqa_num_partitions(max_seq_len, partition)
    exp_sums = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(num_seqs, num_heads, parts, head_size, dtype=query.dtype,
                          device=query.device)
    if kernel == "gqa":
        me.paged_attention_gqa(out, exp_sums, max_logits, tmp_out, *args, **kv, backend=backend,
                               partition_size=partition)
    else:
        me.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *args, **kv, backend=backend)
    return kernel


# The reference kernels, kept where course.engine.compose's rebinding of module names does not reach
# (it replaces names, not the contents of a dict): paged_decode compares with them.
_REFERENCE = {"paged_attention_v2": paged_attention_v2}
