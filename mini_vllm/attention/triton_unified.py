"""Unified paged attention in Triton: prefill chunks and decodes of one batch in one kernel.

Today's vLLM attends with one Triton kernel on every vendor's GPU where FlashAttention is not
used. This is the course's version of it (lab 02-07), over the course's paged cache (lab 02-04's
layout: ``key_cache [blocks, kv_heads, head // x, block_size, x]``,
``value_cache [blocks, kv_heads, head, block_size]``).

The batch is the model runner's flat one: ``query [num_tokens, num_heads, head]``, sequence
``s`` owning rows ``query_start_loc[s]:query_start_loc[s + 1]``, which are the *last* tokens of
its ``seq_lens[s]`` (a decode has one row, a prefill chunk several). One program handles one
**Q block** (``BLOCK_Q`` consecutive query tokens of one sequence) for one **KV head**, and
packs the ``G = num_heads // num_kv_heads`` query heads that share the KV head into its rows:
row ``m`` is token ``m // G``, head ``m % G`` of the group (``BLOCK_M = BLOCK_Q * G`` rows, padded
to a power of two). So each K/V tile is read once for the whole group. The program walks the
sequence's KV in tiles of ``TILE`` positions through the block table, and keeps an online
softmax (running max ``m``, running sum ``l``, unnormalised ``acc``) per row; a key is visible to
a row when it is at or before the row's query (causal inside the chunk) and, with a sliding
window of ``W``, less than ``W`` positions behind it.

**Split KV (upstream's "3D" mode).** A decode batch of a few sequences launches few programs,
too few to fill a GPU. With ``num_segments > 1`` a third grid axis splits each sequence's tiles
into that many segments; each program writes its unnormalised partial and its ``(m, l)``, and
:func:`reduce_segments` combines them, rescaling each by ``exp(m_s - max_s m_s)``.

Triton compiles for GPUs only; without CUDA, importing this module sets ``TRITON_INTERPRET=1``
(unless set), and the kernels run in Triton's interpreter on CPU tensors: slow, but exactly the
program a GPU would run, for correctness.

The kernel is given; the pieces it calls are the lab's tasks. :func:`unified_attention` takes
them as ``pieces`` (name -> ``@triton.jit`` function), and builds the kernel with those in its
globals (once per set of pieces), so a student's pieces run in the reference's skeleton.

upstream: vllm/v1/attention/ops/triton_unified_attention.py @ v0.33.0 (not in v0.11.0's
structure: the lab's map is in its README)
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Mapping

import torch

_TRITON_WAS_IMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Decided once: kernels made later (the kernel below, per set of pieces) are made the same way
# as the pieces decorated at import, whatever the environment says by then.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def _interpret_triton_library() -> None:
    """Make Triton's own ``@jit`` library functions (``tl.zeros``, ``tl.cdiv``, ...) callable
    from interpreted kernels. Triton decides at its import whether they are made for the
    interpreter; torch imports Triton early (its first operation on the meta device does), so
    on a CPU it may have made them for compiling, which a CPU cannot do anyway."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.JITFunction):
                setattr(module, attr, InterpretedFunction(obj.fn))


if INTERPRET and _TRITON_WAS_IMPORTED and not isinstance(tl.zeros, InterpretedFunction):
    _interpret_triton_library()

__all__ = [
    "PIECE_NAMES",
    "block_shape",
    "choose_num_segments",
    "first_tile",
    "in_window",
    "lab_entry_point",
    "load_kv_tile",
    "load_q_tile",
    "reduce_segments",
    "softmax_step",
    "unified_attention",
    "visible",
]


# --------------------------------------------------------------------------------------------
# The pieces (the lab's tasks)
# --------------------------------------------------------------------------------------------


