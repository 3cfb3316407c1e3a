"""Graded tests for lab 02-04: PagedAttention in PyTorch.

The expected outputs never come from the lab's own code: the tests write each sequence's keys and
values into the caches with index arithmetic spelled out here, and compute the attention with lab
01's reference (``mini_vllm.attention.reference.ref_attention``) or with a closed form.

Task by task: every test uses only the task it is about and the tasks before it (the decode
tests fill the caches themselves, never through the student's ``reshape_and_cache``; v1 and v2
have their own tests), so a student sees tests pass after each task. ``scripts/task_by_task.py
02-04`` checks that.

Adversarial caches: every slot that holds no context token holds junk, as a real cache does
(stale KV of a block's previous owner, or memory nobody wrote). In the grids the junk is finite
and large (a stale value is 1000), so reading it is a large error rather than one at the edge of
the tolerance; in the ``..._ignore_nan...`` tests it is NaN, and padding table entries are
negative or beyond the cache. Logic errors (the x split, slot offsets, the GQA head mapping, the
ALiBi bias, the mask) each have a targeted test whose inputs make the mistake obvious and whose
message names the sequence, head, position or partition that is wrong.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
import torch

from course.labs.loader import load_lab
from course.labs.numerics import assert_close, tolerances
from mini_vllm.attention.reference import ref_attention

lab = load_lab(__file__)

HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [8, 16, 32]
NUM_HEADS = [(40, 40), (64, 8)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PARTITION = 512
STALE_VALUE = 1000.0  # what a stale value slot holds in the finite-junk caches
NAN = float("nan")


# ------------------------------------------------------------------------------------------
# Helpers written independently of the lab
# ------------------------------------------------------------------------------------------


def x_of(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def key_flat_index(blocks, offsets, num_kv_heads, head_size, block_size, x):
    """Flat position of key element (token, h, d) in a contiguous x-split key cache.

    Returns ``[tokens, num_kv_heads, head_size]`` int64: the address arithmetic of upstream's
    ``reshape_and_cache`` kernel, spelled out.
    """
    h = torch.arange(num_kv_heads)[None, :, None]
    d = torch.arange(head_size)[None, None, :]
    b = blocks[:, None, None]
    o = offsets[:, None, None]
    chunks = head_size // x
    return (((b * num_kv_heads + h) * chunks + d // x) * block_size + o) * x + d % x


def value_flat_index(blocks, offsets, num_kv_heads, head_size, block_size):
    h = torch.arange(num_kv_heads)[None, :, None]
    d = torch.arange(head_size)[None, None, :]
    b = blocks[:, None, None]
    o = offsets[:, None, None]
    return ((b * num_kv_heads + h) * head_size + d) * block_size + o


def write_tokens(key_cache, value_cache, blocks, offsets, keys, values):
    """Put token i's key and value at block ``blocks[i]``, offset ``offsets[i]`` (never through
    the lab's reshape_and_cache): key element d in chunk d // x, lane d % x."""
    n, kvh, head = keys.shape
    x = key_cache.shape[4]
    key_cache[blocks, :, :, offsets, :] = keys.reshape(n, kvh, head // x, x).to(key_cache.dtype)
    value_cache[blocks, :, :, offsets] = values.to(value_cache.dtype)


def token_major(key_cache, value_cache):
    """The same caches stored token-major (the flash layout) and viewed with the paged shapes:
    equal element for element, but not contiguous (as ``measure.py`` runs v1)."""
    keys = key_cache.permute(0, 3, 1, 2, 4).contiguous()  # [blocks, bs, kvh, D // x, x]
    values = value_cache.permute(0, 3, 1, 2).contiguous()  # [blocks, bs, kvh, D]
    return keys.permute(0, 2, 3, 1, 4), values.permute(0, 2, 3, 1)


def at_offset(cache, offset=1):
    """A contiguous copy of ``cache`` that starts ``offset`` elements into a larger tensor (a
    view that is not 16-byte aligned)."""
    flat = torch.full((cache.numel() + offset,), NAN, dtype=cache.dtype)
    view = flat[offset:].view(cache.shape)
    view.copy_(cache)
    return view


def cache_views(key_cache, value_cache):
    """(name, key view, value view): caches the ops must read and write through as they are."""
    keys_tm, values_tm = token_major(key_cache, value_cache)
    return [
        ("token-major (strided) caches", keys_tm, values_tm),
        ("a contiguous key cache beside a strided value cache", key_cache.clone(), values_tm),
        ("caches starting 1 element into a larger tensor", at_offset(key_cache),
         at_offset(value_cache)),
    ]


def describe_len(seq_len: int, block_size: int) -> str:
    if seq_len == 1:
        return "seq_len 1: one token"
    full, rest = divmod(seq_len, block_size)
    if rest == 0:
        return f"seq_len {seq_len}: {full} full block(s) of {block_size}, no partial block"
    return (
        f"seq_len {seq_len}: {full} full block(s) of {block_size} + {rest} token(s) in a partly "
        f"filled last block"
    )


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def check_attention(
    got, want, *, seq_lens, block_size, dtype, what, atol=None, rtol=None, alibi=False
):
    """``got`` equals ``want`` (both ``[num_seqs, num_heads, head_size]``) within the dtype's
    tolerance; otherwise say which (sequence, query head) outputs are wrong and what that
    pattern usually means."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{what}: out has shape {shape}, expected {tuple(want.shape)}")
    d_atol, d_rtol = tolerances(dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    err = (g - w).abs()
    bad = ~(err <= atol + rtol * w.abs())  # NaN counts as wrong
    if not bool(bad.any()):
        return
    wrong = bad.any(dim=-1)  # [num_seqs, num_heads]
    num_seqs, num_heads = wrong.shape
    finite_err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    lines = [
        f"{what}: {int(wrong.sum())} of {wrong.numel()} (sequence, query head) outputs are "
        f"wrong beyond atol={atol:g}, rtol={rtol:g} ({dtype})"
    ]
    bad_seqs = wrong.any(dim=1).nonzero().flatten().tolist()
    for s in bad_seqs[:8]:
        heads = wrong[s].nonzero().flatten().tolist()
        e = float(finite_err[s].max())
        nan = bool(torch.isnan(g[s]).any())
        lines.append(
            f"  sequence {s} ({describe_len(seq_lens[s], block_size)}): query heads "
            f"{_ranges(heads)} of {num_heads}; max error "
            + ("NaN" if math.isinf(e) else f"{e:.3g}")
            + (" (out holds NaN)" if nan and not math.isinf(e) else "")
        )
    if len(bad_seqs) > 8:
        lines.append(f"  ... and {len(bad_seqs) - 8} more sequences")
    ok_seqs = [s for s in range(num_seqs) if s not in bad_seqs]
    if bool(torch.isnan(g).all()):
        lines.append(
            "  every entry of out is still the NaN the test filled it with: write the result "
            "into `out` in place (out.copy_(...)), do not rebind the name"
        )
    elif bool(torch.isnan(g).any()):
        lines.append(
            "  out holds NaN although every context token is finite: NaN is only where the "
            "contract says values are ignored (slots past seq_len, padding blocks). A softmax "
            "weight of 0 times NaN is still NaN: exclude those values, do not multiply them by 0"
        )
    elif ok_seqs and all(seq_lens[s] % block_size for s in bad_seqs) and not any(
        seq_lens[s] % block_size for s in ok_seqs if seq_lens[s] > 1
    ):
        lines.append(
            "  only sequences whose last block is partly filled are wrong: positions >= seq_len "
            "hold stale data and must not join the softmax"
        )
    elif alibi and float(finite_err.max()) < 100 * (atol + rtol):
        lines.append(
            "  the errors are small, at the rounding level of large logits: is the ALiBi bias "
            "slope * (t - (seq_len - 1))? Measured from another position it shifts every logit "
            "of a row by the same amount, which softmax ignores except through rounding"
        )
    elif 0 < int(wrong.sum()) < len(bad_seqs) * num_heads:
        lines.append(
            "  in a wrong sequence some query heads are right: check which KV head each query "
            "head reads (h // (num_heads // num_kv_heads)) and each head's ALiBi slope"
        )
    raise AssertionError("\n".join(lines))


class Batch:
    """A random decode batch over paged caches full of junk.

    Every sequence gets its own physical blocks (a random permutation); its context tokens are
    written by flat address and kept (``self.keys[s]``, ``self.values[s]``) for the expected
    output. Every other slot holds junk: with ``junk="finite"`` random keys and the value
    STALE_VALUE (so reading one is a large error), with ``junk="nan"`` NaN. Each table row has
    at least one padding column after the sequence's blocks: a spare (junk) block id, or with
    ``junk="nan"`` also -1 and ids beyond the cache.
    """

    def __init__(
        self,
        *,
        seed,
        seq_lens,
        num_heads,
        head_size,
        block_size,
        dtype,
        alibi,
        junk="finite",
        scale=None,
        max_seq_len=None,
        spare_blocks=3,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads = num_heads
        self.head_size, self.block_size, self.dtype = head_size, block_size, dtype
        self.seq_lens_list = list(seq_lens)
        self.max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
        num_seqs = len(seq_lens)
        kvh = self.num_kv_heads
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        cols = max(blocks_needed) + 1  # always at least one padding column
        num_blocks = sum(blocks_needed) + spare_blocks
        x = x_of(dtype)
        if junk == "nan":
            self.key_cache = torch.full((num_blocks, kvh, head_size // x, block_size, x), NAN)
            self.value_cache = torch.full((num_blocks, kvh, head_size, block_size), NAN)
        else:
            self.key_cache = torch.randn(
                num_blocks, kvh, head_size // x, block_size, x, generator=gen
            )
            self.value_cache = torch.full((num_blocks, kvh, head_size, block_size), STALE_VALUE)
        self.key_cache = self.key_cache.to(dtype)
        self.value_cache = self.value_cache.to(dtype)

        perm = torch.randperm(num_blocks, generator=gen).tolist()
        spare = perm[sum(blocks_needed) :]
        table = torch.empty(num_seqs, cols, dtype=torch.int32)
        self.keys, self.values = [], []
        for s, n in enumerate(seq_lens):
            own = [perm.pop(0) for _ in range(blocks_needed[s])]
            pads = [spare[(s + j) % len(spare)] for j in range(cols - len(own))]
            if junk == "nan":
                kinds = [-1, num_blocks + 7, 2**31 - 1, pads[0]]
                pads = [kinds[(s + j) % 4] for j in range(len(pads))]
            table[s] = torch.tensor(own + pads, dtype=torch.int32)
            k = torch.randn(n, kvh, head_size, generator=gen).to(dtype)
            v = torch.randn(n, kvh, head_size, generator=gen).to(dtype)
            pos = torch.arange(n)
            blocks = torch.tensor(own, dtype=torch.int64)[pos // block_size]
            write_tokens(self.key_cache, self.value_cache, blocks, pos % block_size, k, v)
            self.keys.append(k)
            self.values.append(v)
        self.block_tables = table
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query = torch.randn(num_seqs, self.num_heads, head_size, generator=gen).to(dtype)
        self.scale = head_size**-0.5 if scale is None else scale
        self.alibi_slopes = (
            torch.randn(self.num_heads, generator=gen).abs() * 0.2 + 0.01 if alibi else None
        )

    def expected(self) -> torch.Tensor:
        outs = []
        for s in range(len(self.seq_lens_list)):
            outs.append(
                ref_attention(
                    self.query[s : s + 1],
                    self.keys[s],
                    self.values[s],
                    scale=self.scale,
                    alibi_slopes=self.alibi_slopes,
                )[0]
            )
        return torch.stack(outs)

    def logits(self, s: int) -> torch.Tensor:
        """fp32 logits ``[num_heads, seq_len]`` of sequence ``s`` (for checking v2's buffers)."""
        seq_len = self.seq_lens_list[s]
        group = self.num_heads // self.num_kv_heads
        k = self.keys[s].float().repeat_interleave(group, dim=1)  # [T, H, D]
        logits = torch.einsum("hd,thd->ht", self.query[s].float(), k) * self.scale
        if self.alibi_slopes is not None:
            dist = torch.arange(seq_len) - (seq_len - 1)
            logits = logits + self.alibi_slopes[:, None] * dist[None, :]
        return logits

    def check(self, got, what):
        check_attention(
            got,
            self.expected(),
            seq_lens=self.seq_lens_list,
            block_size=self.block_size,
            dtype=self.dtype,
            what=what,
            alibi=self.alibi_slopes is not None,
        )

    def args(self):
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.num_kv_heads,
            self.scale,
            self.block_tables,
            self.seq_lens,
            self.block_size,
            self.max_seq_len,
            self.alibi_slopes,
        )

    def run_v1(self):
        out = torch.full_like(self.query, NAN)
        lab.paged_attention_v1(out, *self.args())
        return out

    def v2_buffers(self, extra_partitions=0, fill=NAN):
        num_seqs = len(self.seq_lens_list)
        parts = -(-self.max_seq_len // PARTITION) + extra_partitions
        shape = (num_seqs, self.num_heads, parts)
        return (
            torch.full(shape, fill),
            torch.full(shape, fill),
            torch.full((*shape, self.head_size), fill, dtype=self.dtype),
        )

    def run_v2(self, buffers=None):
        exp_sums, max_logits, tmp_out = self.v2_buffers() if buffers is None else buffers
        out = torch.full_like(self.query, NAN)
        lab.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *self.args())
        return out


def short_lens(rng: random.Random, block_size: int) -> list[int]:
    """Context lengths with a one-token sequence, an exact multiple of the block size and a
    partial last block, so masking at block boundaries is exercised in every case."""
    return [1, block_size * rng.randint(1, 2), block_size * rng.randint(1, 2) + rng.randint(1, 7)]


SHORT_GRID = list(itertools.product(HEAD_SIZES, BLOCK_SIZES, NUM_HEADS, [False, True], DTYPES))


def grid_id(case) -> str:
    head, block, heads, alibi, dtype = case
    return f"d{head}-b{block}-h{heads[0]}x{heads[1]}-{'alibi' if alibi else 'noalibi'}-" + str(
        dtype
    ).removeprefix("torch.")


# A smaller grid for v2 (v1 covers the whole grid): every head size and both head layouts,
# ALiBi on and off; block size and dtype rotate so that each appears.
ROTATING_GRID = [
    (head, BLOCK_SIZES[i % 3], heads, alibi, DTYPES[(i // 3) % 3])
    for i, (head, heads, alibi) in enumerate(
        itertools.product(HEAD_SIZES, NUM_HEADS, [False, True])
    )
]


def _assert_rejected(what, fn, *tensors):
    """``fn()`` raises ValueError and leaves every tensor in ``tensors`` as it was."""
    before = [t.clone() for t in tensors]
    try:
        fn()
    except ValueError:
        pass
    else:
        raise AssertionError(f"{what}: expected ValueError, the call returned normally")
    for t, b in zip(tensors, before):
        assert torch.equal(t.isnan(), b.isnan()) and torch.equal(
            t.nan_to_num(), b.nan_to_num()
        ), f"{what}: the call was rejected but it had already written into a cache or buffer"


# ------------------------------------------------------------------------------------------
# Task 1: layouts
# ------------------------------------------------------------------------------------------


def test_x_is_one_16_byte_vector():
    for dtype, x in ((torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8)):
        assert lab.kv_cache_x(dtype) == x, f"kv_cache_x({dtype}) must be {x} (16 bytes)"
    for dtype in (torch.int64, torch.float64, torch.int8):
        with pytest.raises(ValueError):
            lab.kv_cache_x(dtype)


def test_kv_cache_shape_is_two_halves_of_flat_blocks():
    assert tuple(lab.get_kv_cache_shape(5, 16, 4, 64)) == (2, 5, 16 * 4 * 64), (
        f"get_kv_cache_shape(5, 16, 4, 64) must be (2, num_blocks, block_size * num_kv_heads * "
        f"head_size) = (2, 5, 4096), got {tuple(lab.get_kv_cache_shape(5, 16, 4, 64))}"
    )
    assert tuple(lab.get_kv_cache_shape(1, 8, 1, 80)) == (2, 1, 8 * 80), (
        f"get_kv_cache_shape(1, 8, 1, 80) must be (2, 1, 640), "
        f"got {tuple(lab.get_kv_cache_shape(1, 8, 1, 80))}"
    )
    good = [5, 16, 4, 64]
    for i, name in enumerate(("num_blocks", "block_size", "num_kv_heads", "head_size")):
        for bad in (0, -1, 2.0):
            args = list(good)
            args[i] = bad
            with pytest.raises(ValueError):
                lab.get_kv_cache_shape(*args)
                pytest.fail(f"get_kv_cache_shape accepted {name}={bad!r}")


def test_split_kv_cache_views_the_combined_tensor():
    shape = lab.get_kv_cache_shape(5, 16, 4, 64)
    kv = torch.zeros(shape, dtype=torch.float16)
    key_cache, value_cache = lab.split_kv_cache(kv, 4, 64)
    assert tuple(key_cache.shape) == (5, 4, 64 // 8, 16, 8), (
        f"split_kv_cache, fp16 (x = 8): key_cache must be [num_blocks, num_kv_heads, "
        f"head_size // x, block_size, x] = (5, 4, 8, 16, 8), got {tuple(key_cache.shape)}"
    )
    assert tuple(value_cache.shape) == (5, 4, 64, 16), (
        f"split_kv_cache: value_cache must be [num_blocks, num_kv_heads, head_size, block_size] "
        f"= (5, 4, 64, 16), got {tuple(value_cache.shape)}"
    )
    # Views, not copies: a write lands in the combined tensor, keys in half 0, values in half 1.
    key_cache[3, 2, 1, 5, 7] = 1.0
    value_cache[4, 1, 9, 15] = 2.0
    assert kv[0, 3, ((2 * 8 + 1) * 16 + 5) * 8 + 7] == 1.0, "key_cache is not a view of kv[0]"
    assert kv[1, 4, (1 * 64 + 9) * 16 + 15] == 2.0, "value_cache is not a view of kv[1]"
    assert int((kv != 0).sum()) == 2, (
        f"one write through key_cache and one through value_cache should change exactly 2 "
        f"elements of kv, got {int((kv != 0).sum())} nonzero"
    )


def test_split_kv_cache_infers_the_block_size():
    # float32 (x = 4), block size 8, two KV heads of 32: the block size comes from the tensor.
    kv = torch.zeros(2, 3, 8 * 2 * 32)
    key_cache, value_cache = lab.split_kv_cache(kv, 2, 32)
    assert tuple(key_cache.shape) == (3, 2, 32 // 4, 8, 4), (
        f"split_kv_cache, float32 (x = 4), rows of 8 * 2 * 32: block_size 8 comes from the row "
        f"length, so key_cache must be (3, 2, 8, 8, 4), got {tuple(key_cache.shape)}"
    )
    assert tuple(value_cache.shape) == (3, 2, 32, 8), (
        f"split_kv_cache, rows of 8 * 2 * 32: block_size 8 comes from the row length, so "
        f"value_cache must be (3, 2, 32, 8), got {tuple(value_cache.shape)}"
    )


def test_layout_helpers_reject_bad_shapes():
    cases = [
        ("leading dimension 3, not 2", torch.zeros(3, 5, 16 * 4 * 64), 4, 64),
        ("a 2-D tensor", torch.zeros(2, 5 * 16 * 4 * 64), 4, 64),
        ("head_size 60 is not a multiple of x = 8", torch.zeros(2, 5, 16 * 4 * 60).half(), 4, 60),
        ("a block of 100 elements for 4 heads of 64", torch.zeros(2, 5, 100), 4, 64),
    ]
    for what, kv, kvh, head in cases:
        with pytest.raises(ValueError):
            lab.split_kv_cache(kv, kvh, head)
            pytest.fail(f"split_kv_cache accepted {what}")


# ------------------------------------------------------------------------------------------
# Task 2: reshape_and_cache
# ------------------------------------------------------------------------------------------


def _slot_case(dtype, block_size, seed, num_tokens=23, num_blocks=9, kvh=3, head=32):
    gen = torch.Generator().manual_seed(seed)
    x = x_of(dtype)
    key = torch.randn(num_tokens, kvh, head, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kvh, head, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:num_tokens] + 1
    slots[1] = 0  # slot 0 is a real slot (block 0, offset 0)
    slots[::5] = -1  # padding tokens, the first one included ...
    slots[-1] = -1  # ... and the last
    key[slots < 0] = NAN  # what a padding token carries must never reach the cache
    value[slots < 0] = NAN
    key_cache = torch.randn(num_blocks, kvh, head // x, block_size, x, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kvh, head, block_size, generator=gen).to(dtype)
    return key, value, key_cache, value_cache, slots


def check_written(key_cache, value_cache, key, value, slots, k_before, v_before):
    """Every real token's key and value at its address, and nothing else changed."""
    num_blocks, kvh, chunks, block_size, x = key_cache.shape
    head = chunks * x
    real = (slots >= 0).nonzero().flatten()
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    k_idx = key_flat_index(blocks, offsets, kvh, head, block_size, x)
    v_idx = value_flat_index(blocks, offsets, kvh, head, block_size)
    k_flat, v_flat = key_cache.reshape(-1), value_cache.reshape(-1)
    for j, i in enumerate(real.tolist()):
        b, o, s = int(blocks[j]), int(offsets[j]), int(slots[i])
        where = f"token {i} (slot {s} = block {b} * {block_size} + offset {o})"
        got_k, got_v = k_flat[k_idx[j]], v_flat[v_idx[j]]
        if not torch.equal(got_k, key[i]):
            bad = (got_k != key[i]).nonzero()[0].tolist()
            h, d = bad
            msg = (
                f"{where}: key element d={d} of KV head {h} belongs at "
                f"key_cache[{b}, {h}, {d // x}, {o}, {d % x}] (chunk d // x, lane d % x, "
                f"x = {x}) and holds {float(got_k[h, d]):.4g}, not {float(key[i, h, d]):.4g}"
            )
            if torch.equal(got_k.flatten().sort().values, key[i].flatten().sort().values):
                msg += "; the token's elements are all there, in another order: the x split"
            if bool(torch.isnan(got_k).any()):
                msg += (
                    "; NaN is what the padding tokens (negative slots) carry: one was written "
                    "here (slot -1 indexes the last slot; a negative slot writes nothing)"
                )
            for delta in (-1, 1):
                if 0 <= o + delta < block_size:
                    idx = key_flat_index(blocks[j : j + 1], offsets[j : j + 1] + delta, kvh, head,
                                         block_size, x)[0]
                    if torch.equal(k_flat[idx], key[i]):
                        msg += f"; it sits at offset {o + delta} instead: a slot off by {delta}"
            raise AssertionError(msg)
        if not torch.equal(got_v, value[i]):
            h, d = (got_v != value[i]).nonzero()[0].tolist()
            raise AssertionError(
                f"{where}: value element d={d} of KV head {h} belongs at "
                f"value_cache[{b}, {h}, {d}, {o}] and holds {float(got_v[h, d]):.4g}, not "
                f"{float(value[i, h, d]):.4g}"
            )
    # Nothing else moved: padding tokens (negative slots) and all other slots keep their data.
    for name, cache, before, idx in (
        ("key_cache", key_cache, k_before, k_idx),
        ("value_cache", value_cache, v_before, v_idx),
    ):
        touched = torch.zeros(cache.numel(), dtype=torch.bool)
        touched[idx.reshape(-1)] = True
        changed = (cache.reshape(-1) != before.reshape(-1)) & ~touched
        if bool(changed.any()):
            flat = int(changed.nonzero()[0])
            per_slot = cache.numel() // (num_blocks * block_size)
            if name == "key_cache":
                b, rest = divmod(flat, kvh * chunks * block_size * x)
                o = (rest // x) % block_size
            else:
                b, rest = divmod(flat, kvh * head * block_size)
                o = rest % block_size
            raise AssertionError(
                f"{name} changed at block {b}, offset {o} (slot {b * block_size + o}), which no "
                f"real token maps to ({int(changed.sum())} elements, {per_slot} per slot): "
                f"tokens with a negative slot are padding and write nothing (slot -1 is not "
                f"the last slot)"
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_writes_the_x_split_layout(dtype, block_size):
    key, value, key_cache, value_cache, slots = _slot_case(dtype, block_size, seed=block_size)
    if block_size == 16:
        slots = slots.to(torch.int32)  # int32 slot mappings are accepted too
    k_before, v_before = key_cache.clone(), value_cache.clone()
    lab.reshape_and_cache(key, value, key_cache, value_cache, slots)
    check_written(key_cache, value_cache, key, value, slots.long(), k_before, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_reshape_and_cache_writes_through_strided_and_offset_views(dtype):
    # The caches may be views (of a larger tensor, or in another memory order): the writes go
    # through the view, to the same elements as for a contiguous cache.
    key, value, key_cache, value_cache, slots = _slot_case(dtype, 8, seed=21)
    for what, k_view, v_view in cache_views(key_cache, value_cache):
        k_before, v_before = k_view.clone(), v_view.clone()
        try:
            lab.reshape_and_cache(key, value, k_view, v_view, slots)
            check_written(k_view, v_view, key, value, slots, k_before, v_before)
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_flash_round_trip(dtype):
    block_size, num_blocks, kvh, head = 16, 7, 2, 64
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(30, kvh, head, generator=gen).to(dtype)
    value = torch.randn(30, kvh, head, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:30] + 1
    slots[1] = 0  # slot 0 is a real slot
    slots[[0, 7, 29]] = -1
    key[[0, 7, 29]] = NAN
    value[[0, 7, 29]] = NAN
    key_cache = torch.randn(num_blocks, block_size, kvh, head, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kvh, head, generator=gen).to(dtype)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    lab.reshape_and_cache_flash(key, value, key_cache, value_cache, slots)

    flat_k = key_cache.reshape(num_blocks * block_size, kvh, head)
    flat_v = value_cache.reshape(num_blocks * block_size, kvh, head)
    for i in (slots >= 0).nonzero().flatten().tolist():
        s = int(slots[i])
        where = f"token {i} (slot {s} = block {s // block_size}, offset {s % block_size})"
        assert torch.equal(flat_k[s], key[i]), f"{where}: key not at key_cache[block, offset]"
        assert torch.equal(flat_v[s], value[i]), f"{where}: value not at value_cache[block, offset]"
    others = torch.ones(num_blocks * block_size, dtype=torch.bool)
    others[slots[slots >= 0]] = False
    for name, flat, before in (("key", flat_k, k_before), ("value", flat_v, v_before)):
        moved = (flat != before.reshape_as(flat)).flatten(1).any(dim=1) & others
        assert not bool(moved.any()), (
            f"{name}_cache changed at slots {moved.nonzero().flatten().tolist()}, which no real "
            f"token maps to (negative slots are padding and write nothing)"
        )


@pytest.mark.parametrize("layout", ["x-split", "flash"])
def test_reshape_and_cache_uses_only_the_slot_mapping_length(layout):
    # Upstream sizes the work by slot_mapping: a key padded past it must not be written.
    key, value, key_cache, value_cache, _ = _slot_case(torch.float32, 8, seed=11)
    slots = torch.tensor([5, 40, 3], dtype=torch.int64)
    if layout == "flash":
        key_cache = key_cache.permute(0, 3, 1, 2, 4).reshape(9, 8, 3, 32).contiguous()
        value_cache = value_cache.permute(0, 3, 1, 2).contiguous()
        before = key_cache.clone()
        lab.reshape_and_cache_flash(key, value, key_cache, value_cache, slots)
    else:
        before = key_cache.clone()
        lab.reshape_and_cache(key, value, key_cache, value_cache, slots)
    changed = (key_cache != before).reshape(key_cache.shape[0], -1).any(dim=1)
    blocks = changed.nonzero().flatten().tolist()
    assert blocks == [0, 5], (
        f"the keys changed in blocks {blocks}; slot_mapping has 3 entries (slots 3 and 5 are in "
        f"block 0, slot 40 in block 5), and only those 3 of the {key.shape[0]} tokens are written"
    )


def test_reshape_and_cache_rejects_bad_input_and_writes_nothing():
    key, value, key_cache, value_cache, slots = _slot_case(torch.float16, 16, seed=5)
    caches = (key_cache, value_cache)
    beyond = slots.clone()
    beyond[-2] = key_cache.shape[0] * 16  # one past the last slot; earlier slots are fine
    _assert_rejected(
        "a slot beyond the cache (after valid ones)",
        lambda: lab.reshape_and_cache(key, value, *caches, beyond),
        *caches,
    )
    twice = slots.clone()
    twice[1] = twice[2] = 7
    _assert_rejected(
        "two tokens in one slot", lambda: lab.reshape_and_cache(key, value, *caches, twice), *caches
    )
    wrong_x = key_cache.view(key_cache.shape[0], 3, 8, 16, 4)  # fp32's x on an fp16 cache
    _assert_rejected(
        "a key cache split with float32's x on float16 data",
        lambda: lab.reshape_and_cache(key, value, wrong_x, value_cache, slots),
        *caches,
    )
    _assert_rejected(
        "float32 keys into a float16 cache",
        lambda: lab.reshape_and_cache(key.float(), value.float(), *caches, slots),
        *caches,
    )
    _assert_rejected(
        "key and value of different shapes",
        lambda: lab.reshape_and_cache(key, value[:, :2], *caches, slots),
        *caches,
    )
    _assert_rejected(
        "a slot mapping longer than the keys",
        lambda: lab.reshape_and_cache(key[:3], value[:3], *caches, slots),
        *caches,
    )
    flash_k = torch.zeros(4, 16, 3, 32, dtype=torch.float16)
    flash_v = torch.zeros(4, 16, 3, 32, dtype=torch.float16)
    bad = torch.tensor([0, 64], dtype=torch.int64)  # 64 = 4 blocks * 16: beyond the cache
    _assert_rejected(
        "reshape_and_cache_flash with a slot beyond the cache",
        lambda: lab.reshape_and_cache_flash(key[:2], value[:2], flash_k, flash_v, bad),
        flash_k,
        flash_v,
    )


# ------------------------------------------------------------------------------------------
# Task 3: paged_attention_v1
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SHORT_GRID, ids=grid_id)
def test_v1_matches_reference(case):
    """Upstream's kernel-test grid (tests/kernels/attention/test_attention.py:133 @ v0.11.0) on
    short contexts: a one-token sequence, whole blocks, a partly filled last block."""
    head, block, heads, alibi, dtype = case
    rng = random.Random(zlib.crc32(grid_id(case).encode()))
    batch = Batch(
        seed=rng.randint(0, 10**6),
        seq_lens=short_lens(rng, block),
        num_heads=heads,
        head_size=head,
        block_size=block,
        dtype=dtype,
        alibi=alibi,
    )
    batch.check(batch.run_v1(), f"v1 {grid_id(case)}")


@pytest.mark.parametrize("heads", NUM_HEADS, ids=lambda h: f"h{h[0]}x{h[1]}")
def test_v1_long_contexts(heads):
    batch = Batch(
        seed=1,
        seq_lens=[1000, 517, 9],
        num_heads=heads,
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=True,
    )
    batch.check(batch.run_v1(), "v1 with contexts of 1000, 517 and 9 tokens")


def _decode(out, query, key_cache, value_cache, kvh, scale, tables, lens, block_size, **kw):
    lab.paged_attention_v1(
        out, query, key_cache, value_cache, kvh, scale, tables, lens, block_size,
        max(lens.tolist()), **kw,
    )
    return out


def _tables(seq_lens, block_size, num_blocks, seed):
    """Block tables of distinct shuffled blocks, padded with a spare block id."""
    perm = random.Random(seed).sample(range(num_blocks), num_blocks)
    cols = max(-(-n // block_size) for n in seq_lens) + 1
    rows, spare = [], perm[-1]
    for n in seq_lens:
        own = [perm.pop(0) for _ in range(-(-n // block_size))]
        rows.append(own + [spare] * (cols - len(own)))
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_v1_masks_positions_past_seq_len(block_size):
    """Keys all zero, so every visible position gets the same weight; the value of position t is
    t. The output is the mean position, (seq_len - 1) / 2, exactly. Stale slots and padding
    blocks hold the value 1000: reading one pulls the mean far up."""
    lens = [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size + 5]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    tables = _tables(lens, block_size, num_blocks, seed=block_size)
    kvh, heads, head = 1, 2, 16
    key_cache = torch.zeros(num_blocks, kvh, head // 4, block_size, 4)
    value_cache = torch.full((num_blocks, kvh, head, block_size), STALE_VALUE)
    for s, n in enumerate(lens):
        pos = torch.arange(n)
        blocks = tables[s].long()[pos // block_size]
        vals = pos.float()[:, None, None].expand(n, kvh, head)
        write_tokens(key_cache, value_cache, blocks, pos % block_size, torch.zeros(n, kvh, head),
                     vals)
    query = torch.randn(len(lens), heads, head, generator=torch.Generator().manual_seed(0))
    out = _decode(torch.full_like(query, NAN), query, key_cache, value_cache, kvh, 0.5, tables,
                  torch.tensor(lens, dtype=torch.int32), block_size)
    for s, n in enumerate(lens):
        want = (n - 1) / 2
        got = float(out[s].mean())
        if not abs(got - want) < 1e-3:
            extra = n * (got - want) / (STALE_VALUE - got) if got < STALE_VALUE else float("inf")
            raise AssertionError(
                f"sequence {s} ({describe_len(n, block_size)}): with equal weights out must be "
                f"the mean position {want:g}, got {got:.6g}"
                + (
                    f": about {extra:.1f} slot(s) past seq_len (value {STALE_VALUE:g}) joined "
                    f"the softmax; mask positions >= seq_len"
                    if got > want and math.isfinite(extra)
                    else ""
                )
            )


@pytest.mark.parametrize(
    "heads", [(8, 2), (12, 3), (6, 6), (4, 1)], ids=lambda h: f"h{h[0]}x{h[1]}"
)
def test_v1_query_head_reads_kv_head_h_over_group(heads):
    """KV head k holds a key that matches every query only at position 2k + 1, and values
    100 * (k + 1) + t. A query head's output, 100 * (v + 1) + (2k + 1), tells which KV head v
    its values came from and which KV head k its keys came from."""
    num_heads, kvh = heads
    group = num_heads // kvh
    block_size, head, n = 8, 32, 2 * kvh + 3
    num_blocks = -(-n // block_size) + 1
    tables = _tables([n], block_size, num_blocks, seed=kvh)
    c = math.sqrt(40 / (head * head**-0.5))  # q . k * scale = 40 at the matching position
    keys = torch.zeros(n, kvh, head)
    for k in range(kvh):
        keys[2 * k + 1, k] = c
    vals = (100.0 * (torch.arange(kvh) + 1)[None, :, None] + torch.arange(n)[:, None, None])
    vals = vals.expand(n, kvh, head).contiguous()
    x = 4
    key_cache = torch.zeros(num_blocks, kvh, head // x, block_size, x)
    value_cache = torch.full((num_blocks, kvh, head, block_size), STALE_VALUE)
    pos = torch.arange(n)
    write_tokens(key_cache, value_cache, tables[0].long()[pos // block_size], pos % block_size,
                 keys, vals)
    query = torch.full((1, num_heads, head), c)
    out = _decode(torch.full_like(query, NAN), query, key_cache, value_cache, kvh, head**-0.5,
                  tables, torch.tensor([n], dtype=torch.int32), block_size)
    problems = []
    for h in range(num_heads):
        want_kv = h // group
        got = float(out[0, h].mean())
        want = 100.0 * (want_kv + 1) + 2 * want_kv + 1
        if abs(got - want) < 1e-2:
            continue
        v_head = round(got / 100) - 1
        k_pos = got - 100 * (v_head + 1)
        k_head = (round(k_pos) - 1) / 2
        src = (
            f"its values came from KV head {v_head} and its keys from KV head {int(k_head)}"
            if abs(k_pos - round(k_pos)) < 0.05 and k_head == int(k_head) and 0 <= k_head < kvh
            else f"its output {got:.4g} is no single KV head's"
        )
        problems.append(f"query head {h}: {src}, expected KV head {want_kv} for both")
    assert not problems, (
        f"{num_heads} query heads on {kvh} KV heads (groups of {group}): query head h reads KV "
        f"head h // {group}\n  " + "\n  ".join(problems)
    )


def test_v1_alibi_bias_grows_negative_into_the_past():
    """Keys all zero, so the logits are the ALiBi bias alone; the value of position t is t. The
    output is then the bias-weighted mean position, computed here in closed form: the newest
    token (bias 0) must weigh most."""
    block_size, head, kvh = 8, 16, 2
    slopes = torch.tensor([0.05, 0.5, 1.0, 3.0])
    lens = [1, 5, 20, 37]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    tables = _tables(lens, block_size, num_blocks, seed=3)
    key_cache = torch.zeros(num_blocks, kvh, head // 4, block_size, 4)
    value_cache = torch.full((num_blocks, kvh, head, block_size), STALE_VALUE)
    for s, n in enumerate(lens):
        pos = torch.arange(n)
        vals = pos.float()[:, None, None].expand(n, kvh, head)
        write_tokens(key_cache, value_cache, tables[s].long()[pos // block_size],
                     pos % block_size, torch.zeros(n, kvh, head), vals)
    query = torch.randn(len(lens), 4, head, generator=torch.Generator().manual_seed(1))
    out = _decode(torch.full_like(query, NAN), query, key_cache, value_cache, kvh, 1.0, tables,
                  torch.tensor(lens, dtype=torch.int32), block_size, alibi_slopes=slopes)
    problems = []
    for s, n in enumerate(lens):
        t = torch.arange(n, dtype=torch.float64)
        for h, slope in enumerate(slopes.tolist()):
            w = torch.softmax(slope * (t - (n - 1)), dim=0)
            want = float((w * t).sum())
            got = float(out[s, h].mean())
            if not abs(got - want) < 1e-3 * max(1.0, want):
                problems.append(
                    f"sequence {s} (seq_len {n}), query head {h} (slope {slope:g}): the "
                    f"weighted mean position is {want:.4g}, got {got:.4g}"
                )
    assert not problems, (
        "the ALiBi bias of key position t is slope * (t - (seq_len - 1)): 0 for the newest "
        "token, more negative into the past, one slope per query head\n  " + "\n  ".join(problems)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_v1_reads_key_elements_through_the_x_split(dtype):
    """Sequence d has two tokens; token 0's key is c at element d and 0 elsewhere, and so is the
    query. Read right, token 0 dominates (logit 30) and out is token 0's value, +1; a key
    element read from the wrong chunk or lane misses the query and out drops to about 0."""
    head, block_size = 32, 8
    x = x_of(dtype)
    num_seqs = head
    num_blocks = num_seqs + 1
    tables = torch.stack([torch.tensor([s, num_seqs]) for s in range(num_seqs)]).to(torch.int32)
    scale = head**-0.5
    c = math.sqrt(30 / scale)
    keys = torch.zeros(num_seqs, 2, 1, head)
    keys[torch.arange(head), 0, 0, torch.arange(head)] = c
    vals = torch.ones(num_seqs, 2, 1, head)
    vals[:, 1] = -1.0
    key_cache = torch.zeros(num_blocks, 1, head // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, 1, head, block_size, dtype=dtype)
    for s in range(num_seqs):
        write_tokens(key_cache, value_cache, torch.tensor([s, s]), torch.tensor([0, 1]), keys[s],
                     vals[s])
    query = torch.zeros(num_seqs, 2, head)
    query[torch.arange(head), :, torch.arange(head)] = c
    query = query.to(dtype)
    out = _decode(torch.full_like(query, NAN), query, key_cache, value_cache, 1, scale, tables,
                  torch.full((num_seqs,), 2, dtype=torch.int32), block_size)
    missed = [d for d in range(head) if not float(out[d].float().mean()) > 0.9]
    assert not missed, (
        f"key elements d = {missed} were not read as element d ({dtype}, x = {x}): element d of "
        f"a key is key_cache[block, kv_head, d // x, offset, d % x]; undo the split by putting "
        f"the chunk axis (head_size // x) before the lane axis (x) next to each other, then "
        f"flatten them. (d, chunk, lane) of the first misses: "
        + ", ".join(f"({d}, {d // x}, {d % x})" for d in missed[:6])
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_v1_ignores_nan_in_stale_slots_and_padding(dtype):
    """The contract: slots past seq_len, blocks no sequence owns and table entries past
    ceil(seq_len / block_size) may hold anything. Here they hold NaN, -1 and block ids beyond
    the cache (what an uninitialised cache and a padded table really hold)."""
    batch = Batch(
        seed=30,
        seq_lens=[1, 16, 19, 31, 45],
        num_heads=(8, 2),
        head_size=64,
        block_size=16,
        dtype=dtype,
        alibi=True,
        junk="nan",
    )
    batch.check(batch.run_v1(), f"v1 over a cache whose unused slots hold NaN ({dtype})")


def test_v1_when_every_context_fills_its_blocks():
    # No position to mask: equal contexts of whole blocks (the grids always mix lengths).
    batch = Batch(seed=32, seq_lens=[32, 32, 32], num_heads=(8, 2), head_size=64,
                  block_size=16, dtype=torch.float32, alibi=False)
    batch.check(batch.run_v1(), "v1, three contexts of exactly two full blocks")


def test_v1_reads_strided_and_offset_caches():
    # As measure.py runs it over token-major memory: v1 must not assume a contiguous cache.
    batch = Batch(seed=31, seq_lens=[5, 40], num_heads=(8, 2), head_size=64, block_size=16,
                  dtype=torch.float32, alibi=False)
    for what, k_view, v_view in cache_views(batch.key_cache, batch.value_cache):
        batch.key_cache, batch.value_cache = k_view, v_view
        try:
            out = batch.run_v1()
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        batch.check(out, f"v1 over {what}")


def _units_off(out, want, dtype):
    """Error of ``out`` in units of ``dtype``'s spacing at ``want`` (at least its spacing at
    1/16, so that outputs near 0 do not turn a tiny absolute error into many units)."""
    mag = want.abs().clamp_min(1 / 16)
    spacing = torch.finfo(dtype).eps * torch.pow(2.0, torch.floor(torch.log2(mag)))
    return (out.double() - want).abs() / spacing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_v1_in_half_precision_rounds_only_the_result(dtype):
    """Logits, softmax and the weighted sum are float32 and only the result is rounded to
    ``out``'s dtype: every output is within one unit of the float64 result. A weighted sum in
    float16 / bfloat16 (values or probabilities rounded to the cache dtype) is off by several."""
    for seed in range(2):
        batch = Batch(seed=40 + seed, seq_lens=[1, 16, 37, 300], num_heads=(8, 2), head_size=64,
                      block_size=16, dtype=dtype, alibi=seed % 2 == 1)
        slopes = None if batch.alibi_slopes is None else batch.alibi_slopes.double()
        q = batch.query.double()
        want = torch.stack([
            ref_attention(q[s : s + 1], batch.keys[s].double(), batch.values[s].double(),
                          scale=batch.scale, alibi_slopes=slopes)[0]
            for s in range(len(batch.seq_lens_list))
        ])
        out = batch.run_v1()
        assert out.dtype == dtype, f"out must keep its dtype {dtype}, got {out.dtype}"
        err = _units_off(out, want, dtype)
        s, h = divmod(int(err.amax(dim=-1).flatten().argmax()), batch.num_heads)
        assert float(err.max()) <= 1.0, (
            f"seed {40 + seed}, {dtype}: out[{s}, {h}] is {float(err.max()):.2f} units of {dtype} "
            f"from the float64 result ({describe_len(batch.seq_lens_list[s], 16)}); compute the "
            f"logits, softmax and weighted sum in float32 and round only the result"
        )


def test_v1_uses_scale_defaults_and_a_larger_max_seq_len():
    """``scale`` is used as given (not 1/sqrt(head_size)), ``alibi_slopes`` defaults to None,
    and ``max_seq_len`` may exceed every seq_len."""
    batch = Batch(
        seed=31,
        seq_lens=[7, 24, 40],
        num_heads=(4, 2),
        head_size=64,
        block_size=8,
        dtype=torch.float32,
        alibi=False,
        scale=0.37,
        max_seq_len=100,
    )
    out = torch.full_like(batch.query, NAN)
    lab.paged_attention_v1(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.num_kv_heads,
        batch.scale,
        batch.block_tables,
        batch.seq_lens,
        batch.block_size,
        batch.max_seq_len,
    )
    batch.check(out, "v1 with scale 0.37, alibi_slopes left out and max_seq_len 100")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_one_token_sequences_and_an_empty_batch(version):
    """Every sequence one token long (the first decode after a one-token prompt): the output is
    that token's value, whatever the logits. A batch of no sequences writes nothing."""
    batch = Batch(
        seed=32,
        seq_lens=[1, 1, 1],
        num_heads=(4, 2),
        head_size=32,
        block_size=8,
        dtype=torch.float32,
        alibi=True,
    )
    out = batch.run_v1() if version == "v1" else batch.run_v2()
    batch.check(out, f"{version} with three one-token sequences")
    empty = torch.empty(0, 4, 32)
    args = list(batch.args())
    args[0] = empty
    args[5] = batch.block_tables[:0]
    args[6] = batch.seq_lens[:0]
    if version == "v1":
        lab.paged_attention_v1(empty, *args)
    else:
        bufs = (torch.empty(0, 4, 1), torch.empty(0, 4, 1), torch.empty(0, 4, 1, 32))
        lab.paged_attention_v2(empty, *bufs, *args)


def test_reshape_then_paged_attention_is_attention():
    """The data plane end to end: prefill writes K/V by slot, decode reads them by table."""
    dtype, heads, head, block_size = torch.float32, (8, 2), 64, 16
    gen = torch.Generator().manual_seed(7)
    lens = [37, 16, 5]
    num_blocks = 12
    x = x_of(dtype)
    key_cache = torch.full((num_blocks, heads[1], head // x, block_size, x), NAN, dtype=dtype)
    value_cache = torch.full((num_blocks, heads[1], head, block_size), NAN, dtype=dtype)
    tables = torch.tensor([[9, 2, 4], [6, -1, 99], [11, 0, 0]], dtype=torch.int32)
    keys = [torch.randn(n, heads[1], head, generator=gen) for n in lens]
    values = [torch.randn(n, heads[1], head, generator=gen) for n in lens]
    slots = torch.cat(
        [
            tables[s].long()[torch.arange(n) // block_size] * block_size
            + torch.arange(n) % block_size
            for s, n in enumerate(lens)
        ]
    )
    lab.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)
    query = torch.randn(len(lens), heads[0], head, generator=gen)
    out = torch.full_like(query, NAN)
    lab.paged_attention_v1(
        out,
        query,
        key_cache,
        value_cache,
        heads[1],
        head**-0.5,
        tables,
        torch.tensor(lens, dtype=torch.int32),
        block_size,
        max(lens),
    )
    want = torch.stack(
        [ref_attention(query[s : s + 1], keys[s], values[s], scale=head**-0.5)[0] for s in
         range(len(lens))]
    )
    check_attention(out, want, seq_lens=lens, block_size=block_size, dtype=dtype,
                    what="reshape_and_cache, then paged_attention_v1")


def _bad_decode_calls(batch: Batch):
    """(description, kwargs override) pairs of invalid inputs."""
    b = batch
    x = x_of(b.dtype)
    n = b.key_cache.shape[0]
    too_far = b.block_tables.clone()
    too_far[1, 0] = n
    return [
        (
            "key cache with x of another dtype",
            dict(
                key_cache=b.key_cache.reshape(
                    n, b.num_kv_heads, b.head_size // (x // 2), -1, x // 2
                )
            ),
        ),
        ("value cache dtype differs", dict(value_cache=b.value_cache.to(torch.float16))),
        ("block_size argument disagrees with the cache", dict(block_size=b.block_size * 2)),
        ("num_heads not a multiple of num_kv_heads", dict(num_kv_heads=3)),
        ("seq_len beyond max_seq_len", dict(max_seq_len=b.max_seq_len - 1)),
        ("block id beyond the cache", dict(block_tables=too_far)),
        ("int64 block tables", dict(block_tables=b.block_tables.long())),
        ("too few table columns", dict(block_tables=b.block_tables[:, :1].contiguous())),
        ("zero-length sequence", dict(seq_lens=torch.tensor([0, 9], dtype=torch.int32))),
        ("alibi slopes of the wrong length", dict(alibi_slopes=torch.ones(b.num_heads + 1))),
    ]


def _reject_batch():
    return Batch(
        seed=8,
        seq_lens=[20, 33],
        num_heads=(4, 2),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=False,
    )


def _decode_kwargs(batch, override):
    args = dict(
        query=batch.query,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        num_kv_heads=batch.num_kv_heads,
        scale=batch.scale,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        block_size=batch.block_size,
        max_seq_len=batch.max_seq_len,
        alibi_slopes=None,
    )
    args.update(override)
    return args


def test_v1_rejects_bad_input_and_writes_nothing():
    batch = _reject_batch()
    for what, override in _bad_decode_calls(batch):
        out = torch.full_like(batch.query, 7.0)
        args = _decode_kwargs(batch, override)
        _assert_rejected(
            f"v1, {what}", lambda a=args, o=out: lab.paged_attention_v1(o, **a), out
        )
    wrong_out = torch.full((2, 4, 32), 7.0)
    _assert_rejected(
        "v1 with out of another shape than query",
        lambda: lab.paged_attention_v1(wrong_out, **_decode_kwargs(batch, {})),
        wrong_out,
    )


# ------------------------------------------------------------------------------------------
# Task 4: paged_attention_v2 and its reduce
# ------------------------------------------------------------------------------------------


def _reduce_case(seed, parts_per_seq, bases, num_heads=3, head=16, extra=2):
    """Partitions of known logits for each sequence, their buffers filled as the contract says,
    and junk (NaN, inf, huge) in every partition past a sequence's own. The logits of sequence
    ``s`` sit around ``bases[s]``: near 100, exp() of a logit overflows float32, so the merge
    must subtract a max first; and sequences far apart (100 and -60) need a max of their own."""
    gen = torch.Generator().manual_seed(seed)
    width = max(parts_per_seq) + extra
    num_seqs = len(parts_per_seq)
    exp_sums = torch.empty(num_seqs, num_heads, width)
    max_logits = torch.empty(num_seqs, num_heads, width)
    tmp_out = torch.empty(num_seqs, num_heads, width, head)
    junk = [NAN, math.inf, -math.inf, 1e30]
    seq_lens, want = [], []
    for s, parts in enumerate(parts_per_seq):
        seq_len = (parts - 1) * PARTITION + 1 + (37 * s) % PARTITION
        seq_lens.append(seq_len)
        logits = torch.randn(num_heads, seq_len, generator=gen) * 3 + bases[s]
        for p in range(parts):
            logits[:, p * PARTITION : (p + 1) * PARTITION] += 6.0 * ((p * 7 + s) % 3)
        values = torch.randn(seq_len, head, generator=gen)
        want.append(torch.softmax(logits.double(), dim=1) @ values.double())
        for p in range(parts):
            chunk = logits[:, p * PARTITION : (p + 1) * PARTITION]
            m = chunk.amax(dim=1)
            w = torch.exp(chunk - m[:, None])
            max_logits[s, :, p] = m
            exp_sums[s, :, p] = w.sum(dim=1)
            tmp_out[s, :, p] = (w @ values[p * PARTITION : (p + 1) * PARTITION]) / w.sum(1)[:, None]
        for p in range(parts, width):
            j = junk[(p + s) % len(junk)]
            exp_sums[s, :, p], max_logits[s, :, p], tmp_out[s, :, p] = j, j, j
    return exp_sums, max_logits, tmp_out, seq_lens, torch.stack(want).float()


def test_v2_reduce_merges_partitions_by_their_rescaled_exp_sums():
    exp_sums, max_logits, tmp_out, lens, want = _reduce_case(
        2, [3, 1, 2, 4, 2], [100.0, 100.0, 100.0, 100.0, -60.0]
    )
    out = torch.full((len(lens), 3, 16), NAN)
    lab.paged_attention_v2_reduce(
        out, exp_sums, max_logits, tmp_out, torch.tensor(lens, dtype=torch.int32)
    )
    check_attention(
        out,
        want,
        seq_lens=lens,
        block_size=PARTITION,
        dtype=torch.float32,
        what="paged_attention_v2_reduce (partitions of 3, 1, 2, 4 and 2 per sequence; maxima "
        "near 100 to 112, and near -60 for the last sequence; NaN, inf and 1e30 in the "
        "partitions past each sequence's own)",
        atol=1e-4,
        rtol=1e-4,
    )


def test_v2_reduce_of_one_partition_is_that_partition():
    exp_sums, max_logits, tmp_out, lens, want = _reduce_case(5, [1, 1], [-50.0, 30.0])
    out = torch.full((2, 3, 16), NAN)
    lab.paged_attention_v2_reduce(
        out, exp_sums, max_logits, tmp_out, torch.tensor(lens, dtype=torch.int32)
    )
    assert_close(out, tmp_out[:, :, 0], atol=1e-5, rtol=1e-5,
                 msg="one partition: out must be its tmp_out, whatever its exp sum and max")


@pytest.mark.parametrize("case", ROTATING_GRID, ids=grid_id)
def test_v2_one_partition_matches_reference(case):
    head, block, heads, alibi, dtype = case
    rng = random.Random(zlib.crc32(grid_id(case).encode()) + 1)
    batch = Batch(
        seed=rng.randint(0, 10**6),
        seq_lens=short_lens(rng, block),
        num_heads=heads,
        head_size=head,
        block_size=block,
        dtype=dtype,
        alibi=alibi,
    )
    batch.check(batch.run_v2(), f"v2 {grid_id(case)}")


@pytest.mark.parametrize("case", ROTATING_GRID, ids=grid_id)
def test_v2_several_partitions_matches_reference_and_v1(case):
    head, block, heads, alibi, dtype = case
    rng = random.Random(zlib.crc32(grid_id(case).encode()) + 2)
    lens = [rng.randint(PARTITION + 1, PARTITION + 160), rng.randint(2, 200)]
    batch = Batch(
        seed=rng.randint(0, 10**6),
        seq_lens=lens,
        num_heads=heads,
        head_size=head,
        block_size=block,
        dtype=dtype,
        alibi=alibi,
    )
    v2 = batch.run_v2()
    batch.check(v2, f"v2 {grid_id(case)}")
    check_attention(v2, batch.run_v1(), seq_lens=lens, block_size=block, dtype=dtype,
                    what=f"v2 vs your v1 {grid_id(case)}", alibi=alibi)


def _check_partition(what, got, want, s, p, dtype=torch.float32):
    assert_close(got, want, dtype=dtype, msg=f"{what} of sequence {s}, partition {p} (per head)")


def test_v2_partition_buffers_hold_max_exp_sum_and_partial_output():
    batch = Batch(
        seed=12,
        seq_lens=[1300, 700, 40],
        num_heads=(8, 4),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=True,
    )
    # Two partitions more than max_seq_len needs: those must be filled too.
    exp_sums, max_logits, tmp_out = batch.v2_buffers(extra_partitions=2)  # 5 partitions
    out = batch.run_v2((exp_sums, max_logits, tmp_out))
    batch.check(out, "v2 with buffers two partitions wider than needed")
    for s, seq_len in enumerate(batch.seq_lens_list):
        logits = batch.logits(s)
        values = batch.values[s].float().repeat_interleave(2, dim=1)  # [T, H, D]
        used = -(-seq_len // PARTITION)
        for p in range(used):
            part = logits[:, p * PARTITION : (p + 1) * PARTITION]
            m = part.amax(dim=1)
            w = torch.exp(part - m[:, None])
            v = values[p * PARTITION : (p + 1) * PARTITION]
            _check_partition("max_logits (the partition's largest logit, ALiBi included)",
                             max_logits[s, :, p], m, s, p)
            _check_partition("exp_sums (sum of exp(logit - the partition's max))",
                             exp_sums[s, :, p], w.sum(dim=1), s, p)
            _check_partition("tmp_out (the partition's own softmax-weighted values)",
                             tmp_out[s, :, p], torch.einsum("ht,thd->hd", w, v) / w.sum(1)[:, None],
                             s, p)
        for p in range(used, exp_sums.shape[2]):
            where = (
                f"sequence {s} (seq_len {seq_len}, {used} partition(s)), partition {p} of the "
                f"{exp_sums.shape[2]} in the buffers"
            )
            assert (exp_sums[s, :, p] == 0).all(), f"{where}: exp_sums must be 0, not NaN/junk"
            assert torch.isneginf(max_logits[s, :, p]).all(), f"{where}: max_logits must be -inf"
            assert (tmp_out[s, :, p] == 0).all(), f"{where}: tmp_out must be 0"


def test_v2_ignores_nan_in_stale_slots_padding_and_buffers():
    batch = Batch(
        seed=13,
        seq_lens=[600, 1, 37, 1030],
        num_heads=(4, 2),
        head_size=32,
        block_size=32,
        dtype=torch.float32,
        alibi=True,
        junk="nan",
        max_seq_len=1100,
    )
    batch.check(batch.run_v2(), "v2 over a cache whose unused slots hold NaN, NaN-filled buffers")


def test_v2_uses_scale_and_defaults():
    batch = Batch(
        seed=14,
        seq_lens=[700, 24],
        num_heads=(4, 2),
        head_size=64,
        block_size=8,
        dtype=torch.float32,
        alibi=False,
        scale=0.37,
        max_seq_len=1500,
    )
    exp_sums, max_logits, tmp_out = batch.v2_buffers()
    out = torch.full_like(batch.query, NAN)
    lab.paged_attention_v2(
        out,
        exp_sums,
        max_logits,
        tmp_out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.num_kv_heads,
        batch.scale,
        batch.block_tables,
        batch.seq_lens,
        batch.block_size,
        batch.max_seq_len,
    )
    batch.check(out, "v2 with scale 0.37, alibi_slopes left out and max_seq_len 1500")


def test_v2_rejects_bad_input_and_writes_nothing():
    batch = _reject_batch()
    for what, override in _bad_decode_calls(batch):
        out = torch.full_like(batch.query, 7.0)
        bufs = [torch.full_like(t, 7.0) for t in batch.v2_buffers()]
        args = _decode_kwargs(batch, override)
        _assert_rejected(
            f"v2, {what}",
            lambda a=args, b=bufs, o=out: lab.paged_attention_v2(o, *b, **a),
            out,
            *bufs,
        )


def test_v2_rejects_too_small_buffers_and_block_sizes_that_do_not_divide_512():
    batch = Batch(
        seed=9,
        seq_lens=[600, 20],
        num_heads=(4, 4),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=False,
    )
    good = batch.v2_buffers()  # 2 partitions
    for i, name in enumerate(("exp_sums", "max_logits", "tmp_out")):
        bufs = [t.clone() for t in good]
        bufs[i] = bufs[i][:, :, :1].clone()
        out = torch.full_like(batch.query, 7.0)
        _assert_rejected(
            f"v2 with {name} of 1 partition for max_seq_len {batch.max_seq_len}",
            lambda b=bufs, o=out: lab.paged_attention_v2(o, *b, *batch.args()),
            out,
            *bufs,
        )
    half = [good[0], good[1], good[2].half()]
    out = torch.full_like(batch.query, 7.0)
    _assert_rejected(
        "v2 with a float16 tmp_out for float32 queries",
        lambda: lab.paged_attention_v2(out, *half, *batch.args()),
        out,
    )
    odd = Batch(
        seed=10,
        seq_lens=[50, 20],
        num_heads=(4, 4),
        head_size=64,
        block_size=24,  # 512 % 24 != 0: a partition would end inside a block
        dtype=torch.float32,
        alibi=False,
    )
    bufs = odd.v2_buffers()
    out = torch.full_like(odd.query, 7.0)
    _assert_rejected(
        "v2 with block size 24, which does not divide 512",
        lambda: lab.paged_attention_v2(out, *bufs, *odd.args()),
        out,
    )


# ------------------------------------------------------------------------------------------
# Task 5: the v1/v2 choice
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_seq_len, num_seqs, num_heads, v1",
    [
        (1, 1, 1, True),
        (512, 1, 8, True),  # one partition: a reduce would be pure overhead
        (513, 1, 8, False),  # two partitions and little parallel work
        (513, 16, 32, False),  # 512 (seq, head) pairs is not "more than 512"
        (513, 17, 32, True),
        (513, 1, 513, True),
        (8192, 64, 32, True),
        (8192, 1, 8, False),
        (8193, 64, 32, False),  # past 8192 tokens v1's logits would not fit in shared memory
        (8193, 1, 1, False),
    ],
)
def test_choice_rule_of_v0_11_0(max_seq_len, num_seqs, num_heads, v1):
    got = lab.use_v1(max_seq_len, num_seqs, num_heads)
    assert got is v1, (
        f"use_v1(max_seq_len={max_seq_len}, num_seqs={num_seqs}, num_heads={num_heads}) must be "
        f"{v1} (a bool), got {got!r}"
    )


@pytest.mark.parametrize("lens, heads", [([100, 7], (8, 2)), ([900, 7], (8, 2))])
def test_forward_decode_matches_reference(lens, heads):
    batch = Batch(
        seed=21,
        seq_lens=lens,
        num_heads=heads,
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=True,
    )
    out = lab.forward_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.max_seq_len,
        batch.num_kv_heads,
        batch.scale,
        batch.alibi_slopes,
    )
    batch.check(out, f"forward_decode with contexts {lens}")


# ------------------------------------------------------------------------------------------
# Task 6: copy_blocks and swap_blocks
# ------------------------------------------------------------------------------------------


def _layers(num_layers=2, num_blocks=10, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = x_of(dtype)
    keys = [
        torch.randn(num_blocks, 2, 32 // x, 8, x, generator=gen).to(dtype)
        for _ in range(num_layers)
    ]
    values = [torch.randn(num_blocks, 2, 32, 8, generator=gen).to(dtype) for _ in range(num_layers)]
    return keys, values


def _check_blocks(name, got, want):
    wrong = (got != want).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert not wrong, f"{name}: blocks {wrong} differ from what the mapping asks for"


def test_copy_blocks_copies_every_layer():
    keys, values = _layers()
    mapping = torch.tensor([[1, 5], [2, 7], [1, 9]], dtype=torch.int64)
    expect = []
    for cache in keys + values:
        e = cache.clone()
        for src, dst in mapping.tolist():
            e[dst] = cache[src]
        expect.append(e)
    lab.copy_blocks(keys, values, mapping)
    names = [f"key cache of layer {i}" for i in range(len(keys))]
    names += [f"value cache of layer {i}" for i in range(len(values))]
    for name, got, want in zip(names, keys + values, expect):
        _check_blocks(f"copy_blocks [[1, 5], [2, 7], [1, 9]], {name}", got, want)


def test_copy_and_swap_with_an_empty_mapping_change_nothing():
    # One row first, which must be copied; then no rows, which must leave everything as it is.
    keys, values = _layers()
    lab.copy_blocks(keys, values, torch.tensor([[1, 5]], dtype=torch.int64))
    for i, cache in enumerate(keys + values):
        assert torch.equal(cache[5], cache[1]), (
            f"copy_blocks [[1, 5]] did not copy block 1 to block 5 in cache {i}")
    before = [t.clone() for t in keys + values]
    lab.copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64))
    for got, want in zip(keys + values, before):
        assert torch.equal(got, want), "copy_blocks with no rows changed a cache"
    dst = torch.zeros(4, *keys[0].shape[1:], dtype=keys[0].dtype)
    lab.swap_blocks(keys[0], dst, torch.tensor([[0, 2]], dtype=torch.int64))
    assert torch.equal(dst[2], keys[0][0]), "swap_blocks [[0, 2]] did not copy block 0 to block 2"
    before = dst.clone()
    lab.swap_blocks(keys[0], dst, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(dst, before), "swap_blocks with no rows changed the destination"


def test_copy_blocks_rejects_bad_mappings_and_writes_nothing():
    keys, values = _layers()
    caches = keys + values
    for what, mapping in [
        ("one destination twice", torch.tensor([[1, 5], [2, 5]], dtype=torch.int64)),
        ("a destination beyond the cache", torch.tensor([[1, 5], [2, 10]], dtype=torch.int64)),
        ("a negative source", torch.tensor([[-1, 5]], dtype=torch.int64)),
        ("block 5 both written and read", torch.tensor([[1, 5], [5, 6]], dtype=torch.int64)),
        ("an int32 mapping", torch.tensor([[1, 5]], dtype=torch.int32)),
        ("a 1-D mapping", torch.tensor([1, 5], dtype=torch.int64)),
    ]:
        _assert_rejected(
            f"copy_blocks with {what}", lambda m=mapping: lab.copy_blocks(keys, values, m), *caches
        )
    _assert_rejected(
        "copy_blocks with 2 key caches and 1 value cache",
        lambda: lab.copy_blocks(keys, values[:1], torch.tensor([[1, 5]])),
        *caches,
    )


def test_swap_blocks_between_pools():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=1)
    gpu_like = keys[0]
    cpu_pool = torch.zeros(4, *gpu_like.shape[1:], dtype=gpu_like.dtype)
    src_before = gpu_like.clone()
    lab.swap_blocks(gpu_like, cpu_pool, torch.tensor([[5, 0], [2, 3]], dtype=torch.int64))
    want = torch.zeros_like(cpu_pool)
    want[0], want[3] = src_before[5], src_before[2]
    _check_blocks("swap_blocks out [[5, 0], [2, 3]], destination pool", cpu_pool, want)
    assert torch.equal(gpu_like, src_before), "swap_blocks changed its source"
    # ... and back in, to other blocks.
    back = torch.zeros_like(gpu_like)
    lab.swap_blocks(cpu_pool, back, torch.tensor([[3, 1], [0, 4]], dtype=torch.int64))
    want = torch.zeros_like(back)
    want[1], want[4] = src_before[2], src_before[5]
    _check_blocks("swap_blocks in [[3, 1], [0, 4]], destination pool", back, want)


def test_copy_and_swap_a_single_block():
    keys, values = _layers(num_layers=1, num_blocks=6, seed=4)
    want = [t.clone() for t in keys + values]
    for t in want:
        t[2] = t[4]
    lab.copy_blocks(keys, values, torch.tensor([[4, 2]], dtype=torch.int64))
    for name, got, w in zip(("key cache", "value cache"), keys + values, want):
        _check_blocks(f"copy_blocks [[4, 2]], {name}", got, w)
    dst = torch.zeros(3, *keys[0].shape[1:], dtype=keys[0].dtype)
    lab.swap_blocks(keys[0], dst, torch.tensor([[5, 1]], dtype=torch.int64))
    want = torch.zeros_like(dst)
    want[1] = keys[0][5]
    _check_blocks("swap_blocks [[5, 1]], destination pool", dst, want)


def test_swap_blocks_rejects_bad_input_and_writes_nothing():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=2)
    src = keys[0]
    dst = torch.zeros(4, *src.shape[1:], dtype=src.dtype)
    ok = torch.tensor([[0, 0]], dtype=torch.int64)
    for what, call in [
        ("a destination beyond the pool",
         lambda: lab.swap_blocks(src, dst, torch.tensor([[0, 4]]))),
        ("a source beyond the pool", lambda: lab.swap_blocks(src, dst, torch.tensor([[6, 0]]))),
        ("one destination twice",
         lambda: lab.swap_blocks(src, dst, torch.tensor([[0, 1], [2, 1]]))),
        ("pools of different dtypes", lambda: lab.swap_blocks(src, dst.float(), ok)),
        ("pools of different block shapes",
         lambda: lab.swap_blocks(src, dst[:, :1].contiguous(), ok)),
    ]:
        _assert_rejected(f"swap_blocks with {what}", call, src, dst)


@pytest.mark.cuda
def test_swap_blocks_gpu_to_cpu_and_back():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=3)
    gpu = keys[0].cuda()
    cpu = torch.zeros(3, *gpu.shape[1:], dtype=gpu.dtype)
    lab.swap_blocks(gpu, cpu, torch.tensor([[4, 2]], dtype=torch.int64))
    assert torch.equal(cpu[2], keys[0][4]), (
        "swap_blocks [[4, 2]] from GPU to CPU: CPU block 2 should be a copy of GPU block 4"
    )
    again = torch.zeros_like(gpu)
    lab.swap_blocks(cpu, again, torch.tensor([[2, 0]], dtype=torch.int64))
    assert torch.equal(again[0].cpu(), keys[0][4]), (
        "swap_blocks [[2, 0]] from CPU back to GPU: GPU block 0 should be a copy of CPU block 2"
    )


# ------------------------------------------------------------------------------------------
# Task 7 (extension): the FP8 KV cache
# ------------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_of(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The test's own quantization: e4m3 of x / scale, clamped to +-448 first."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def magnitudes(n: int, scale: float, seed: int) -> torch.Tensor:
    """Both signs, |x / scale| from 2**-12 (subnormal) to 448, log-uniform."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n).uniform_(-12.0, math.log2(FP8_MAX), generator=g)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return signs * torch.exp2(exps) * scale


@pytest.mark.parametrize("scale", [1.0, 0.02, 5.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_quant_rounds_to_e4m3_within_half_a_step(scale, dtype):
    x = magnitudes(3000, scale, seed=1).to(dtype)
    q = lab.scaled_fp8_quant(x, scale)
    assert isinstance(q, torch.Tensor) and q.dtype == E4M3, (
        f"scaled_fp8_quant must return torch.float8_e4m3fn (e4m3: 3 mantissa bits, max 448), "
        f"got {getattr(q, 'dtype', type(q).__name__)}"
    )
    assert q.shape == x.shape, (
        f"scaled_fp8_quant must keep x's shape {tuple(x.shape)}, got {tuple(q.shape)}"
    )
    back = q.float() * scale
    err = (back - x.float()).abs()
    normal = x.float().abs() >= 2.0**-6 * scale
    rel = float((err[normal] / x.float().abs()[normal]).max())
    assert rel <= 2.0**-4 * (1 + 1e-6), (
        f"largest relative error {rel:.4g} in e4m3's normal range; rounding to the nearest of 8 "
        f"mantissa steps gives at most 2**-4 = 0.0625 (is the format e4m3, and is x divided "
        f"by the scale before the cast?)"
    )
    assert float(err[~normal].max()) <= 2.0**-10 * scale * (1 + 1e-6), (
        f"largest absolute error {float(err[~normal].max()):.4g} below e4m3's normal range "
        f"(|x / scale| < 2**-6); the nearest e4m3 value is within 2**-10 * scale = "
        f"{2.0**-10 * scale:.4g}"
    )
    assert torch.equal(bytes_of(q), bytes_of(fp8_of(x, scale))), "not the nearest e4m3 value"


@pytest.mark.parametrize("scale", [2.0, 0.25])
def test_fp8_quant_saturates_at_448_times_the_scale(scale):
    x = torch.tensor([416.0, 448.0, 480.0, 1000.0, math.inf]) * scale
    x = torch.cat([x, -x])
    got = lab.scaled_fp8_quant(x, scale).float()
    want = torch.tensor([416.0, 448.0, 448.0, 448.0, 448.0])
    assert_close(got, torch.cat([want, -want]), atol=0, rtol=0,
                 msg=f"stored values of x = [416, 448, 480, 1000, inf] * {scale} (the clamp "
                 "applies to x / scale, so a value saturates at 448 * scale, not at 448): ")
    assert torch.isnan(lab.scaled_fp8_quant(torch.tensor([NAN]), scale).float()).all(), (
        f"scaled_fp8_quant(NaN) must stay NaN, "
        f"got {lab.scaled_fp8_quant(torch.tensor([NAN]), scale).float().tolist()}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_dequant_multiplies_by_the_scale(dtype):
    grid = bytes_of(torch.arange(256, dtype=torch.uint8)).view(E4M3)
    grid = grid[torch.isfinite(grid.float())]
    for scale in (1.0, 0.0137, 3.0):
        got = lab.scaled_fp8_dequant(grid, scale, dtype)
        assert got.dtype == dtype and got.shape == grid.shape, (
            f"scaled_fp8_dequant(q, {scale}, {dtype}) must return {dtype} of q's shape "
            f"{tuple(grid.shape)}, got {got.dtype} {tuple(got.shape)}"
        )
        assert_close(got, (grid.float() * scale).to(dtype), atol=0, rtol=0,
                     msg=f"scale {scale}: ")


def _fp8_caches(num_blocks, kvh, head, block_size):
    key_cache = torch.zeros(num_blocks, kvh, head // 16, block_size, 16, dtype=E4M3)
    value_cache = torch.zeros(num_blocks, kvh, head, block_size, dtype=E4M3)
    bytes_of(key_cache).fill_(0x7F)  # e4m3fn's NaN: junk wherever nothing was written
    bytes_of(value_cache).fill_(0x7F)
    return key_cache, value_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_fp8_stores_the_scaled_e4m3_bytes(dtype):
    g = torch.Generator().manual_seed(2)
    kvh, head, bs = 2, 32, 8
    key_cache, value_cache = _fp8_caches(6, kvh, head, bs)
    key = (torch.randn(5, kvh, head, generator=g) * 4).to(dtype)
    value = (torch.randn(5, kvh, head, generator=g) * 0.3).to(dtype)
    slots = torch.tensor([9, -1, 40, 8, 23])
    k_scale, v_scale = 0.03, 0.002
    k_before, v_before = bytes_of(key_cache).clone(), bytes_of(value_cache).clone()
    lab.reshape_and_cache(key, value, key_cache, value_cache, slots, "fp8", k_scale, v_scale)
    want_k, want_v = k_before.clone(), v_before.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            b, o = divmod(s, bs)
            want_k[b, :, :, o, :] = bytes_of(fp8_of(key[i], k_scale)).reshape(kvh, head // 16, 16)
            want_v[b, :, :, o] = bytes_of(fp8_of(value[i], v_scale))
    assert torch.equal(bytes_of(key_cache), want_k), (
        "key cache bytes differ from e4m3(key / k_scale) at the slots (or changed elsewhere)")
    assert torch.equal(bytes_of(value_cache), want_v), (
        "value cache bytes differ from e4m3(value / v_scale) at the slots (or changed elsewhere)")


def _fp8_batch(seq_lens, dtype, seed, kvh=2, heads=4, head=32, bs=16):
    """An fp8 cache written by the test, and the expected outputs: lab 01's reference on the
    values the cache stands for (the test's own dequantization)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 2
    key_cache, value_cache = _fp8_caches(num_blocks, kvh, head, bs)
    tables = _tables(seq_lens, bs, num_blocks, seed)
    k_scale, v_scale = 0.011, 0.0037
    query = torch.randn(len(seq_lens), heads, head, generator=g).to(dtype)
    want = []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, kvh, head, generator=g) * 2
        v = torch.randn(n, kvh, head, generator=g) * 0.5
        qk, qv = fp8_of(k, k_scale), fp8_of(v, v_scale)
        pos = torch.arange(n)
        blocks = tables[s].long()[pos // bs]
        write_tokens(key_cache, value_cache, blocks, pos % bs, qk, qv)
        want.append(ref_attention(query[s : s + 1].float(), qk.float() * k_scale,
                                  qv.float() * v_scale, scale=0.2)[0])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (query, key_cache, value_cache, kvh, 0.2, tables, lens, bs, max(seq_lens), None,
            "fp8", k_scale, v_scale)
    return args, torch.stack(want)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_paged_attention_on_an_fp8_cache_dequantizes_on_read(version, dtype):
    seq_lens = [1, 37, 600]  # 600: two v2 partitions
    args, want = _fp8_batch(seq_lens, dtype, seed=4)
    out = torch.full_like(args[0], NAN)
    if version == "v1":
        lab.paged_attention_v1(out, *args)
    else:
        parts = -(-max(seq_lens) // PARTITION)
        shape = (len(seq_lens), args[0].shape[1], parts)
        lab.paged_attention_v2(out, torch.full(shape, NAN), torch.full(shape, NAN),
                               torch.full((*shape, args[0].shape[2]), NAN, dtype=dtype),
                               *args)
    check_attention(out, want.to(dtype), seq_lens=seq_lens, block_size=16, dtype=dtype,
                    what=f"{version} on an fp8 cache (keys read as stored * k_scale, values as "
                    "stored * v_scale)")


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf])
def test_fp8_bad_scales_and_dtype_mixups_are_refused_before_writing(bad):
    key_cache, value_cache = _fp8_caches(4, 1, 16, 4)
    f32_k, f32_v = torch.zeros(4, 1, 4, 4, 4), torch.zeros(4, 1, 16, 4)
    key = value = torch.randn(2, 1, 16)
    slots = torch.tensor([4, 5])
    query, out = torch.randn(1, 2, 16), torch.full((1, 2, 16), 7.0)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    v2_bufs = (torch.full((1, 2, 1), 7.0), torch.full((1, 2, 1), 7.0),
               torch.full((1, 2, 1, 16), 7.0))
    before = bytes_of(key_cache).clone(), bytes_of(value_cache).clone()
    calls = {
        f"k_scale={bad}": lambda: lab.reshape_and_cache(key, value, key_cache, value_cache,
                                                        slots, "fp8", bad, 1.0),
        f"v_scale={bad}": lambda: lab.reshape_and_cache(key, value, key_cache, value_cache,
                                                        slots, "fp8", 1.0, bad),
        "an fp8 cache with kv_cache_dtype='auto'": lambda: lab.reshape_and_cache(
            key, value, key_cache, value_cache, slots),
        "a float32 cache with kv_cache_dtype='fp8'": lambda: lab.reshape_and_cache(
            key, value, f32_k, f32_v, slots, "fp8", 1.0, 1.0),
        f"v1 with k_scale={bad}": lambda: lab.paged_attention_v1(
            out, query, key_cache, value_cache, 1, 0.25, tables, lens, 4, 4, None, "fp8",
            bad, 1.0),
        f"v1 with v_scale={bad}": lambda: lab.paged_attention_v1(
            out, query, key_cache, value_cache, 1, 0.25, tables, lens, 4, 4, None, "fp8",
            1.0, bad),
        f"v2 with k_scale={bad}": lambda: lab.paged_attention_v2(
            out, *v2_bufs, query, key_cache, value_cache, 1, 0.25, tables, lens, 4, 4, None,
            "fp8", bad, 1.0),
        f"v2 with v_scale={bad}": lambda: lab.paged_attention_v2(
            out, *v2_bufs, query, key_cache, value_cache, 1, 0.25, tables, lens, 4, 4, None,
            "fp8", 1.0, bad),
        "v1 on an fp8 cache with kv_cache_dtype='auto'": lambda: lab.paged_attention_v1(
            out, query, key_cache, value_cache, 1, 0.25, tables, lens, 4, 4),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError):
            call()
        assert torch.equal(bytes_of(key_cache), before[0]), f"{what}: wrote the key cache"
        assert torch.equal(bytes_of(value_cache), before[1]), f"{what}: wrote the value cache"
        assert (f32_k == 0).all() and (f32_v == 0).all(), f"{what}: wrote the float32 cache"
        assert (out == 7.0).all(), f"{what}: wrote out"
        assert all((b == 7.0).all() for b in v2_bufs), f"{what}: wrote v2's buffers"


def test_fp8_scales_default_to_one():
    """Upstream's layers start with k_scale = v_scale = 1.0: left out, the scales are 1."""
    g = torch.Generator().manual_seed(5)
    kvh, head, bs = 2, 32, 8
    key = torch.randn(4, kvh, head, generator=g) * 3
    value = torch.randn(4, kvh, head, generator=g) * 3
    slots = torch.tensor([3, 12, -1, 30])
    default, explicit = _fp8_caches(5, kvh, head, bs), _fp8_caches(5, kvh, head, bs)
    lab.reshape_and_cache(key, value, *default, slots, "fp8")
    lab.reshape_and_cache(key, value, *explicit, slots, "fp8", 1.0, 1.0)
    for name, got, want in zip(("key", "value"), default, explicit):
        assert torch.equal(bytes_of(got), bytes_of(want)), (
            f"reshape_and_cache(..., 'fp8') without scales: the {name} cache differs from "
            f"scale 1.0 (the default of k_scale and v_scale is 1.0)")
    args, _ = _fp8_batch([7, 20], torch.float32, seed=6)
    for version in ("v1", "v2"):
        outs = []
        for scales in ((), (1.0, 1.0)):
            out = torch.full_like(args[0], NAN)
            if version == "v1":
                lab.paged_attention_v1(out, *args[:-2], *scales)
            else:
                shape = (2, args[0].shape[1], 1)
                lab.paged_attention_v2(out, torch.full(shape, NAN), torch.full(shape, NAN),
                                       torch.full((*shape, args[0].shape[2]), NAN),
                                       *args[:-2], *scales)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (
            f"{version} on an fp8 cache without scales differs from k_scale = v_scale = 1.0 "
            f"(their default)")


def test_fp8_cache_x_is_16():
    """One byte per element: a 16-byte vector of the fp8 key cache holds 16 of them."""
    assert lab.kv_cache_x(E4M3) == 16, (
        "kv_cache_x(torch.float8_e4m3fn) must be 16 (16 bytes of 1-byte elements)")
