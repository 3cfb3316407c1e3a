"""Graded tests for lab 02-04: PagedAttention in PyTorch.

The expected outputs never come from the lab's own code: caches are filled with random data,
each sequence's keys and values are read back with index arithmetic written here, and the
attention is computed by lab 01's reference (``mini_vllm.attention.reference.ref_attention``).
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

from course.loader import load_lab
from course.numerics import assert_close
from mini_vllm.attention.reference import ref_attention

lab = load_lab(__file__)

HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [8, 16, 32]
NUM_HEADS = [(40, 40), (64, 8)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PARTITION = 512


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


def read_sequence(key_cache, value_cache, table_row, seq_len):
    """Keys and values ``[seq_len, num_kv_heads, head_size]`` of one sequence.

    Token ``t`` is in block ``table_row[t // block_size]`` at offset ``t % block_size``; its key
    is the ``head_size // x`` chunks of ``x`` elements at that offset, concatenated.
    """
    num_blocks, num_kv_heads, chunks, block_size, x = key_cache.shape
    pos = torch.arange(seq_len)
    blocks = table_row.long()[pos // block_size]
    offsets = pos % block_size
    keys = key_cache[blocks, :, :, offsets, :]  # [seq_len, kv_heads, chunks, x]
    values = value_cache[blocks, :, :, offsets]  # [seq_len, kv_heads, head_size]
    return keys.reshape(seq_len, num_kv_heads, chunks * x), values


class Batch:
    """A random decode batch over random caches; every sequence gets its own physical blocks."""

    def __init__(
        self, *, seed, seq_lens, num_heads, head_size, block_size, dtype, alibi, spare_blocks=3
    ):
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads = num_heads
        self.head_size, self.block_size, self.dtype = head_size, block_size, dtype
        self.seq_lens_list = list(seq_lens)
        self.max_seq_len = max(seq_lens)
        num_seqs = len(seq_lens)
        self.blocks_per_seq = -(-self.max_seq_len // block_size)
        num_blocks = num_seqs * self.blocks_per_seq + spare_blocks
        x = x_of(dtype)
        kvh = self.num_kv_heads
        self.key_cache = torch.randn(
            num_blocks, kvh, head_size // x, block_size, x, generator=gen
        ).to(dtype)
        self.value_cache = torch.randn(num_blocks, kvh, head_size, block_size, generator=gen).to(
            dtype
        )
        perm = torch.randperm(num_blocks, generator=gen)[: num_seqs * self.blocks_per_seq]
        self.block_tables = perm.view(num_seqs, self.blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query = torch.randn(num_seqs, self.num_heads, head_size, generator=gen).to(dtype)
        self.scale = head_size**-0.5
        self.alibi_slopes = (
            torch.randn(self.num_heads, generator=gen).abs() * 0.2 if alibi else None
        )

    def expected(self) -> torch.Tensor:
        outs = []
        for s, seq_len in enumerate(self.seq_lens_list):
            k, v = read_sequence(self.key_cache, self.value_cache, self.block_tables[s], seq_len)
            outs.append(
                ref_attention(
                    self.query[s : s + 1], k, v, scale=self.scale, alibi_slopes=self.alibi_slopes
                )[0]
            )
        return torch.stack(outs)

    def logits(self, s: int) -> torch.Tensor:
        """fp32 logits ``[num_heads, seq_len]`` of sequence ``s`` (for checking v2's buffers)."""
        seq_len = self.seq_lens_list[s]
        k, _ = read_sequence(self.key_cache, self.value_cache, self.block_tables[s], seq_len)
        group = self.num_heads // self.num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)  # [T, H, D]
        logits = torch.einsum("hd,thd->ht", self.query[s].float(), k) * self.scale
        if self.alibi_slopes is not None:
            dist = torch.arange(seq_len) - (seq_len - 1)
            logits = logits + self.alibi_slopes[:, None] * dist[None, :]
        return logits

    def run_v1(self, out=None):
        out = torch.full_like(self.query, float("nan")) if out is None else out
        lab.paged_attention_v1(
            out,
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
        return out

    def v2_buffers(self, extra_partitions=0):
        num_seqs = len(self.seq_lens_list)
        parts = -(-self.max_seq_len // PARTITION) + extra_partitions
        shape = (num_seqs, self.num_heads, parts)
        return (
            torch.full(shape, float("nan")),
            torch.full(shape, float("nan")),
            torch.full((*shape, self.head_size), float("nan"), dtype=self.dtype),
        )

    def run_v2(self, buffers=None):
        exp_sums, max_logits, tmp_out = self.v2_buffers() if buffers is None else buffers
        out = torch.full_like(self.query, float("nan"))
        lab.paged_attention_v2(
            out,
            exp_sums,
            max_logits,
            tmp_out,
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
        return out


def short_lens(rng: random.Random, block_size: int, num_seqs: int = 3) -> list[int]:
    """Context lengths with a one-token sequence, an exact multiple of the block size and a
    partial last block, so masking at block boundaries is exercised in every case."""
    lens = [1, block_size * rng.randint(1, 2), block_size * rng.randint(1, 2) + rng.randint(1, 7)]
    return lens[:num_seqs]


SHORT_GRID = list(itertools.product(HEAD_SIZES, BLOCK_SIZES, NUM_HEADS, [False, True], DTYPES))


def grid_id(case) -> str:
    head, block, heads, alibi, dtype = case
    return f"d{head}-b{block}-h{heads[0]}x{heads[1]}-{'alibi' if alibi else 'noalibi'}-" + str(
        dtype
    ).removeprefix("torch.")


# ------------------------------------------------------------------------------------------
# Task 1: layouts
# ------------------------------------------------------------------------------------------


def test_x_is_one_16_byte_vector():
    assert lab.kv_cache_x(torch.float32) == 4
    assert lab.kv_cache_x(torch.float16) == 8
    assert lab.kv_cache_x(torch.bfloat16) == 8
    with pytest.raises(ValueError):
        lab.kv_cache_x(torch.int64)


def test_split_kv_cache_views_the_combined_tensor():
    shape = lab.get_kv_cache_shape(5, 16, 4, 64)
    assert tuple(shape) == (2, 5, 16 * 4 * 64)
    kv = torch.zeros(shape, dtype=torch.float16)
    key_cache, value_cache = lab.split_kv_cache(kv, 4, 64)
    assert tuple(key_cache.shape) == (5, 4, 64 // 8, 16, 8)
    assert tuple(value_cache.shape) == (5, 4, 64, 16)
    # Views, not copies: a write lands in the combined tensor, keys in half 0, values in half 1.
    key_cache[3, 2, 1, 5, 7] = 1.0
    value_cache[4, 1, 9, 15] = 2.0
    assert kv[0, 3, ((2 * 8 + 1) * 16 + 5) * 8 + 7] == 1.0
    assert kv[1, 4, (1 * 64 + 9) * 16 + 15] == 2.0
    assert int((kv != 0).sum()) == 2


def test_layout_helpers_reject_bad_shapes():
    with pytest.raises(ValueError):
        lab.get_kv_cache_shape(0, 16, 4, 64)
    with pytest.raises(ValueError):
        lab.split_kv_cache(torch.zeros(3, 5, 16 * 4 * 64), 4, 64)  # leading dim must be 2
    with pytest.raises(ValueError):
        lab.split_kv_cache(torch.zeros(2, 5, 16 * 4 * 60, dtype=torch.float16), 4, 60)  # 60 % 8


# ------------------------------------------------------------------------------------------
# Task 2: reshape_and_cache
# ------------------------------------------------------------------------------------------


def _slot_case(dtype, block_size, seed, num_tokens=23, num_blocks=9, kvh=3, head=32):
    gen = torch.Generator().manual_seed(seed)
    x = x_of(dtype)
    key = torch.randn(num_tokens, kvh, head, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kvh, head, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    key_cache = torch.randn(num_blocks, kvh, head // x, block_size, x, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kvh, head, block_size, generator=gen).to(dtype)
    return key, value, key_cache, value_cache, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_writes_the_x_split_layout(dtype, block_size):
    key, value, key_cache, value_cache, slots = _slot_case(dtype, block_size, seed=block_size)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    lab.reshape_and_cache(key, value, key_cache, value_cache, slots)

    real = slots >= 0
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    _, kvh, head = key.shape
    k_idx = key_flat_index(blocks, offsets, kvh, head, block_size, x_of(dtype))
    v_idx = value_flat_index(blocks, offsets, kvh, head, block_size)
    assert torch.equal(key_cache.reshape(-1)[k_idx], key[real]), "key element misplaced"
    assert torch.equal(value_cache.reshape(-1)[v_idx], value[real]), "value element misplaced"
    # Nothing else moved: padding tokens (slot -1) and all other slots keep their old contents.
    k_touched = torch.zeros(key_cache.numel(), dtype=torch.bool)
    k_touched[k_idx.reshape(-1)] = True
    v_touched = torch.zeros(value_cache.numel(), dtype=torch.bool)
    v_touched[v_idx.reshape(-1)] = True
    assert torch.equal(key_cache.reshape(-1)[~k_touched], k_before.reshape(-1)[~k_touched])
    assert torch.equal(value_cache.reshape(-1)[~v_touched], v_before.reshape(-1)[~v_touched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_flash_round_trip(dtype):
    block_size, num_blocks, kvh, head = 16, 7, 2, 64
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(30, kvh, head, generator=gen).to(dtype)
    value = torch.randn(30, kvh, head, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:30]
    slots[[0, 7, 29]] = -1
    key_cache = torch.randn(num_blocks, block_size, kvh, head, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kvh, head, generator=gen).to(dtype)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    lab.reshape_and_cache_flash(key, value, key_cache, value_cache, slots)

    flat_k = key_cache.reshape(num_blocks * block_size, kvh, head)
    flat_v = value_cache.reshape(num_blocks * block_size, kvh, head)
    real = slots >= 0
    assert torch.equal(flat_k[slots[real]], key[real])
    assert torch.equal(flat_v[slots[real]], value[real])
    others = torch.ones(num_blocks * block_size, dtype=torch.bool)
    others[slots[real]] = False
    assert torch.equal(flat_k[others], k_before.reshape_as(flat_k)[others])
    assert torch.equal(flat_v[others], v_before.reshape_as(flat_v)[others])


def test_reshape_and_cache_uses_only_the_slot_mapping_length():
    # Upstream sizes the work by slot_mapping: a key padded past it must not be written.
    key, value, key_cache, value_cache, _ = _slot_case(torch.float32, 8, seed=11)
    slots = torch.tensor([5, 40, 3], dtype=torch.int64)
    before = key_cache.clone()
    lab.reshape_and_cache(key, value, key_cache, value_cache, slots)
    changed = (key_cache != before).reshape(key_cache.shape[0], -1).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [0, 5]  # slots 3, 5 -> block 0; 40 -> block 5


def _assert_rejected(fn, *tensors):
    """``fn()`` raises ValueError and leaves every tensor in ``tensors`` as it was."""
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError):
        fn()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a rejected call must not change any cache or output"


def test_reshape_and_cache_rejects_bad_input_and_writes_nothing():
    key, value, key_cache, value_cache, slots = _slot_case(torch.float16, 16, seed=5)
    caches = (key_cache, value_cache)
    beyond = slots.clone()
    beyond[-1] = key_cache.shape[0] * 16  # one past the last slot; earlier slots are fine
    _assert_rejected(lambda: lab.reshape_and_cache(key, value, *caches, beyond), *caches)
    twice = slots.clone()
    twice[1] = twice[2] = 7
    _assert_rejected(lambda: lab.reshape_and_cache(key, value, *caches, twice), *caches)
    wrong_x = key_cache.view(key_cache.shape[0], 3, 8, 16, 4)  # fp32's x on an fp16 cache
    _assert_rejected(
        lambda: lab.reshape_and_cache(key, value, wrong_x, value_cache, slots), *caches
    )
    _assert_rejected(
        lambda: lab.reshape_and_cache(key.float(), value.float(), *caches, slots), *caches
    )
    _assert_rejected(lambda: lab.reshape_and_cache(key, value[:, :2], *caches, slots), *caches)
    flash_k = torch.zeros(4, 16, 3, 32, dtype=torch.float16)
    flash_v = torch.zeros(4, 16, 3, 32, dtype=torch.float16)
    bad = torch.tensor([0, 64], dtype=torch.int64)  # 64 = 4 blocks * 16: beyond the cache
    _assert_rejected(
        lambda: lab.reshape_and_cache_flash(key, value, flash_k, flash_v, bad), flash_k, flash_v
    )


def test_reshape_then_paged_attention_is_attention():
    """The data plane end to end: prefill writes K/V by slot, decode reads them by table."""
    dtype, heads, head, block_size = torch.float32, (8, 2), 64, 16
    gen = torch.Generator().manual_seed(7)
    lens = [37, 16, 5]
    num_blocks = 12
    x = x_of(dtype)
    key_cache = torch.zeros(num_blocks, heads[1], head // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, heads[1], head, block_size, dtype=dtype)
    tables = torch.tensor([[9, 2, 4], [0, 0, 0], [11, 0, 0]], dtype=torch.int32)
    tables[1, 0] = 6
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
    out = torch.empty_like(query)
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
    for s in range(len(lens)):
        want = ref_attention(query[s : s + 1], keys[s], values[s], scale=head**-0.5)[0]
        assert_close(out[s], want, msg=f"sequence {s}")


# ------------------------------------------------------------------------------------------
# Task 3: paged_attention_v1
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SHORT_GRID, ids=grid_id)
def test_v1_and_v2_match_reference(case):
    """The upstream kernel test's grid, on short contexts (one partition)."""
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
    v1, v2 = batch.run_v1(), batch.run_v2()
    expected = batch.expected()
    assert_close(v1, expected, msg=f"v1 {grid_id(case)}")
    assert_close(v2, expected, msg=f"v2 {grid_id(case)}")


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
    assert_close(batch.run_v1(), batch.expected())


def test_v1_ignores_padding_in_block_tables():
    # Entries past ceil(seq_len / block_size) are padding and may hold any value, even -1.
    batch = Batch(
        seed=4,
        seq_lens=[3, 40],
        num_heads=(4, 2),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=False,
    )
    batch.block_tables[0, 1:] = -1
    assert_close(batch.run_v1(), batch.expected())


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


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_paged_attention_rejects_bad_input_and_writes_nothing(version):
    batch = Batch(
        seed=8,
        seq_lens=[20, 33],
        num_heads=(4, 2),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=False,
    )
    for what, override in _bad_decode_calls(batch):
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
        out = torch.full_like(batch.query, 7.0)
        if version == "v1":
            with pytest.raises(ValueError):
                lab.paged_attention_v1(out, **args)
            assert (out == 7.0).all(), f"{what}: out was written before the input was rejected"
        else:
            bufs = [torch.full_like(t, 7.0) for t in batch.v2_buffers()]
            with pytest.raises(ValueError):
                lab.paged_attention_v2(out, *bufs, **args)
            assert (out == 7.0).all() and all((t == 7.0).all() for t in bufs), (
                f"{what}: an output buffer was written before the input was rejected"
            )


# ------------------------------------------------------------------------------------------
# Task 4: paged_attention_v2 and its reduce
# ------------------------------------------------------------------------------------------


# Several partitions: every head size and both head layouts, ALiBi on and off; block size and
# dtype rotate so that each appears, keeping the run short.
LONG_GRID = [
    (head, BLOCK_SIZES[i % 3], heads, alibi, DTYPES[(i // 3) % 3])
    for i, (head, heads, alibi) in enumerate(
        itertools.product(HEAD_SIZES, NUM_HEADS, [False, True])
    )
]


@pytest.mark.parametrize("case", LONG_GRID, ids=grid_id)
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
    v2, v1 = batch.run_v2(), batch.run_v1()
    expected = batch.expected()
    assert_close(v2, expected, msg=f"v2 {grid_id(case)}")
    assert_close(v2, v1, msg=f"v2 vs v1 {grid_id(case)}")


def test_v2_partition_buffers_hold_max_and_exp_sum():
    batch = Batch(
        seed=12,
        seq_lens=[1300, 700, 40],
        num_heads=(8, 4),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=True,
    )
    exp_sums, max_logits, tmp_out = batch.v2_buffers(extra_partitions=1)  # 4 partitions
    batch.run_v2((exp_sums, max_logits, tmp_out))
    for s, seq_len in enumerate(batch.seq_lens_list):
        logits = batch.logits(s)
        used = -(-seq_len // PARTITION)
        for p in range(used):
            part = logits[:, p * PARTITION : (p + 1) * PARTITION]
            m = part.amax(dim=1)
            assert_close(max_logits[s, :, p], m, msg=f"max_logits seq {s} partition {p}")
            assert_close(
                exp_sums[s, :, p],
                torch.exp(part - m[:, None]).sum(dim=1),
                msg=f"exp_sums seq {s} partition {p}",
            )
        # Partitions past the end of a sequence are marked empty.
        assert (exp_sums[s, :, used:] == 0).all()
        assert torch.isneginf(max_logits[s, :, used:]).all()


def test_v2_reduce_rescales_each_partition_by_its_max():
    gen = torch.Generator().manual_seed(2)
    num_heads, head, parts = 3, 16, 3
    seq_len = 2 * PARTITION + 100
    logits = torch.randn(num_heads, seq_len, generator=gen) * 3
    logits[:, PARTITION : 2 * PARTITION] += 4.0  # partitions with clearly different maxima
    values = torch.randn(seq_len, head, generator=gen)
    want = torch.softmax(logits, dim=1) @ values

    exp_sums = torch.full((1, num_heads, parts + 1), 123.0)  # the extra partition is stale junk
    max_logits = torch.full((1, num_heads, parts + 1), 50.0)
    tmp_out = torch.full((1, num_heads, parts + 1, head), 9.0)
    for p in range(parts):
        chunk = logits[:, p * PARTITION : (p + 1) * PARTITION]
        m = chunk.amax(dim=1)
        w = torch.exp(chunk - m[:, None])
        max_logits[0, :, p] = m
        exp_sums[0, :, p] = w.sum(dim=1)
        tmp_out[0, :, p] = (w @ values[p * PARTITION : (p + 1) * PARTITION]) / w.sum(1)[:, None]
    out = torch.empty(1, num_heads, head)
    lab.paged_attention_v2_reduce(
        out, exp_sums, max_logits, tmp_out, torch.tensor([seq_len], dtype=torch.int32)
    )
    assert_close(out[0], want)


def test_v2_rejects_too_small_buffers():
    batch = Batch(
        seed=9,
        seq_lens=[600, 20],
        num_heads=(4, 4),
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        alibi=False,
    )
    exp_sums, max_logits, tmp_out = batch.v2_buffers()
    out = torch.full_like(batch.query, 7.0)
    with pytest.raises(ValueError):
        lab.paged_attention_v2(
            out,
            exp_sums[:, :, :1],
            max_logits[:, :, :1],
            tmp_out[:, :, :1],
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
    assert (out == 7.0).all()


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
        (8192, 64, 32, True),
        (8193, 64, 32, False),  # past 8192 tokens v1's logits would not fit in shared memory
        (8193, 1, 1, False),
    ],
)
def test_choice_rule_of_v0_11_0(max_seq_len, num_seqs, num_heads, v1):
    assert lab.use_v1(max_seq_len, num_seqs, num_heads) is v1


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
    assert_close(out, batch.expected())


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
    for got, want in zip(keys + values, expect):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_bad_mappings_and_writes_nothing():
    keys, values = _layers()
    caches = keys + values
    for mapping in [
        torch.tensor([[1, 5], [2, 5]], dtype=torch.int64),  # one destination twice
        torch.tensor([[1, 5], [2, 10]], dtype=torch.int64),  # destination beyond the cache
        torch.tensor([[-1, 5]], dtype=torch.int64),
        torch.tensor([[1, 5], [5, 6]], dtype=torch.int64),  # 5 is both written and read
        torch.tensor([[1, 5]], dtype=torch.int32),
        torch.tensor([1, 5], dtype=torch.int64),
    ]:
        _assert_rejected(lambda m=mapping: lab.copy_blocks(keys, values, m), *caches)
    _assert_rejected(lambda: lab.copy_blocks(keys, values[:1], torch.tensor([[1, 5]])), *caches)


def test_swap_blocks_between_pools():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=1)
    gpu_like = keys[0]
    cpu_pool = torch.zeros(4, *gpu_like.shape[1:], dtype=gpu_like.dtype)
    src_before = gpu_like.clone()
    lab.swap_blocks(gpu_like, cpu_pool, torch.tensor([[5, 0], [2, 3]], dtype=torch.int64))
    assert torch.equal(cpu_pool[0], gpu_like[5]) and torch.equal(cpu_pool[3], gpu_like[2])
    assert (cpu_pool[1:3] == 0).all()
    assert torch.equal(gpu_like, src_before)
    # ... and back in, to other blocks.
    back = torch.zeros_like(gpu_like)
    lab.swap_blocks(cpu_pool, back, torch.tensor([[3, 1], [0, 4]], dtype=torch.int64))
    assert torch.equal(back[1], src_before[2]) and torch.equal(back[4], src_before[5])
    assert (back[[0, 2, 3, 5]] == 0).all()


def test_swap_blocks_rejects_bad_input_and_writes_nothing():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=2)
    src = keys[0]
    dst = torch.zeros(4, *src.shape[1:], dtype=src.dtype)
    ok = torch.tensor([[0, 0]], dtype=torch.int64)
    _assert_rejected(lambda: lab.swap_blocks(src, dst, torch.tensor([[0, 4]])), src, dst)
    _assert_rejected(lambda: lab.swap_blocks(src, dst, torch.tensor([[6, 0]])), src, dst)
    _assert_rejected(lambda: lab.swap_blocks(src, dst, torch.tensor([[0, 1], [2, 1]])), src, dst)
    _assert_rejected(lambda: lab.swap_blocks(src, dst.float(), ok), src, dst)
    _assert_rejected(lambda: lab.swap_blocks(src, dst[:, :1].contiguous(), ok), src, dst)


@pytest.mark.cuda
def test_swap_blocks_gpu_to_cpu_and_back():
    keys, _ = _layers(num_layers=1, num_blocks=6, seed=3)
    gpu = keys[0].cuda()
    cpu = torch.zeros(3, *gpu.shape[1:], dtype=gpu.dtype)
    lab.swap_blocks(gpu, cpu, torch.tensor([[4, 2]], dtype=torch.int64))
    assert torch.equal(cpu[2], keys[0][4])
    again = torch.zeros_like(gpu)
    lab.swap_blocks(cpu, again, torch.tensor([[2, 0]], dtype=torch.int64))
    assert torch.equal(again[0].cpu(), keys[0][4])