@triton.jit
def load_q_tile(query_ptr, q_start, q_len, q_block, kv_head, stride_tok, stride_head,
                BLOCK_Q: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The Q tile of one Q block and KV head: ``[BLOCK_M, HEAD_PAD]`` (0 where masked), each
    row's token index in the sequence's queries, its query head, and whether the row is real
    (a padding row past ``BLOCK_Q * G``, or past the last query, is not).

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:340 @ v0.33.0
    """
    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (token < q_len)
    dims = tl.arange(0, HEAD_PAD)
    offsets = (q_start + token)[:, None] * stride_tok + head[:, None] * stride_head + dims[None, :]
    q = tl.load(query_ptr + offsets, mask=row_ok[:, None] & (dims < HEAD)[None, :], other=0.0)
    return q, token, head, row_ok


@triton.jit
def load_kv_tile(key_cache_ptr, value_cache_ptr, table_ptr, tile, seq_len, kv_head,
                 sk_block, sk_head, sk_chunk, sk_slot, sv_block, sv_head, sv_dim,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, X: tl.constexpr,
                 HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Tile ``tile`` of a sequence's KV for one KV head: ``K^T [HEAD_PAD, TILE]``,
    ``V [TILE, HEAD_PAD]`` and the tile's positions. Position ``p`` lives in physical block
    ``table[p // BLOCK_SIZE]`` at slot ``p % BLOCK_SIZE``; positions at or past ``seq_len`` are
    not read (0), so nothing in an unused slot or block reaches the result.

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:431 @ v0.33.0
    """
    pos = tile * TILE + tl.arange(0, TILE)
    in_seq = pos < seq_len
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD
    # The key cache splits a head into chunks of X contiguous elements (lab 02-04).
    k_offsets = (block[None, :] * sk_block + kv_head * sk_head + (dims // X)[:, None] * sk_chunk
                 + slot[None, :] * sk_slot + (dims % X)[:, None])
    k_t = tl.load(key_cache_ptr + k_offsets, mask=dim_ok[:, None] & in_seq[None, :], other=0.0)
    v_offsets = (block[:, None] * sv_block + kv_head * sv_head + dims[None, :] * sv_dim
                 + slot[:, None])
    v = tl.load(value_cache_ptr + v_offsets, mask=in_seq[:, None] & dim_ok[None, :], other=0.0)
    return k_t, v, pos


@triton.jit
def visible(q_pos, k_pos, seq_len):
    """``[BLOCK_M, TILE]``: key position ``k_pos[j]`` is visible to the row whose query sits at
    absolute position ``q_pos[i]`` (causal: at or before it; and inside the sequence).

    upstream: vllm/v1/attention/ops/triton_attention_helpers.py:359 @ v0.33.0
    """
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seq_len)[None, :]


@triton.jit
def softmax_step(s, m, l, acc, v):  # noqa: E741 (l: the running sum, as in the papers)
    """One tile of the online softmax. ``s [BLOCK_M, TILE]`` are the tile's scores (``-inf``
    where not visible), ``v [TILE, HEAD_PAD]`` its values; ``(m, l, acc)`` the running max, sum
    of ``exp(score - m)`` and unnormalised output. Returns them updated: the old sum and output
    are rescaled by ``exp(m_old - m_new)``. A row that has seen no visible key keeps
    ``m = -inf``, ``l = 0``, ``acc = 0`` (no NaN from ``-inf - -inf``).

    upstream: vllm/v1/attention/ops/triton_attention_helpers.py:462 @ v0.33.0
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m - shift)
    l_new = l * alpha + tl.sum(p, axis=1)
    acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
    return m_new, l_new, acc_new


@triton.jit
def in_window(q_pos, k_pos, WINDOW: tl.constexpr):
    """``[BLOCK_M, TILE]``: key ``k_pos[j]`` is inside the sliding window of the query at
    ``q_pos[i]``: fewer than ``WINDOW`` positions behind it (the query itself included, so a
    window of ``W`` keeps ``W`` keys).

    upstream: vllm/v1/attention/ops/triton_attention_helpers.py:373 @ v0.33.0
    """
    return q_pos[:, None] - k_pos[None, :] < WINDOW


@triton.jit
def first_tile(first_q_pos, WINDOW: tl.constexpr, TILE: tl.constexpr):
    """The first tile a Q block whose earliest query sits at ``first_q_pos`` needs under a
    sliding window of ``WINDOW`` keys: the tile of the oldest key that query still sees (tiles
    before it hold no key any row of the block sees).

    upstream: vllm/v1/attention/ops/triton_attention_helpers.py:146 @ v0.33.0
    """
    return tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE


@triton.jit
def reduce_segments(out_ptr, segm_acc_ptr, segm_max_ptr, segm_sum_ptr, num_tokens,
                    stride_tok, stride_head, NUM_HEADS: tl.constexpr,
                    NUM_SEGMENTS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Combine one (token, head)'s segment partials into its output (grid:
    ``(num_tokens, num_heads)``). Segment ``s`` left ``acc_s`` (unnormalised), its max ``m_s``
    and sum ``l_s``; a segment that saw no visible key has ``l_s = 0`` and counts for nothing.
    The output is ``sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s`` with ``M`` the largest
    ``m_s`` of the segments that count (0 if none does).

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:700 @ v0.33.0
    """
    token = tl.program_id(0)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    first = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS
    seg_max = tl.load(segm_max_ptr + first + segs)
    seg_sum = tl.load(segm_sum_ptr + first + segs)
    # A segment that saw nothing left max -inf: it never sets the overall max, and its weight
    # is 0 (the where also keeps a query no segment saw anything of at 0, not NaN).
    overall = tl.max(seg_max, axis=0)
    weight = tl.where(seg_sum > 0, tl.exp(seg_max - overall), 0.0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(segm_acc_ptr + (first + segs)[:, None] * HEAD_PAD + dims[None, :])
    total = tl.sum(seg_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_tok + head * stride_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD)


# The names the kernel calls. The reference's pieces are this module's functions of those names,
# looked up when a kernel is launched: ``python -m course engine`` rebinds them to a student's.
PIECE_NAMES = ("load_q_tile", "load_kv_tile", "visible", "softmax_step", "reduce_segments",
               "in_window", "first_tile")


# --------------------------------------------------------------------------------------------
# The kernel (given)
# --------------------------------------------------------------------------------------------


@triton.jit
def find_q_block(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Which sequence a program's global Q block belongs to, and its index there. Sequence
    ``s``'s blocks are numbered from ``query_start_loc[s] // BLOCK_Q + s`` (a bound that never
    lets two sequences share a number), so the grid needs ``num_tokens // BLOCK_Q + num_seqs``
    programs, some of which find no work. A binary search over the sequences.

    upstream: vllm/v1/attention/ops/triton_attention_helpers.py:83 @ v0.33.0
    """
    lo = 0
    hi = num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid
        else:
            hi = mid
    return lo, q_block_global - (tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo)


def unified_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, segm_acc_ptr, segm_max_ptr, segm_sum_ptr, scale, num_seqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_table,
    sk_block, sk_head, sk_chunk, sk_slot, sv_block, sv_head, sv_dim,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, X: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, WINDOW: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: Q block ``program_id(0)`` (numbered over the batch, see
    :func:`find_q_block`), KV head ``program_id(1)``, segment ``program_id(2)``. Undecorated:
    :func:`_kernel` makes it a Triton kernel with a set of pieces in its globals.

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:181 @ v0.33.0
    """
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq, q_block = find_q_block(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        q, token, head, row_ok = load_q_tile(query_ptr, q_start, q_len, q_block, kv_head,
                                             stride_q_tok, stride_q_head, BLOCK_Q, G, BLOCK_M,
                                             HEAD, HEAD_PAD)
        q = q.to(DOT_DTYPE)
        q_pos = seq_len - q_len + token  # each row's absolute position in its sequence

        # The tiles this program walks: from the window's start (or 0) to the Q block's last
        # query (nothing after it is visible), cut to this program's segment.
        last_q_pos = tl.minimum(seq_len - q_len + (q_block + 1) * BLOCK_Q, seq_len) - 1
        lo = 0
        if WINDOW > 0:
            lo = first_tile(seq_len - q_len + q_block * BLOCK_Q, WINDOW, TILE)
        hi = last_q_pos // TILE + 1
        if NUM_SEGMENTS > 1:
            per_segment = tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SEGMENTS)
            lo = tl.maximum(lo, segment * per_segment)
            hi = tl.minimum(hi, (segment + 1) * per_segment)

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        table = block_table_ptr + seq.to(tl.int64) * stride_table
        for tile in range(lo, hi):
            k_t, v, k_pos = load_kv_tile(key_cache_ptr, value_cache_ptr, table, tile, seq_len,
                                         kv_head, sk_block, sk_head, sk_chunk, sk_slot,
                                         sv_block, sv_head, sv_dim, BLOCK_SIZE, TILE, X, HEAD,
                                         HEAD_PAD)
            k_t = k_t.to(DOT_DTYPE)
            v = v.to(DOT_DTYPE)
            s = scale * tl.dot(q, k_t, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            ok = visible(q_pos, k_pos, seq_len) & row_ok[:, None]
            if WINDOW > 0:
                ok = ok & in_window(q_pos, k_pos, WINDOW)
            m, l, acc = softmax_step(tl.where(ok, s, float("-inf")), m, l, acc, v)

        dims = tl.arange(0, HEAD_PAD)
        rows = q_start + token
        store_ok = row_ok[:, None] & (dims < HEAD)[None, :]
        if NUM_SEGMENTS == 1:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_o_tok + head[:, None] * stride_o_head
                     + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=store_ok)
        else:
            first = (rows.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + segment
            tl.store(segm_acc_ptr + first[:, None] * HEAD_PAD + dims[None, :], acc,
                     mask=row_ok[:, None])
            tl.store(segm_max_ptr + first, m, mask=row_ok)
            tl.store(segm_sum_ptr + first, l, mask=row_ok)


_KERNELS: dict[tuple[int, ...], object] = {}
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _kernel(pieces: Mapping[str, object]):
    """The kernel with ``pieces`` in its globals (built once per set of pieces)."""
    key = tuple(id(pieces[name]) for name in PIECE_NAMES)
    if key not in _KERNELS:
        namespace = {**globals(), **{name: pieces[name] for name in PIECE_NAMES}}
        # A copy of the (undecorated) kernel function whose globals hold these pieces.
        source = types.FunctionType(unified_attention_kernel.__code__, namespace,
                                    unified_attention_kernel.__name__)
        _KERNELS[key] = InterpretedFunction(source) if INTERPRET else triton.jit(source)
    return _KERNELS[key]


# --------------------------------------------------------------------------------------------
# The launcher (given)
# --------------------------------------------------------------------------------------------


def block_shape(num_queries_per_kv: int) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)`` for a GQA group of ``num_queries_per_kv`` query heads: at least
    16 rows (a GPU's ``tl.dot`` needs 16), as many whole groups as fit.

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:961 @ v0.33.0
    """
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    return block_m // num_queries_per_kv, block_m


def choose_num_segments(num_seqs: int, max_query_len: int, num_kv_heads: int,
                        max_seq_len: int, tile: int = 16) -> int:
    """Split KV only where it pays: short queries (decodes), few programs for a GPU
    (fewer than 128), and sequences of several tiles; then 4 segments, else 1.

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:1070 @ v0.33.0 (today's rule
    compares the batch's Q blocks with a threshold the backend sizes per GPU)
    """
    if (not torch.cuda.is_available() or max_query_len > 1
            or num_seqs * num_kv_heads >= 128 or max_seq_len < 4 * tile):
        return 1
    return 4


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = 0,
    num_segments: int = 1,
    tile: int = 16,
    out: torch.Tensor | None = None,
    pieces: Mapping[str, object] | None = None,
) -> torch.Tensor:
    """Attention of every query row of a flat batch over its sequence's paged KV; returns
    ``[num_tokens, num_heads, head]`` in the query's dtype (into ``out`` if given).

    ``sliding_window``: 0 for none, else the number of keys a query sees (itself included).
    ``num_segments``: 1 for one pass per Q block ("2D"), a power of two for split KV ("3D").
    ``pieces``: the functions the kernel calls, by name (:data:`PIECE_NAMES`); the others are
    this module's.
    Raises ``ValueError`` on shapes that do not agree.

    upstream: vllm/v1/attention/ops/triton_unified_attention.py:828 @ v0.33.0
    """
    pieces = {**{name: globals()[name] for name in PIECE_NAMES}, **(pieces or {})}
    num_tokens, num_heads, head = query.shape
    if key_cache.dim() != 5 or value_cache.dim() != 4 or value_cache.shape[2] != head:
        raise ValueError("unified_attention: key_cache must be [blocks, KVH, D // x, bs, x] and "
                         f"value_cache [blocks, KVH, D, bs] with D={head}; got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_blocks, num_kv_heads, _, block_size, x = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"unified_attention: {num_heads} query heads is not a multiple of "
                         f"{num_kv_heads} KV heads")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"unified_attention: {num_seqs} sequences need query_start_loc of "
                         f"{num_seqs + 1} and a block table of {num_seqs} rows; got "
                         f"{query_start_loc.shape[0]} and {block_tables.shape[0]}")
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"unified_attention: num_segments must be a power of two, got "
                         f"{num_segments}")
    if sliding_window < 0:
        raise ValueError(f"unified_attention: sliding_window must be >= 0, got {sliding_window}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"unified_attention: tile must be a power of two >= 16, got {tile}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    block_q, block_m = block_shape(group)
    # The tiles' dtype in the dot products: the cache's, except bfloat16 in the interpreter,
    # whose dot product misreads bfloat16 (numpy has no such type): float32 there.
    dot_dtype = key_cache.dtype
    if dot_dtype == torch.bfloat16 and INTERPRET:
        dot_dtype = torch.float32
    head_pad = max(16, triton.next_power_of_2(head))
    scratch = [None, None, None]
    if num_segments > 1:
        shape = (num_tokens, num_heads, num_segments)
        scratch = [torch.empty(*shape, head_pad, dtype=torch.float32, device=query.device),
                   torch.empty(shape, dtype=torch.float32, device=query.device),
                   torch.zeros(shape, dtype=torch.float32, device=query.device)]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    launch(_kernel(pieces), grid,
           out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
           *scratch, float(scale), num_seqs,
           query.stride(0), query.stride(1), out.stride(0), out.stride(1),
           block_tables.stride(0),
           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
           NUM_HEADS=num_heads, G=group, BLOCK_Q=block_q, BLOCK_M=block_m,
           BLOCK_SIZE=block_size, TILE=tile, X=x, HEAD=head, HEAD_PAD=head_pad,
           WINDOW=sliding_window, NUM_SEGMENTS=num_segments,
           DOT_DTYPE=_DOT_DTYPES[dot_dtype],
           DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32")
    if num_segments > 1:
        launch(pieces["reduce_segments"], (num_tokens, num_heads),
               out, *scratch, num_tokens, out.stride(0), out.stride(1),
               NUM_HEADS=num_heads, NUM_SEGMENTS=num_segments, HEAD=head, HEAD_PAD=head_pad)
    return out


def lab_entry_point(namespace: Mapping[str, object]):
    """Lab 02-07's ``unified_attention``: :func:`unified_attention` with the pieces of
    ``namespace`` (a lab file's globals, read at each call) named in its ``yours`` and this
    module's for the others, so that a task's tests take the student's pieces of that task
    only. ``yours`` naming anything but :data:`PIECE_NAMES` is a ``ValueError``.

    upstream: none (the lab's switch between a student's pieces and the reference's)
    """

    def unified_attention_of_lab(query, key_cache, value_cache, query_start_loc, seq_lens,
                                 block_tables, scale, *, sliding_window=0, num_segments=1,
                                 yours=PIECE_NAMES):
        unknown = sorted(set(yours) - set(PIECE_NAMES))
        if unknown:
            raise ValueError(f"unified_attention: {unknown} are not pieces of this lab; "
                             f"choose among {list(PIECE_NAMES)}")
        return unified_attention(
            query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
            sliding_window=sliding_window, num_segments=num_segments,
            pieces={name: namespace[name] for name in yours})

    unified_attention_of_lab.__doc__ = (
        "The unified kernel over a flat batch (see mini_vllm.attention.triton_unified."
        "unified_attention), with this file's pieces named in ``yours`` and the reference's for "
        "the others. Returns ``[num_tokens, num_heads, head]`` in the query's dtype.")
    return unified_attention_of_lab


def _guarded(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A copy of ``tensor`` in the middle of a buffer three times its size, the rest holding
    NaN (floats) or -1 (integers); returns the copy, the buffer and the copy's offset in it.
    The interpreter reads whatever address a kernel computes; a load a little outside a tensor
    then reads junk (and the result is wrong) instead of crashing the process, and a store
    there is seen afterwards (:func:`_stores_outside`)."""
    span = max(tensor.numel(), 4096)
    fill = float("nan") if tensor.is_floating_point() else -1
    buffer = torch.full((3 * span,), fill, dtype=tensor.dtype, device=tensor.device)
    middle = buffer.as_strided(tensor.shape, tensor.stride(), span)
    middle.copy_(tensor)
    return middle, buffer, span


def _stores_outside(tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> int:
    """How many elements of ``buffer`` around ``tensor`` (a view at ``offset``) a kernel
    changed."""
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n)
    around = torch.cat([buffer[:offset], buffer[offset + extent:]])
    untouched = around.isnan() if around.is_floating_point() else around == -1
    return int((~untouched).sum())


def launch(kernel, grid, *args, **constants) -> None:
    """``kernel[grid](*args, **constants)``. In the interpreter, every tensor goes in guarded
    (:func:`_guarded`; written ones are copied back), a store outside a tensor argument is a
    ``RuntimeError`` (on a GPU it would overwrite whatever lies there), and an error raised
    inside the kernel (a task's ``NotImplementedError``, an ``IndexError``) comes out as itself
    rather than wrapped in Triton's ``InterpreterError``.

    upstream: none (course-only: the interpreter is how a CPU runs the lab)
    """
    if not INTERPRET:
        _launch_unguarded(kernel, grid, *args, **constants)
        return
    guards = {i: _guarded(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    _launch_unguarded(kernel, grid, *[guards[i][0] if i in guards else a
                                      for i, a in enumerate(args)], **constants)
    for i, (copy, buffer, offset) in guards.items():  # every check before any copy back
        outside = _stores_outside(copy, buffer, offset)
        if outside:
            fn = getattr(kernel, "fn", kernel)
            params = list(inspect.signature(fn).parameters)
            raise RuntimeError(
                f"{fn.__name__} stored {outside} element(s) outside its argument "
                f"{params[i] if i < len(params) else i} (shape {tuple(copy.shape)}): a store's "
                "mask lets through rows or columns that are not the tensor's; check the masks "
                "of the tl.store calls and the row and column masks they are built from")
    for i, (copy, _, _) in guards.items():
        args[i].copy_(copy)


def _launch_unguarded(kernel, grid, *args, **constants) -> None:
    try:
        kernel[grid](*args, **constants)
    except triton.runtime.errors.InterpreterError as error:
        cause = error  # wrapped once per call level (the grid, then each jit function)
        while isinstance(cause, triton.runtime.errors.InterpreterError) and cause.__cause__:
            cause = cause.__cause__
        if cause is error:
            raise
        raise cause from None
