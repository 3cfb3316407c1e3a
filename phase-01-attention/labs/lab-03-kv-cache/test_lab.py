"""Graded tests for lab 01-03: decoding with a flat KV cache.

The yardstick for every step is a full recomputation: lab 01's reference attention over the whole
sequence so far, of which the new tokens' rows must equal what the cache produced.
"""

from __future__ import annotations

import pytest
import torch

from course.loader import load_lab
from course.numerics import assert_close
from mini_vllm.attention.reference import alibi_slopes, ref_attention

lab = load_lab(__file__)


def sequence(total, num_heads, num_kv_heads, head_size, dtype=torch.float32, seed=0):
    """q, k, v of every token of one sequence (what the model's projections would produce)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    return q, k, v


def snapshot(cache):
    return cache.key_cache.clone(), cache.value_cache.clone(), cache.seq_lens.clone()


def assert_unchanged(cache, snap, what):
    k, v, lens = snap
    assert torch.equal(cache.seq_lens, lens), f"{what} changed seq_lens"
    assert torch.equal(cache.key_cache, k) and torch.equal(cache.value_cache, v), (
        f"{what} changed the cache"
    )


# ---------------------------------------------------------------------------------------------
# tasks 1-3: the cache itself


def test_cache_is_preallocated_flat_and_empty():
    cache = lab.FlatKVCache(3, 2, 16, 8, dtype=torch.float16)
    for t in (cache.key_cache, cache.value_cache):
        assert tuple(t.shape) == (3, 2, 16, 8) and t.dtype == torch.float16
        assert not t.any(), "a new cache holds zeros"
    assert cache.seq_lens.dtype == torch.long and cache.seq_lens.tolist() == [0, 0, 0]
    assert cache.max_seq_len == 16


@pytest.mark.parametrize("sizes", [(0, 2, 16, 8), (2, 2, -1, 8), (2, 0, 16, 8), (2, 2, 16, 0)])
def test_cache_rejects_sizes_that_are_not_positive(sizes):
    with pytest.raises(ValueError):
        lab.FlatKVCache(*sizes)


def test_append_puts_token_t_in_slot_t():
    cache = lab.FlatKVCache(2, 2, 8, 4)
    _, k, v = sequence(5, 2, 2, 4, seed=1)
    cache.append(1, k[:3], v[:3])
    cache.append(1, k[3:5], v[3:5])
    assert cache.seq_lens.tolist() == [0, 5]
    for t in range(5):
        assert torch.equal(cache.key_cache[1, :, t], k[t]), f"key of token {t} not in slot {t}"
        assert torch.equal(cache.value_cache[1, :, t], v[t]), f"value of token {t} not in slot {t}"
    assert not cache.key_cache[0].any() and not cache.key_cache[1, :, 5:].any(), (
        "append wrote outside the sequence's next slots"
    )


def test_keys_and_values_are_views_of_the_filled_slots():
    cache = lab.FlatKVCache(2, 2, 8, 4)
    _, k, v = sequence(6, 2, 2, 4, seed=2)
    cache.append(0, k[:2], v[:2])
    cache.append(1, k, v)
    assert_close(cache.keys(0), k[:2], msg="keys(0)")
    assert_close(cache.values(1), v, msg="values(1)")
    assert tuple(cache.keys(1).shape) == (6, 2, 4)
    storage = cache.key_cache.untyped_storage().data_ptr()
    assert cache.keys(1).untyped_storage().data_ptr() == storage, "keys() must be a view"


@pytest.mark.parametrize(
    "case", ["too-many-tokens", "bad-seq-idx", "wrong-heads", "wrong-dtype", "key-value-differ"]
)
def test_a_rejected_append_changes_nothing(case):
    cache = lab.FlatKVCache(2, 2, 6, 4)
    _, k, v = sequence(8, 2, 2, 4, seed=3)
    cache.append(0, k[:4], v[:4])
    snap = snapshot(cache)
    args = {
        "too-many-tokens": (0, k[:3], v[:3]),  # 4 + 3 > 6
        "bad-seq-idx": (2, k[:1], v[:1]),
        "wrong-heads": (1, k[:1, :1], v[:1, :1]),
        "wrong-dtype": (1, k[:1].double(), v[:1].double()),
        "key-value-differ": (1, k[:2], v[:1]),
    }[case]
    with pytest.raises(ValueError):
        cache.append(*args)
    assert_unchanged(cache, snap, f"a rejected append ({case})")


# ---------------------------------------------------------------------------------------------
# task 4: prefill, then decode token by token


@pytest.mark.parametrize(
    "prompt_len,total,num_heads,num_kv_heads,dtype,use_alibi",
    [
        (1, 6, 2, 2, torch.float32, False),
        (5, 12, 4, 2, torch.float32, False),
        (4, 9, 4, 1, torch.float32, True),
        (7, 11, 6, 3, torch.float16, False),
        (3, 8, 4, 2, torch.bfloat16, True),
    ],
)
def test_each_decode_step_equals_full_recomputation(
    prompt_len, total, num_heads, num_kv_heads, dtype, use_alibi
):
    head_size = 16
    q, k, v = sequence(total, num_heads, num_kv_heads, head_size, dtype, seed=4)
    slopes = alibi_slopes(num_heads) if use_alibi else None
    cache = lab.FlatKVCache(2, num_kv_heads, total + 3, head_size, dtype=dtype)
    cache.append(0, k[:2], v[:2])  # another sequence in the batch, which must not interfere

    out = lab.cached_attention(
        cache, 1, q[:prompt_len], k[:prompt_len], v[:prompt_len], alibi_slopes=slopes
    )
    want = ref_attention(q[:prompt_len], k[:prompt_len], v[:prompt_len], alibi_slopes=slopes)
    assert out.dtype == dtype
    assert_close(out, want, msg="prefill")
    for t in range(prompt_len, total):
        out = lab.cached_attention(
            cache, 1, q[t : t + 1], k[t : t + 1], v[t : t + 1], alibi_slopes=slopes
        )
        full = ref_attention(q[: t + 1], k[: t + 1], v[: t + 1], alibi_slopes=slopes)
        assert_close(out, full[-1:], msg=f"decode step for token {t}")
    assert cache.seq_lens.tolist() == [2, total]


def test_a_chunk_after_a_context_equals_recomputation():
    q, k, v = sequence(10, 4, 2, 8, seed=5)
    cache = lab.FlatKVCache(1, 2, 10, 8)
    lab.cached_attention(cache, 0, q[:4], k[:4], v[:4])
    out = lab.cached_attention(cache, 0, q[4:7], k[4:7], v[4:7])
    assert_close(out, ref_attention(q[:7], k[:7], v[:7])[4:], msg="3-token chunk after 4")


def test_cached_attention_rejects_a_query_count_unlike_the_keys():
    q, k, v = sequence(4, 2, 2, 8, seed=6)
    cache = lab.FlatKVCache(1, 2, 8, 8)
    with pytest.raises(ValueError):
        lab.cached_attention(cache, 0, q[:2], k[:3], v[:3])
    assert cache.seq_lens.tolist() == [0], "a rejected call stored tokens"


# ---------------------------------------------------------------------------------------------
# task 5: a batched decode step over the padded cache


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype",
    [(4, 4, torch.float32), (4, 2, torch.float32), (6, 3, torch.float16), (4, 1, torch.bfloat16)],
)
def test_batched_decode_equals_recomputation_for_ragged_sequences(num_heads, num_kv_heads, dtype):
    prompts, steps, head_size = [1, 6, 9, 3], 5, 16
    seqs = [
        sequence(p + steps, num_heads, num_kv_heads, head_size, dtype, seed=10 + i)
        for i, p in enumerate(prompts)
    ]
    cache = lab.FlatKVCache(len(prompts), num_kv_heads, 16, head_size, dtype=dtype)
    for s, (p, (q, k, v)) in enumerate(zip(prompts, seqs)):
        lab.cached_attention(cache, s, q[:p], k[:p], v[:p])
    for step in range(steps):
        pos = [p + step for p in prompts]
        out = lab.decode_step(
            cache,
            torch.stack([q[t] for t, (q, _, _) in zip(pos, seqs)]),
            torch.stack([k[t] for t, (_, k, _) in zip(pos, seqs)]),
            torch.stack([v[t] for t, (_, _, v) in zip(pos, seqs)]),
        )
        assert out.dtype == dtype and tuple(out.shape) == (len(prompts), num_heads, head_size)
        for s, (t, (q, k, v)) in enumerate(zip(pos, seqs)):
            full = ref_attention(q[: t + 1], k[: t + 1], v[: t + 1])
            assert_close(out[s], full[-1], msg=f"sequence {s}, token {t}")
    assert cache.seq_lens.tolist() == [p + steps for p in prompts]


def test_batched_decode_with_a_full_sequence_stores_nothing():
    cache = lab.FlatKVCache(2, 1, 4, 8)
    q, k, v = sequence(4, 2, 1, 8, seed=7)
    cache.append(0, k, v)  # sequence 0 is full
    cache.append(1, k[:1], v[:1])
    snap = snapshot(cache)
    with pytest.raises(ValueError):
        lab.decode_step(cache, q[:2], k[:2, :], v[:2, :])
    assert_unchanged(cache, snap, "a rejected decode_step")


# ---------------------------------------------------------------------------------------------
# task 6: memory, reserved against used


def test_cache_counts_reserved_and_used_bytes():
    cache = lab.FlatKVCache(3, 2, 32, 8, dtype=torch.float16)
    _, k, v = sequence(10, 2, 2, 8, torch.float16, seed=8)
    cache.append(0, k, v)
    cache.append(2, k[:3], v[:3])
    # Measured from the tensors themselves: 2 caches x 3 x 2 x 32 x 8 halves.
    assert cache.reserved_bytes() == cache.key_cache.nbytes + cache.value_cache.nbytes == 6144
    assert cache.used_bytes() == 13 * 2 * 2 * 8 * 2  # 13 tokens, K and V, 2 heads x 8, 2 bytes
    report = lab.memory_report([10, 0, 3], 32, num_kv_heads=2, head_size=8, dtype=torch.float16)
    assert (report.reserved_bytes, report.used_bytes) == (
        cache.reserved_bytes(),
        cache.used_bytes(),
    )


def test_memory_report_for_a_llama_sized_batch():
    # 32 layers, 8 KV heads of 128, fp16: 2 * 32 * 8 * 128 * 2 = 131072 bytes per token.
    lens = [100, 2048, 700, 1]
    r = lab.memory_report(lens, 2048, num_kv_heads=8, head_size=128, num_layers=32)
    assert r.reserved_bytes == 4 * 2048 * 131072
    assert r.used_bytes == sum(lens) * 131072
    assert r.wasted_bytes == r.reserved_bytes - r.used_bytes
    assert r.waste_fraction == pytest.approx(1 - sum(lens) / (4 * 2048), rel=1e-12)


def test_waste_for_varied_final_lengths_is_one_minus_mean_over_max():
    g = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    r = lab.memory_report(lens, 4096, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    assert r.waste_fraction == pytest.approx(1 - (sum(lens) / len(lens)) / 4096, rel=1e-12)


@pytest.mark.parametrize("lens", [[], [5, 40], [-1]])
def test_memory_report_rejects_impossible_lengths(lens):
    with pytest.raises(ValueError):
        lab.memory_report(lens, 32, num_kv_heads=2, head_size=8)
