"""Input checks shared by the paged-attention ops and the lab 02-04 starter.

Every op in ``paged_attn`` and ``cache_ops`` runs these before it writes anything, which is how a
bad call raises ``ValueError`` and leaves caches and outputs untouched. They hold no attention
logic, so the lab's starter may import them.

upstream: none (upstream checks the same things with TORCH_CHECK inside each op in csrc/)
"""

from __future__ import annotations

import torch

from mini_vllm.attention.fp8 import FP8_DTYPE, check_kv_scale, is_fp8

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What a cache tensor may hold: the model dtypes, or e4m3 bytes with kv_cache_dtype="fp8".
KV_CACHE_TORCH_DTYPES = (*CACHE_DTYPES, FP8_DTYPE)

# The engine calls the ops once per layer with the same step tensors (block tables, sequence
# lengths, slot mapping). Their *value* checks cost tensor operations, so the last result is
# remembered, keyed by the tensors' identity and version counters (any in-place change bumps
# the version, so a modified tensor is checked again) and by every other argument it depends on.
_memo: dict[str, tuple[tuple, object]] = {}


def _same_inputs(kind: str, key: tuple) -> object | None:
    hit = _memo.get(kind)
    if hit is None or len(hit[0]) != len(key):
        return None
    for a, b in zip(hit[0], key):
        if a is b:
            continue
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return None
    return hit[1]


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t, t._version)


