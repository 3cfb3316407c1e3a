"""Graded tests for lab 01-03: decoding with a flat KV cache.

The yardstick for every step is a full recomputation: lab 01's reference attention over the whole
sequence so far, of which the new tokens' rows must equal what the cache produced. The empty
slots of a cache hold NaN wherever a test can put it there (the contract says they may hold
anything and never change a result), appends of as many tokens as there are KV heads catch a
transposed layout, and writes that fill a sequence exactly catch a capacity check off by one.
Task by task: every test uses only its task and the ones before it (`python
scripts/task_by_task.py 01-03` checks that the passing count grows after every task).
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest
import torch

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from mini_vllm.attention.reference import alibi_slopes, ref_attention

lab = load_lab(__file__)

OUT_DIMS = ("token", "head", "dim")
BATCH_DIMS = ("sequence", "head", "dim")


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
    assert torch.equal(cache.seq_lens, lens), (
        f"{what} changed seq_lens from {lens.tolist()} to {cache.seq_lens.tolist()}"
    )
    same_k = torch.equal(cache.key_cache.nan_to_num(7.0), k.nan_to_num(7.0))
    same_v = torch.equal(cache.value_cache.nan_to_num(7.0), v.nan_to_num(7.0))
    assert same_k and same_v, f"{what} changed the cache"


def meta_read_message(cache, exc: BaseException) -> str:
    """Why reading a value on the meta device failed, with the devices and the line that read."""
    devices = ", ".join(
        f"{name} on {value.device}"
        for name in ("key_cache", "value_cache", "seq_lens")
        if isinstance(value := getattr(cache, name, None), torch.Tensor)
    )
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    line = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno}, in {frames[-1].name})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"a cache on the meta device (shapes only, no values) failed where your code reads a "
        f"value from a meta tensor{line if frames else ''}: {first}. The cache holds "
        f"{devices}: keep the lengths (seq_lens) on the CPU and read them there, and compute "
        f"on the cache's device without .item(), int() or .tolist() of its tensors"
    )


def fill_empty_slots(cache, junk=float("nan")):
    """Write `junk` into every slot at or past seq_lens (the contract: never read)."""
    for s, n in enumerate(cache.seq_lens.tolist()):
        cache.key_cache[s, :, n:] = junk
        cache.value_cache[s, :, n:] = junk


def message_has_numbers(message, *numbers):
    return all(re.search(rf"(?<![\d.]){re.escape(str(n))}(?![\d.])", message) for n in numbers)


# ---------------------------------------------------------------------------------------------
# task 1: a new cache


def test_cache_is_preallocated_flat_and_empty():
    cache = lab.FlatKVCache(3, 2, 16, 8, dtype=torch.float16)
    for name in ("key_cache", "value_cache"):
        t = getattr(cache, name)
        assert tuple(t.shape) == (3, 2, 16, 8) and t.dtype == torch.float16, (
            f"{name}: shape {tuple(t.shape)} dtype {t.dtype}; want (3, 2, 16, 8) float16"
        )
        assert not t.any(), f"a new cache holds zeros ({name})"
    assert cache.key_cache.data_ptr() != cache.value_cache.data_ptr(), "K and V share memory"
    assert cache.seq_lens.dtype == torch.long and cache.seq_lens.tolist() == [0, 0, 0], (
        f"a new cache of 3 sequences needs seq_lens = torch.long zeros [3], got "
        f"{cache.seq_lens.dtype} {cache.seq_lens.tolist()}"
    )
    assert cache.max_seq_len == 16 and isinstance(cache.max_seq_len, int), (
        f"max_seq_len must be the int 16 given to __init__, got {cache.max_seq_len!r} "
        f"({type(cache.max_seq_len).__name__})"
    )


def test_cache_defaults_to_float32_on_the_default_device():
    cache = lab.FlatKVCache(1, 1, 4, 8)
    assert cache.key_cache.dtype == torch.float32 and cache.value_cache.dtype == torch.float32, (
        f"the default dtype is float32, got {cache.key_cache.dtype}"
    )
    assert cache.key_cache.device == torch.empty(0).device, (
        f"device=None must allocate on torch's default device {torch.empty(0).device}, "
        f"got key_cache on {cache.key_cache.device}"
    )


def test_cache_is_allocated_on_the_requested_device():
    cache = lab.FlatKVCache(2, 1, 4, 8, device="meta")
    assert cache.key_cache.device.type == "meta" and cache.value_cache.device.type == "meta", (
        f"device='meta' gave caches on {cache.key_cache.device} and {cache.value_cache.device}"
    )


@pytest.mark.parametrize(
    "sizes,name",
    [
        ((0, 2, 16, 8), "batch_size"),
        ((2, 0, 16, 8), "num_kv_heads"),
        ((2, 2, -1, 8), "max_seq_len"),
        ((2, 2, 16, 0), "head_size"),
        ((2, 2, 16.0, 8), "max_seq_len"),
    ],
    ids=str,
)
def test_cache_rejects_sizes_that_are_not_positive_ints(sizes, name):
    with pytest.raises(ValueError) as info:
        lab.FlatKVCache(*sizes)
    assert name in str(info.value), f"the message should name {name}: {info.value}"


# ---------------------------------------------------------------------------------------------
# task 2: append


def test_append_puts_token_t_in_slot_t():
    cache = lab.FlatKVCache(3, 2, 8, 4)
    _, k, v = sequence(5, 2, 2, 4, seed=1)
    cache.append(1, k[:3], v[:3])
    cache.append(1, k[3:5], v[3:5])  # 2 tokens and 2 KV heads: a transposed write fits too
    assert cache.seq_lens.tolist() == [0, 5, 0], f"seq_lens {cache.seq_lens.tolist()}"
    for t in range(5):
        assert torch.equal(cache.key_cache[1, :, t], k[t]), (
            f"key of token {t} is not in slot {t} (the cache is [seq, head, slot, dim])"
        )
        assert torch.equal(cache.value_cache[1, :, t], v[t]), f"value of token {t} not in slot {t}"
    assert not cache.key_cache[0].any() and not cache.key_cache[2].any(), (
        "append wrote into another sequence"
    )
    assert not cache.key_cache[1, :, 5:].any() and not cache.value_cache[1, :, 5:].any(), (
        "append wrote past the sequence's new tokens"
    )


def test_append_may_fill_a_sequence_exactly():
    cache = lab.FlatKVCache(2, 1, 6, 4)
    _, k, v = sequence(6, 1, 1, 4, seed=2)
    cache.append(0, k[:4], v[:4])
    cache.append(0, k[4:], v[4:])  # 4 + 2 == max_seq_len: fits exactly
    assert cache.seq_lens.tolist() == [6, 0], (
        f"appends of 4 then 2 tokens to sequence 0 (max_seq_len 6) should give seq_lens [6, 0], "
        f"got {cache.seq_lens.tolist()}"
    )
    assert torch.equal(cache.key_cache[0, 0], k[:, 0]), (
        "after appends of 4 then 2 tokens, key_cache[0, 0] (head 0) should hold the 6 keys "
        "in slots 0..5, token t in slot t"
    )


def test_append_of_no_tokens_changes_nothing():
    cache = lab.FlatKVCache(1, 2, 4, 4)
    _, k, v = sequence(2, 2, 2, 4, seed=3)
    cache.append(0, k, v)
    snap = snapshot(cache)
    cache.append(0, k[:0], v[:0])
    assert_unchanged(cache, snap, "an append of 0 tokens")


@pytest.mark.parametrize(
    "case",
    [
        "too-many-tokens",
        "bad-seq-idx",
        "negative-seq-idx",
        "wrong-heads",
        "wrong-head-size",
        "wrong-dtype",
        "value-dtype-differs",
        "key-value-differ",
        "not-3d",
    ],
)
def test_a_rejected_append_changes_nothing(case):
    cache = lab.FlatKVCache(2, 2, 6, 4)
    _, k, v = sequence(8, 2, 2, 4, seed=4)
    cache.append(0, k[:4], v[:4])
    snap = snapshot(cache)
    args = {
        "too-many-tokens": (0, k[:3], v[:3]),  # 4 + 3 > 6
        "bad-seq-idx": (2, k[:1], v[:1]),
        "negative-seq-idx": (-1, k[:1], v[:1]),  # no Python negative indexing
        "wrong-heads": (1, k[:1, :1], v[:1, :1]),
        "wrong-head-size": (1, k[:1, :, :3], v[:1, :, :3]),
        "wrong-dtype": (1, k[:1].double(), v[:1].double()),
        "value-dtype-differs": (1, k[:1], v[:1].half()),
        "key-value-differ": (1, k[:2], v[:1]),
        "not-3d": (1, k[0], v[0]),
    }[case]
    with pytest.raises(ValueError) as info:
        cache.append(*args)
    assert_unchanged(cache, snap, f"a rejected append ({case})")
    if case == "too-many-tokens":
        assert message_has_numbers(str(info.value), 4, 3, 6), (
            f"the message should give the 4 tokens stored, the 3 asked for and max_seq_len 6: "
            f"{info.value}"
        )


# ---------------------------------------------------------------------------------------------
# task 3: reading a sequence back


def test_keys_and_values_are_views_of_the_filled_slots():
    cache = lab.FlatKVCache(3, 2, 8, 4)
    _, k, v = sequence(6, 2, 2, 4, seed=5)
    cache.append(0, k[:2], v[:2])
    cache.append(1, k, v)
    fill_empty_slots(cache)  # no NaN may show up in what keys() and values() return
    assert_close(cache.keys(0), k[:2], atol=0, rtol=0, dims=OUT_DIMS, msg="keys(0)")
    assert_close(cache.values(1), v, atol=0, rtol=0, dims=OUT_DIMS, msg="values(1)")
    assert tuple(cache.keys(1).shape) == (6, 2, 4), f"keys(1) shape {tuple(cache.keys(1).shape)}"
    assert tuple(cache.values(2).shape) == (0, 2, 4), "an empty sequence has no stored values"
    for name, view, cache_t in (
        ("keys", cache.keys(1), cache.key_cache),
        ("values", cache.values(1), cache.value_cache),
    ):
        assert view.untyped_storage().data_ptr() == cache_t.untyped_storage().data_ptr(), (
            f"{name}() must be a view of the cache, not a copy"
        )


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
    q, k, v = sequence(total, num_heads, num_kv_heads, head_size, dtype, seed=6)
    slopes = alibi_slopes(num_heads) if use_alibi else None
    cache = lab.FlatKVCache(2, num_kv_heads, total + 3, head_size, dtype=dtype)
    cache.append(0, k[:2], v[:2])  # another sequence in the batch, which must not interfere
    fill_empty_slots(cache)

    out = lab.cached_attention(
        cache, 1, q[:prompt_len], k[:prompt_len], v[:prompt_len], alibi_slopes=slopes
    )
    want = ref_attention(q[:prompt_len], k[:prompt_len], v[:prompt_len], alibi_slopes=slopes)
    assert out.dtype == dtype, (
        f"cached_attention must return the query dtype {dtype}, got {out.dtype}"
    )
    assert_close(out, want, dims=OUT_DIMS, msg="prefill")
    for t in range(prompt_len, total):
        out = lab.cached_attention(
            cache, 1, q[t : t + 1], k[t : t + 1], v[t : t + 1], alibi_slopes=slopes
        )
        full = ref_attention(q[: t + 1], k[: t + 1], v[: t + 1], alibi_slopes=slopes)
        assert_close(out, full[-1:], dims=OUT_DIMS, msg=f"decode step for token {t}")
    assert cache.seq_lens.tolist() == [2, total], (
        f"after a prefill of {prompt_len} and decode steps up to {total} tokens in sequence 1, "
        f"seq_lens should be [2, {total}], got {cache.seq_lens.tolist()}"
    )


@pytest.mark.parametrize("scale", [0.0, 0.7], ids=str)
def test_a_chunk_after_a_context_equals_recomputation(scale):
    q, k, v = sequence(10, 4, 2, 8, seed=7)
    cache = lab.FlatKVCache(1, 2, 10, 8)
    lab.cached_attention(cache, 0, q[:4], k[:4], v[:4], scale=scale)
    fill_empty_slots(cache)
    out = lab.cached_attention(cache, 0, q[4:7], k[4:7], v[4:7], scale=scale)
    want = ref_attention(q[:7], k[:7], v[:7], scale=scale)[4:]
    assert_close(out, want, dims=OUT_DIMS, msg=f"3-token chunk after 4, scale={scale}")


def test_cached_attention_of_no_tokens_is_empty_and_stores_nothing():
    q, k, v = sequence(3, 4, 2, 8, seed=8)
    cache = lab.FlatKVCache(1, 2, 8, 8)
    lab.cached_attention(cache, 0, q, k, v)
    out = lab.cached_attention(cache, 0, q[:0], k[:0], v[:0])
    assert tuple(out.shape) == (0, 4, 8), f"n = 0 must give [0, 4, 8], got {tuple(out.shape)}"
    assert cache.seq_lens.tolist() == [3], (
        f"cached_attention of 0 tokens must store nothing: seq_lens should stay [3], "
        f"got {cache.seq_lens.tolist()}"
    )


@pytest.mark.parametrize(
    "case", ["n-differs", "head-size", "heads-do-not-divide", "slopes", "full"]
)
def test_cached_attention_rejects_bad_input_and_stores_nothing(case):
    q, k, v = sequence(6, 4, 2, 8, seed=9)
    cache = lab.FlatKVCache(1, 2, 5, 8)
    cache.append(0, k[:2], v[:2])
    snap = snapshot(cache)
    args, kwargs = {
        "n-differs": ((q[:2], k[:3], v[:3]), {}),
        "head-size": ((q[:1, :, :4], k[:1], v[:1]), {}),
        "heads-do-not-divide": ((q[:1, :3], k[:1], v[:1]), {}),
        "slopes": ((q[:1], k[:1], v[:1]), {"alibi_slopes": torch.ones(3)}),
        "full": ((q[:4], k[:4], v[:4]), {}),  # 2 + 4 > 5
    }[case]
    with pytest.raises(ValueError):
        lab.cached_attention(cache, 0, *args, **kwargs)
    assert_unchanged(cache, snap, f"a rejected cached_attention ({case})")


# ---------------------------------------------------------------------------------------------
# task 5: a batched decode step over the padded cache


def prefilled(prompts, steps, num_heads, num_kv_heads, dtype, max_seq_len=16, head_size=16):
    seqs = [
        sequence(p + steps, num_heads, num_kv_heads, head_size, dtype, seed=10 + i)
        for i, p in enumerate(prompts)
    ]
    cache = lab.FlatKVCache(len(prompts), num_kv_heads, max_seq_len, head_size, dtype=dtype)
    for s, (p, (_, k, v)) in enumerate(zip(prompts, seqs)):
        cache.append(s, k[:p], v[:p])
    return cache, seqs


def decode_rows(seqs, pos):
    return tuple(torch.stack([t[p] for p, t in zip(pos, ts)]) for ts in zip(*seqs))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype",
    [(4, 4, torch.float32), (4, 2, torch.float32), (6, 3, torch.float16), (4, 1, torch.bfloat16)],
)
def test_batched_decode_equals_recomputation_for_ragged_sequences(num_heads, num_kv_heads, dtype):
    # Sequence 1 starts empty: its first decode step attends to its new token alone.
    prompts, steps = [1, 0, 9, 3], 5
    cache, seqs = prefilled(prompts, steps, num_heads, num_kv_heads, dtype)
    fill_empty_slots(cache)  # NaN in every empty slot: none of it may reach an output
    for step in range(steps):
        pos = [p + step for p in prompts]
        out = lab.decode_step(cache, *decode_rows(seqs, pos))
        assert out.dtype == dtype and tuple(out.shape) == (len(prompts), num_heads, 16), (
            f"decode_step returned {out.dtype} {tuple(out.shape)}"
        )
        want = torch.stack(
            [
                ref_attention(q[: t + 1], k[: t + 1], v[: t + 1])[-1]
                for t, (q, k, v) in zip(pos, seqs)
            ]
        )
        assert_close(out, want, dims=BATCH_DIMS, msg=f"decode step {step} (tokens {pos})")
    assert cache.seq_lens.tolist() == [p + steps for p in prompts], (
        f"after {steps} decode steps every sequence should have grown by {steps}: want "
        f"{[p + steps for p in prompts]}, got {cache.seq_lens.tolist()}"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_batched_decode_computes_in_float32_or_float64(dtype):
    # 200 slots, head size 128, sharp scores: computed in half precision the result is off by
    # 1e-3 and more; computed in float32 (float64 for float64) and rounded once, it is within
    # one unit in the last place of lab 01's reference, which computes that way (plus float32
    # noise for outputs near 0, where the weighted values cancel).
    prompts, head_size = [199, 100, 3], 128
    g = torch.Generator().manual_seed(15)
    seqs = [
        tuple(
            (torch.randn(p + 1, h, head_size, generator=g) * s).to(dtype)
            for h, s in ((4, 3.0), (2, 1.0), (2, 1.0))
        )
        for p in prompts
    ]
    cache = lab.FlatKVCache(3, 2, 200, head_size, dtype=dtype)
    for s, (p, (_, k, v)) in enumerate(zip(prompts, seqs)):
        cache.append(s, k[:p], v[:p])
    out = lab.decode_step(cache, *decode_rows(seqs, prompts))
    want = torch.stack(
        [
            ref_attention(q[: t + 1], k[: t + 1], v[: t + 1])[-1]
            for t, (q, k, v) in zip(prompts, seqs)
        ]
    )
    assert out.dtype == dtype, f"decode_step returned {out.dtype} for {dtype} inputs"
    eps = torch.finfo(dtype).eps
    atol, rtol = (1e-12, 1e-10) if dtype == torch.float64 else (2e-5, eps)
    # Which advice fits is decided by the evidence: an output as far off as the same attention
    # computed in a lower precision is a precision mistake; one farther off is a wrong result
    # (a head mapping, a mask, a slot) that no rounding explains.
    err = (out.double() - want.double()).abs()
    low = LOWER_PRECISION[dtype]
    rounding = (low_precision_decode(seqs, prompts, low).double() - want.double()).abs().max()
    if torch.isfinite(err).all() and err.max() <= 4 * rounding + atol:
        advice = (
            f"off by {err.max():.3g}, as much as the same attention computed in {low} "
            f"({rounding:.3g}): compute in float32 (float64 for float64), round once at the end"
        )
    else:
        advice = (
            f"off by {err.max():.3g}, more than computing in {low} would make it "
            f"({rounding:.3g}): not a precision problem but a wrong result (a head mapping, the "
            f"mask, a slot); test_batched_decode_equals_recomputation_for_ragged_sequences "
            f"shows which rows"
        )
    assert_close(out, want, atol=atol, rtol=rtol, dims=BATCH_DIMS, msg=f"{dtype} inputs {advice}")


# The precision a mistaken decode computes in: the inputs' own, or float32 for float64 inputs.
LOWER_PRECISION = {
    torch.float16: torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.float64: torch.float32,
}


def low_precision_decode(seqs, positions, dtype):
    """Each sequence's decode row of causal attention, computed entirely in ``dtype`` (scores,
    softmax and weighted sum): how far a computation without float32 lands from the reference."""
    rows = []
    for t, (q, k, v) in zip(positions, seqs):
        q1, keys, values = (x.to(dtype) for x in (q[t], k[: t + 1], v[: t + 1]))
        group = q1.shape[0] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q1, keys) * q1.shape[-1] ** -0.5
        rows.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values))
    return torch.stack(rows)


def test_batched_decode_runs_on_the_caches_device():
    # The meta device holds shapes only: positions or lengths left on the CPU cannot meet it.
    cache = lab.FlatKVCache(2, 2, 8, 8, device="meta")
    kv = torch.zeros(3, 2, 8, device="meta")
    try:
        cache.append(0, kv, kv)
        out = lab.decode_step(
            cache, torch.zeros(2, 4, 8, device="meta"), kv[:2], torch.zeros(2, 2, 8, device="meta")
        )
    except (RuntimeError, NotImplementedError) as exc:
        if not re.search(r"\bmeta\b", str(exc), re.IGNORECASE):
            raise
        raise AssertionError(meta_read_message(cache, exc)) from exc
    assert out.device.type == "meta" and tuple(out.shape) == (2, 4, 8), (
        f"decode_step on a meta cache gave {tuple(out.shape)} on {out.device}"
    )


@pytest.mark.parametrize("scale", [0.0, 0.7], ids=str)
def test_batched_decode_uses_the_scale_it_is_given(scale):
    cache, seqs = prefilled([2, 5, 7], 1, 4, 2, torch.float32)
    out = lab.decode_step(cache, *decode_rows(seqs, [2, 5, 7]), scale=scale)
    want = torch.stack(
        [
            ref_attention(q[: t + 1], k[: t + 1], v[: t + 1], scale=scale)[-1]
            for t, (q, k, v) in zip([2, 5, 7], seqs)
        ]
    )
    assert_close(out, want, dims=BATCH_DIMS, msg=f"decode_step(scale={scale})")


def test_batched_decode_is_one_computation_not_a_loop_of_ref_attention(monkeypatch):
    module = lab.module_of(lab.decode_step)

    def forbidden(*args, **kwargs):
        raise AssertionError(
            "decode_step called ref_attention / cached_attention once per sequence; compute the "
            "whole batch at once over the padded cache, with a length mask"
        )

    for name in ("ref_attention", "cached_attention"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, forbidden)
    cache, seqs = prefilled([3, 6], 1, 2, 2, torch.float32)
    out = lab.decode_step(cache, *decode_rows(seqs, [3, 6]))
    assert tuple(out.shape) == (2, 2, 16), (
        f"decode_step of 2 sequences, 2 heads of 16, should return [2, 2, 16], "
        f"got {tuple(out.shape)}"
    )


@pytest.mark.parametrize("full", [0, 1, 2])
def test_batched_decode_with_a_full_sequence_stores_nothing(full):
    # The full sequence may come after others that had room: none of them may get its token.
    cache = lab.FlatKVCache(3, 1, 4, 8)
    q, k, v = sequence(4, 2, 1, 8, seed=11)
    for s in range(3):
        cache.append(s, k if s == full else k[:2], v if s == full else v[:2])
    snap = snapshot(cache)
    with pytest.raises(ValueError) as info:
        lab.decode_step(cache, q[:3], k[:3], v[:3])
    assert_unchanged(cache, snap, "a rejected decode_step")
    assert message_has_numbers(str(info.value), full), (
        f"the message should name the full sequence {full}: {info.value}"
    )


@pytest.mark.parametrize(
    "case", ["query-batch", "key-batch", "kv-heads", "head-size", "heads-do-not-divide"]
)
def test_batched_decode_rejects_shapes_that_do_not_fit_and_stores_nothing(case):
    cache = lab.FlatKVCache(2, 2, 8, 8)
    q, k, v = sequence(3, 4, 2, 8, seed=12)
    cache.append(0, k[:1], v[:1])
    snap = snapshot(cache)
    args = {
        "query-batch": (q[:3], k[:2], v[:2]),
        "key-batch": (q[:2], k[:3], v[:3]),  # 3 new tokens for 2 sequences
        "kv-heads": (q[:2], k[:2, :1], v[:2, :1]),
        "head-size": (q[:2, :, :4], k[:2], v[:2]),
        "heads-do-not-divide": (q[:2, :3], k[:2], v[:2]),
    }[case]
    with pytest.raises(ValueError):
        lab.decode_step(cache, *args)
    assert_unchanged(cache, snap, f"a rejected decode_step ({case})")


# ---------------------------------------------------------------------------------------------
# task 6: memory, reserved against used


def test_cache_counts_reserved_and_used_bytes():
    cache = lab.FlatKVCache(3, 2, 32, 8, dtype=torch.float16)
    assert cache.used_bytes() == 0, "an empty cache uses 0 bytes"
    _, k, v = sequence(10, 2, 2, 8, torch.float16, seed=13)
    cache.append(0, k, v)
    cache.append(2, k[:3], v[:3])
    # Measured from the tensors themselves: 2 caches x 3 x 2 x 32 x 8 halves.
    reserved = cache.reserved_bytes()
    assert reserved == cache.key_cache.nbytes + cache.value_cache.nbytes == 6144, (
        f"reserved_bytes is every slot of both caches, 2 x 3 x 2 x 32 x 8 halves = 6144; got "
        f"{reserved}"
    )
    assert cache.used_bytes() == 13 * 2 * 2 * 8 * 2, (
        f"used_bytes {cache.used_bytes()}: 13 tokens x (K and V) x 2 heads x 8 x 2 bytes = 832"
    )
    assert isinstance(cache.reserved_bytes(), int) and isinstance(cache.used_bytes(), int), (
        f"byte counts are Python ints, got {type(cache.reserved_bytes()).__name__} and "
        f"{type(cache.used_bytes()).__name__}"
    )
    report = lab.memory_report([10, 0, 3], 32, num_kv_heads=2, head_size=8, dtype=torch.float16)
    got = (report.reserved_bytes, report.used_bytes)
    want = (cache.reserved_bytes(), cache.used_bytes())
    assert got == want, (
        f"memory_report([10, 0, 3], ...) counts what a cache holding those lengths reserves and "
        f"uses (each sequence's own tokens, not padded to the longest): {want}, got {got}"
    )


def test_reserved_bytes_follow_the_dtype():
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float64, 8)):
        cache = lab.FlatKVCache(2, 3, 5, 4, dtype=dtype)
        assert cache.reserved_bytes() == 2 * 2 * 3 * 5 * 4 * size, f"{dtype}"


def test_memory_report_for_a_llama_sized_batch():
    # 32 layers, 8 KV heads of 128, fp16: 2 * 32 * 8 * 128 * 2 = 131072 bytes per token.
    lens = [100, 2048, 700, 1]
    r = lab.memory_report(lens, 2048, num_kv_heads=8, head_size=128, num_layers=32)
    assert r.reserved_bytes == 4 * 2048 * 131072, (
        f"reserved_bytes: 4 sequences x max_seq_len 2048 x 131072 bytes a token (K and V, 32 "
        f"layers, 8 heads of 128, fp16) = {4 * 2048 * 131072}, got {r.reserved_bytes}"
    )
    assert r.used_bytes == sum(lens) * 131072, (
        f"used_bytes: each sequence's own length ({sum(lens)} tokens) x 131072 = "
        f"{sum(lens) * 131072}, got {r.used_bytes}"
    )
    assert r.wasted_bytes == r.reserved_bytes - r.used_bytes, (
        f"wasted_bytes must be reserved - used = {r.reserved_bytes - r.used_bytes}, "
        f"got {r.wasted_bytes}"
    )
    assert r.waste_fraction == pytest.approx(1 - sum(lens) / (4 * 2048), rel=1e-12), (
        f"waste_fraction must be wasted / reserved = {1 - sum(lens) / (4 * 2048):.6f}, "
        f"got {r.waste_fraction}"
    )


def test_memory_report_defaults_are_float16_and_one_layer():
    r = lab.memory_report([3, 5], 8, num_kv_heads=2, head_size=4)
    per_token = 2 * 1 * 2 * 4 * 2  # K and V, one layer, 2 heads of 4, 2 bytes
    assert (r.reserved_bytes, r.used_bytes) == (2 * 8 * per_token, 8 * per_token), (
        f"defaults (float16, one layer): want reserved {2 * 8 * per_token}, used "
        f"{8 * per_token}; got {r.reserved_bytes}, {r.used_bytes}"
    )


def test_memory_report_at_the_extremes():
    empty = lab.memory_report([0, 0, 0], 16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    assert empty.used_bytes == 0 and empty.waste_fraction == 1.0, (
        f"all final lengths 0: want used_bytes 0 and waste_fraction 1.0, "
        f"got {empty.used_bytes} and {empty.waste_fraction}"
    )
    full = lab.memory_report([16, 16], 16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    assert full.wasted_bytes == 0 and full.waste_fraction == 0.0, (
        f"every sequence at max_seq_len: want wasted_bytes 0 and waste_fraction 0.0, "
        f"got {full.wasted_bytes} and {full.waste_fraction}"
    )


def test_waste_for_varied_final_lengths_is_one_minus_mean_over_max():
    g = torch.Generator().manual_seed(14)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    r = lab.memory_report(lens, 4096, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    assert r.waste_fraction == pytest.approx(1 - (sum(lens) / len(lens)) / 4096, rel=1e-12), (
        f"waste_fraction of 64 lengths must be 1 - mean length / max_seq_len = "
        f"{1 - (sum(lens) / len(lens)) / 4096:.6f}, got {r.waste_fraction}"
    )


@pytest.mark.parametrize("lens", [[], [5, 40], [-1], [3, 33, 2]], ids=str)
def test_memory_report_rejects_impossible_lengths(lens):
    with pytest.raises(ValueError):
        lab.memory_report(lens, 32, num_kv_heads=2, head_size=8)