def vector_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one 16-byte vector (the ``x`` of the key cache layout)."""
    if dtype not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(
            f"unsupported KV cache dtype {dtype}; use one of float32, float16, bfloat16 "
            "(or float8_e4m3fn with kv_cache_dtype='fp8')"
        )
    return 16 // dtype.itemsize


def check_cache_dtype(
    model_dtype: torch.dtype,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
) -> tuple[bool, float, float]:
    """Check the caches' dtype against ``kv_cache_dtype``; return ``(fp8, k_scale, v_scale)``.

    ``"auto"``: both caches hold ``model_dtype`` (the query's, or the key's when writing).
    ``"fp8"``/``"fp8_e4m3"``: both hold ``float8_e4m3fn``. The scales must be finite and > 0
    whatever the cache dtype (they are ignored for ``"auto"``, as upstream ignores them).
    """
    fp8 = is_fp8(kv_cache_dtype)
    k, v = check_kv_scale("k_scale", k_scale), check_kv_scale("v_scale", v_scale)
    want = FP8_DTYPE if fp8 else model_dtype
    if key_cache.dtype != want or value_cache.dtype != want:
        if fp8:
            advice = f"allocate the caches in {FP8_DTYPE} for kv_cache_dtype={kv_cache_dtype!r}"
        elif FP8_DTYPE in (key_cache.dtype, value_cache.dtype):
            advice = "an fp8 cache needs kv_cache_dtype='fp8' with its k_scale and v_scale"
        else:
            advice = "the cache holds the model's dtype when kv_cache_dtype='auto'"
        raise ValueError(
            f"cache dtypes ({key_cache.dtype}, {value_cache.dtype}) must be {want} "
            f"(kv_cache_dtype={kv_cache_dtype!r}, model dtype {model_dtype}); {advice}"
        )
    return fp8, k, v


def check_decode_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> int:
    """Validate a decode batch; return the longest context actually present.

    Raises ``ValueError`` naming the offending argument. Never writes. The cache's ``x`` is
    its own dtype's (16 for fp8), not the query's.
    """
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_seqs, num_heads, head_size], got shape {tuple(query.shape)}"
        )
    num_seqs, num_heads, head_size = query.shape
    if query.dtype not in CACHE_DTYPES:
        raise ValueError(f"query dtype {query.dtype} unsupported; use float32, float16, bfloat16")
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads} "
            "(each KV head serves num_heads // num_kv_heads query heads)"
        )
    check_cache_dtype(query.dtype, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    x = vector_elems(key_cache.dtype)
    if head_size % x != 0:
        raise ValueError(
            f"head_size {head_size} must be a multiple of x={x} for {key_cache.dtype}"
        )
    num_blocks = key_cache.shape[0] if key_cache.dim() > 0 else 0
    want_k = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    want_v = (num_blocks, num_kv_heads, head_size, block_size)
    if tuple(key_cache.shape) != want_k:
        raise ValueError(
            f"key_cache must be [num_blocks, num_kv_heads, head_size // x, block_size, x] = "
            f"{want_k}, got {tuple(key_cache.shape)}"
        )
    if tuple(value_cache.shape) != want_v:
        raise ValueError(
            f"value_cache must be [num_blocks, num_kv_heads, head_size, block_size] = {want_v}, "
            f"got {tuple(value_cache.shape)}"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be a 2-D int32 tensor [num_seqs, max_blocks_per_seq], got "
            f"{block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"seq_lens must be an int32 tensor of shape ({num_seqs},), got {seq_lens.dtype} "
            f"of shape {tuple(seq_lens.shape)}"
        )
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    for name, t in (
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
        raise ValueError(
            f"alibi_slopes must have shape ({num_heads},) (one slope per query head), got "
            f"{tuple(alibi_slopes.shape)}"
        )
    if num_seqs == 0:
        return 0
    key = (*_tensor_key(block_tables), *_tensor_key(seq_lens), num_blocks, block_size,
           max_seq_len)
    known = _same_inputs("decode", key)
    if known is not None:
        return known  # type: ignore[return-value]
    lens = seq_lens.to("cpu", torch.int64)
    if int(lens.min()) < 1:
        raise ValueError(f"every seq_len must be >= 1 (decode attends to itself), got {lens}")
    longest = int(lens.max())
    if longest > max_seq_len:
        raise ValueError(f"seq_lens contains {longest} > max_seq_len={max_seq_len}")
    blocks_needed = -(-lens // block_size)
    if int(blocks_needed.max()) > block_tables.shape[1]:
        raise ValueError(
            f"a sequence of {longest} tokens needs {int(blocks_needed.max())} blocks but "
            f"block_tables has only {block_tables.shape[1]} columns"
        )
    # Only entries that hold context must be valid block ids; the rest is padding.
    cols = torch.arange(block_tables.shape[1])
    used = cols[None, :] < blocks_needed[:, None]
    ids = block_tables.to("cpu", torch.int64)[used]
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.numel():
        raise ValueError(
            f"block_tables refers to block {int(bad[0])} outside the cache's {num_blocks} blocks "
            f"(only the first ceil(seq_len / block_size) entries of a row must be valid)"
        )
    _memo["decode"] = (key, longest)
    return longest


def check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), got "
            f"({tuple(out.shape)}, {out.dtype}, {out.device})"
        )


def check_v2_buffers(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    parts: int,
) -> None:
    num_seqs, num_heads, head_size = out.shape
    for name, t, dtype in (
        ("exp_sums", exp_sums, torch.float32),
        ("max_logits", max_logits, torch.float32),
        ("tmp_out", tmp_out, out.dtype),
    ):
        ok = (
            t.dtype == dtype
            and t.device == out.device
            and t.dim() == (4 if name == "tmp_out" else 3)
            and tuple(t.shape[:2]) == (num_seqs, num_heads)
            and t.shape[2] >= parts
            and (name != "tmp_out" or t.shape[3] == head_size)
        )
        if not ok:
            tail = ", head_size" if name == "tmp_out" else ""
            raise ValueError(
                f"{name} must be {dtype} [num_seqs, num_heads, max_num_partitions{tail}] with "
                f"max_num_partitions >= {parts} on {out.device}; got {t.dtype} of shape "
                f"{tuple(t.shape)} on {t.device}"
            )


def check_kv(key: torch.Tensor, value: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape or key.dtype != value.dtype:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_size] with one dtype, "
            f"got {tuple(key.shape)} {key.dtype} and {tuple(value.shape)} {value.dtype}"
        )


def check_slots(
    slot_mapping: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device
) -> torch.Tensor:
    """Validate ``slot_mapping`` and return it as int64 on ``device``.

    Slots are ``block * block_size + offset``; a negative slot marks a padding token.
    """
    slots, _ = check_slots_all_valid(slot_mapping, num_tokens, num_slots, device)
    return slots


def check_slots_all_valid(
    slot_mapping: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """:func:`check_slots`, plus whether every slot is real (no negative padding slot)."""
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be a 1-D int64 (or int32) tensor, got {slot_mapping.dtype} of "
            f"shape {tuple(slot_mapping.shape)}"
        )
    # As upstream: the slot mapping's length is the number of real tokens; key may be longer
    # (padded batches), never shorter.
    if slot_mapping.shape[0] > num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has only {num_tokens} tokens"
        )
    key = (*_tensor_key(slot_mapping), num_tokens, num_slots, device)
    known = _same_inputs("slots", key)
    if known is not None:
        return known  # type: ignore[return-value]
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    real = slots[slots >= 0]
    if real.numel():
        if int(real.max()) >= num_slots:
            raise ValueError(
                f"slot {int(real.max())} is beyond the cache, which has {num_slots} slots "
                f"(num_blocks * block_size)"
            )
        if torch.unique(real).numel() != real.numel():
            raise ValueError("two tokens map to the same slot; each slot holds one token")
    result = (slots, real.numel() == slots.numel())
    _memo["slots"] = (key, result)
    return result


def check_mapping(block_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ``[n, 2]`` int64 (src, dst) mapping; return (src, dst) as CPU int64."""
    if (
        block_mapping.dtype != torch.int64
        or block_mapping.dim() != 2
        or (block_mapping.shape[1] != 2)
    ):
        raise ValueError(
            f"block_mapping must be an int64 tensor of shape [n, 2] holding (src, dst) pairs, "
            f"got {block_mapping.dtype} of shape {tuple(block_mapping.shape)}"
        )
    mapping = block_mapping.to("cpu")
    src, dst = mapping[:, 0], mapping[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("block_mapping writes a destination block twice; make each dst unique")
    return src, dst


def check_ids(ids: torch.Tensor, num_blocks: int, what: str) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.numel():
        raise ValueError(f"{what} block {int(bad[0])} is outside [0, {num_blocks})")


def check_paged_caches(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> tuple[int, int]:
    """Check ``key``/``value`` against x-split caches; return ``(num_blocks, block_size)``.

    The caches hold ``key.dtype`` (``"auto"``) or float8_e4m3fn (``"fp8"``), see
    :func:`check_cache_dtype`; ``x`` is the cache dtype's.
    """
    check_kv(key, value)
    _, num_kv_heads, head_size = key.shape
    if key.dtype not in CACHE_DTYPES:
        raise ValueError(f"key dtype {key.dtype} unsupported; use float32, float16, bfloat16")
    check_cache_dtype(key.dtype, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    x = vector_elems(key_cache.dtype)
    if key_cache.dim() != 5 or value_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be 5-D and value_cache 4-D, got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}"
        )
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    want_k = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    want_v = (num_blocks, num_kv_heads, head_size, block_size)
    if head_size % x != 0 or tuple(key_cache.shape) != want_k:
        raise ValueError(
            f"key_cache must be [num_blocks, num_kv_heads, head_size // x, block_size, x] with "
            f"x={x} for {key_cache.dtype}: expected {want_k}, got {tuple(key_cache.shape)}"
        )
    if tuple(value_cache.shape) != want_v:
        raise ValueError(
            f"value_cache must be [num_blocks, num_kv_heads, head_size, block_size] = {want_v}, "
            f"got {tuple(value_cache.shape)}"
        )
    if key_cache.device != value_cache.device:
        raise ValueError("key_cache and value_cache must be on one device")
    return num_blocks, block_size


def check_flash_caches(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int]:
    """Check ``key``/``value`` against flash-layout caches; return ``(num_blocks, block_size)``."""
    check_kv(key, value)
    _, num_kv_heads, head_size = key.shape
    if key_cache.dtype != key.dtype or value_cache.dtype != key.dtype:
        raise ValueError(
            f"cache dtypes ({key_cache.dtype}, {value_cache.dtype}) must equal the key dtype "
            f"{key.dtype}"
        )
    if (
        key_cache.dim() != 4
        or key_cache.shape != value_cache.shape
        or tuple(key_cache.shape[2:]) != (num_kv_heads, head_size)
    ):
        raise ValueError(
            f"key_cache and value_cache must both be [num_blocks, block_size, {num_kv_heads}, "
            f"{head_size}], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.device != value_cache.device:
        raise ValueError("key_cache and value_cache must be on one device")
    return key_cache.shape[0], key_cache.shape[1]


def check_copy(
    key_caches, value_caches, block_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a ``copy_blocks`` call; return its (src, dst) block ids as CPU int64 tensors."""
    if len(key_caches) != len(value_caches):
        raise ValueError(
            f"got {len(key_caches)} key caches but {len(value_caches)} value caches; pass one "
            f"of each per layer"
        )
    src, dst = check_mapping(block_mapping)
    if bool(torch.isin(dst, src).any()):
        raise ValueError(
            "a block is both a copy source and a destination; split the mapping into two calls"
        )
    for cache in list(key_caches) + list(value_caches):
        if cache.dim() < 2:
            raise ValueError(f"a cache must have a leading block dimension, got {cache.shape}")
        check_ids(src, cache.shape[0], "source")
        check_ids(dst, cache.shape[0], "destination")
    return src, dst


def check_swap(
    src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a ``swap_blocks`` call; return its (src, dst) block ids as CPU int64 tensors."""
    if src.dim() < 2 or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"src and dst must hold blocks of one shape and dtype, got {tuple(src.shape)} "
            f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}"
        )
    if src.data_ptr() == dst.data_ptr():
        raise ValueError("src and dst are the same tensor; use copy_blocks inside one cache")
    src_ids, dst_ids = check_mapping(block_mapping)
    check_ids(src_ids, src.shape[0], "source")
    check_ids(dst_ids, dst.shape[0], "destination")
    return src_ids, dst_ids
