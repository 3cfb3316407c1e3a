"""The FP8 (e4m3) KV cache of the PyTorch oracle: conversion bounds, cache writes, attention.

Expected values never come from ``mini_vllm.attention.fp8``: the tests quantize with their own
one-liner (``(x / s).clamp(-448, 448).to(float8_e4m3fn)``) and dequantize with
``q.float() * s``, and the error bounds are derived from e4m3's format (3 mantissa bits: a
relative error of at most 2**-4 in the normal range, an absolute error of at most
2**-10 * scale below it, saturation at 448 * scale above it).
"""

from __future__ import annotations

import math

import pytest
import torch

from course.labs.numerics import assert_close
from mini_vllm.attention import cache_ops, paged_attn
from mini_vllm.attention.fp8 import (
    FP8_DTYPE,
    kv_cache_torch_dtype,
    scaled_fp8_dequant,
    scaled_fp8_quant,
)

E4M3 = torch.float8_e4m3fn
MAX = 448.0
MIN_NORMAL = 2.0**-6
SCALES = [1.0, 0.5, 3.7, 0.013]


def quant(x: torch.Tensor, s: float) -> torch.Tensor:
    return (x.float() / s).clamp(-MAX, MAX).to(E4M3)


def dequant(q: torch.Tensor, s: float, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * s).to(dtype)


def spread(n: int, s: float, seed: int = 0) -> torch.Tensor:
    """Values of both signs whose magnitudes over ``s`` span the subnormal and normal range."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n).uniform_(-12.0, math.log2(MAX), generator=g)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return signs * torch.exp2(exps) * s


# ------------------------------------------------------------------------------------------
# The conversion
# ------------------------------------------------------------------------------------------


def test_fp8_is_e4m3_and_auto_is_the_model_dtype():
    assert FP8_DTYPE is torch.float8_e4m3fn
    for model_dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert kv_cache_torch_dtype("fp8", model_dtype) is torch.float8_e4m3fn
        assert kv_cache_torch_dtype("fp8_e4m3", model_dtype) is torch.float8_e4m3fn
        assert kv_cache_torch_dtype("auto", model_dtype) is model_dtype
    for bad in ("fp8_e5m2", "int8", "FP8", "", None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            kv_cache_torch_dtype(bad, torch.float16)


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_within_e4m3_bounds(s, dtype):
    x = spread(4000, s).to(dtype)
    q = scaled_fp8_quant(x, s)
    assert q.dtype == E4M3 and q.shape == x.shape
    back = scaled_fp8_dequant(q, s, torch.float32)
    xf = x.float()
    err = (back - xf).abs()
    normal = xf.abs() >= MIN_NORMAL * s
    assert normal.sum() > 1000 and (~normal).sum() > 100
    # Normal range: nearest of 8 mantissa steps -> at most half a step, 2**-4 relative.
    # (The 1e-6 covers the float32 rounding of x / s and q * s.)
    rel = err[normal] / xf.abs()[normal]
    assert float(rel.max()) <= 2.0**-4 * (1 + 1e-6), float(rel.max())
    # Subnormals: a fixed grid of 2**-9 * s, so at most 2**-10 * s away.
    assert float(err[~normal].max()) <= 2.0**-10 * s * (1 + 1e-6)
    # And the bound is tight enough to mean something: the worst case is near it.
    assert float(rel.max()) > 2.0**-5
    # The stored bytes are exactly the independent quantization.
    assert torch.equal(q.view(torch.uint8), quant(x, s).view(torch.uint8))


@pytest.mark.parametrize("s", [2.0, 0.25])
def test_saturation_at_448_times_scale(s):
    """Beyond ``448 * scale`` a value is stored as +-448 and reads back as +-448 * scale; within
    it (e.g. 416 * scale) nothing saturates, whatever the scale (the clamp is applied to x / s)."""
    x = torch.tensor([416.0, 448.0, 449.0, 600.0, 1e6, float("inf")]) * s
    x = torch.cat([x, -x])
    back = scaled_fp8_dequant(scaled_fp8_quant(x, s), s, torch.float32)
    expected = torch.tensor([416.0, 448.0, 448.0, 448.0, 448.0, 448.0]) * s
    assert_close(back, torch.cat([expected, -expected]), atol=0, rtol=0)
    nan = scaled_fp8_quant(torch.tensor([float("nan")]), s)
    assert torch.isnan(nan.float()).all()


def test_every_e4m3_value_times_a_power_of_two_round_trips_exactly():
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid)]
    for s in (1.0, 0.125, 4.0):
        back = scaled_fp8_dequant(scaled_fp8_quant(grid * s, s), s, torch.float32)
        assert_close(back, grid * s, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------
# Writing the cache
# ------------------------------------------------------------------------------------------


def fp8_caches(num_blocks, num_kv_heads, head_size, block_size):
    kv = torch.zeros(paged_attn.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                   head_size), dtype=E4M3)
    # Junk everywhere (e4m3fn's NaN byte is 0x7f), so that unwritten slots are visible.
    kv.view(torch.uint8).fill_(0x7F)
    return paged_attn.split_kv_cache(kv, num_kv_heads, head_size)


def test_fp8_layout_uses_x_16():
    assert paged_attn.kv_cache_x(E4M3) == 16
    kc, vc = fp8_caches(5, 2, 32, 8)
    assert kc.shape == (5, 2, 2, 8, 16) and vc.shape == (5, 2, 32, 8)
    assert kc.dtype == vc.dtype == E4M3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_stores_the_scaled_fp8_bytes(dtype):
    torch.manual_seed(0)
    nb, kvh, d, bs = 6, 2, 48, 8
    kc, vc = fp8_caches(nb, kvh, d, bs)
    k = (torch.randn(7, kvh, d) * 3).to(dtype)
    v = (torch.randn(7, kvh, d) * 0.2).to(dtype)
    slots = torch.tensor([9, 10, -1, 40, 17, 8, 47])
    ks, vs = 0.02, 0.003
    before_k, before_v = kc.clone(), vc.clone()
    cache_ops.reshape_and_cache(k, v, kc, vc, slots, "fp8", ks, vs)
    qk, qv = quant(k, ks).view(torch.uint8), quant(v, vs).view(torch.uint8)
    touched_k = torch.zeros(kc.shape, dtype=torch.bool)
    touched_v = torch.zeros(vc.shape, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        got_k = kc[b, :, :, o, :].reshape(kvh, d).view(torch.uint8)
        assert torch.equal(got_k, qk[i]), f"token {i}: key bytes"
        assert torch.equal(vc[b, :, :, o].view(torch.uint8), qv[i]), f"token {i}: value bytes"
        touched_k[b, :, :, o, :] = True
        touched_v[b, :, :, o] = True
    assert torch.equal(kc.view(torch.uint8)[~touched_k], before_k.view(torch.uint8)[~touched_k])
    assert torch.equal(vc.view(torch.uint8)[~touched_v], before_v.view(torch.uint8)[~touched_v])


BAD_SCALES = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), True,
              torch.tensor([1.0, 2.0]), "1.0"]


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_bad_scale_is_refused_and_changes_nothing(bad, which):
    kc, vc = fp8_caches(4, 1, 16, 4)
    q = torch.randn(1, 2, 16)
    k = v = torch.randn(2, 1, 16)
    scales = {"k_scale": 0.1, "v_scale": 0.1, which: bad}
    before = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=which):
        cache_ops.reshape_and_cache(k, v, kc, vc, torch.tensor([4, 5]), "fp8", **scales)
    assert torch.equal(kc.view(torch.uint8), before[0])
    assert torch.equal(vc.view(torch.uint8), before[1])
    out = torch.full_like(q, 7.0)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=which):
        paged_attn.paged_attention_v1(out, q, kc, vc, 1, 0.25, tables, lens, 4, 4, None,
                                      "fp8", **scales)
    assert (out == 7.0).all()


def test_fp8_cache_and_model_dtype_cache_are_not_mixed_up():
    k = v = torch.randn(2, 1, 16)
    f8k, f8v = fp8_caches(4, 1, 16, 4)
    f32k, f32v = paged_attn.split_kv_cache(
        torch.zeros(paged_attn.get_kv_cache_shape(4, 4, 1, 16)), 1, 16)
    slots = torch.tensor([4, 5])
    # An fp8 cache where the model dtype is expected ("auto"), and the other way round.
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        cache_ops.reshape_and_cache(k, v, f8k, f8v, slots)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cache_ops.reshape_and_cache(k, v, f32k, f32v, slots, "fp8", 1.0, 1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # one of each
        cache_ops.reshape_and_cache(k, v, f8k, f32v, slots, "fp8", 1.0, 1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        cache_ops.reshape_and_cache(k, v, f8k, f8v, slots, "fp8_e5m2", 1.0, 1.0)
    assert (f32k == 0).all() and (f32v == 0).all()
    assert (f8k.view(torch.uint8) == 0x7F).all()
    q = torch.randn(1, 2, 16)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    for caches, args in (((f8k, f8v), ()), ((f32k, f32v), ("fp8", 1.0, 1.0))):
        out = torch.full_like(q, 7.0)
        with pytest.raises(ValueError, match="cache dtypes"):
            paged_attn.paged_attention_v1(out, q, *caches, 1, 0.25, tables, lens, 4, 4, None,
                                          *args)
        assert (out == 7.0).all()
    # The fp8 layout has x = 16: an fp8 tensor in a float32 (x = 4) layout is refused.
    wrong = torch.zeros(4, 1, 4, 4, 4, dtype=E4M3)
    with pytest.raises(ValueError, match="x=16"):
        cache_ops.reshape_and_cache(k, v, wrong, f8v, slots, "fp8", 1.0, 1.0)


def test_copy_and_swap_move_fp8_blocks_bit_for_bit():
    kc, vc = fp8_caches(4, 1, 16, 4)
    k, v = torch.randn(4, 1, 16), torch.randn(4, 1, 16)
    cache_ops.reshape_and_cache(k, v, kc, vc, torch.arange(4, 8), "fp8", 0.01, 0.01)
    cache_ops.copy_blocks([kc], [vc], torch.tensor([[1, 3]]))
    assert torch.equal(kc[3].view(torch.uint8), kc[1].view(torch.uint8))
    pool = torch.zeros_like(vc)
    cache_ops.swap_blocks(vc, pool, torch.tensor([[1, 2]]))
    assert torch.equal(pool[2].view(torch.uint8), vc[1].view(torch.uint8))


# ------------------------------------------------------------------------------------------
# Attention on an fp8 cache
# ------------------------------------------------------------------------------------------


def build_batch(lens, kvh, heads, d, bs, dtype, seed=0):
    """Random K/V for each sequence, written into an fp8 cache (scales: amax / 448) and into a
    model-dtype cache through shuffled block tables; junk (NaN) everywhere else."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // bs) for n in lens]
    nb = sum(blocks_per) + 3
    perm = torch.randperm(nb - 1, generator=g) + 1
    width = max(blocks_per) + 1
    tables = torch.full((len(lens), width), 10_000, dtype=torch.int32)
    ks, vs, slots, at = [], [], [], 0
    for s, n in enumerate(lens):
        ids = perm[at:at + blocks_per[s]]
        at += blocks_per[s]
        tables[s, :len(ids)] = ids.to(torch.int32)
        pos = torch.arange(n)
        slots.append(ids[pos // bs] * bs + pos % bs)
        ks.append(torch.randn(n, kvh, d, generator=g) * 2.0)
        vs.append(torch.randn(n, kvh, d, generator=g) * 0.5)
    k, v, slots = torch.cat(ks).to(dtype), torch.cat(vs).to(dtype), torch.cat(slots)
    k_scale = float(k.float().abs().max()) / MAX
    v_scale = float(v.float().abs().max()) / MAX
    f8k, f8v = fp8_caches(nb, kvh, d, bs)
    cache_ops.reshape_and_cache(k, v, f8k, f8v, slots, "fp8", k_scale, v_scale)
    fk, fv = paged_attn.split_kv_cache(
        torch.full(paged_attn.get_kv_cache_shape(nb, bs, kvh, d), float("nan"), dtype=dtype),
        kvh, d)
    cache_ops.reshape_and_cache(k, v, fk, fv, slots)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return dict(q=q, f8=(f8k, f8v), full=(fk, fv), scales=(k_scale, v_scale), tables=tables,
                lens=torch.tensor(lens, dtype=torch.int32), kvh=kvh, bs=bs)


def run_v1(b, caches, *fp8):
    out = torch.empty_like(b["q"])
    paged_attn.paged_attention_v1(out, b["q"], *caches, b["kvh"], 0.125, b["tables"],
                                  b["lens"], b["bs"], int(b["lens"].max()), None, *fp8)
    return out


def run_v2(b, caches, *fp8):
    q = b["q"]
    parts = paged_attn.num_partitions(int(b["lens"].max()))
    out = torch.empty_like(q)
    exp_sums = torch.empty(q.shape[0], q.shape[1], parts)
    max_logits = torch.empty_like(exp_sums)
    tmp = torch.empty(q.shape[0], q.shape[1], parts, q.shape[2], dtype=q.dtype)
    paged_attn.paged_attention_v2(out, exp_sums, max_logits, tmp, q, *caches, b["kvh"], 0.125,
                                  b["tables"], b["lens"], b["bs"], int(b["lens"].max()), None,
                                  *fp8)
    return out


def dequantized(b, dtype):
    """The fp8 cache dequantized into ``dtype``, the key re-split for that dtype's ``x``."""
    (f8k, f8v), (ks, vs) = b["f8"], b["scales"]
    nb, kvh, chunks, bs, x8 = f8k.shape
    x = 16 // torch.empty((), dtype=dtype).element_size()
    k = dequant(f8k, ks, dtype).permute(0, 1, 2, 4, 3).reshape(nb, kvh, chunks * x8, bs)
    k = k.reshape(nb, kvh, chunks * x8 // x, x, bs).permute(0, 1, 2, 4, 3).contiguous()
    return k, dequant(f8v, vs, dtype)


LENS = [[1, 37, 600], [1100, 5]]


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("run", [run_v1, run_v2], ids=["v1", "v2"])
def test_fp8_attention_equals_attention_on_the_dequantized_cache(lens, dtype, run):
    b = build_batch(lens, kvh=2, heads=4, d=32, bs=16, dtype=dtype)
    got = run(b, b["f8"], "fp8", *b["scales"])
    # The same cache, dequantized by the test into the model dtype: only rounding differs
    # (none for float32; the fp16 rounding of each dequantized element for float16).
    want = run(b, dequantized(b, dtype))
    if dtype == torch.float32:
        assert_close(got, want, atol=1e-6, rtol=1e-6, dims=("seq", "head", "dim"))
    else:
        assert_close(got, want, dtype=dtype, dims=("seq", "head", "dim"))


@pytest.mark.parametrize("lens", LENS)
def test_fp8_v1_equals_v2(lens):
    b = build_batch(lens, kvh=1, heads=4, d=16, bs=8, dtype=torch.float32, seed=3)
    fp8 = ("fp8", *b["scales"])
    assert_close(run_v1(b, b["f8"], *fp8), run_v2(b, b["f8"], *fp8), dtype=torch.float32)


@pytest.mark.parametrize("lens", LENS)
def test_fp8_attention_error_against_the_unquantized_cache_is_bounded(lens):
    """Keys off by at most 2**-4 relative (plus 2**-10 * k_scale absolute) move each logit by
    at most ``delta``; probabilities then change by a factor within exp(+-2 delta), so the
    output moves by at most ``(exp(2 delta) - 1) * max|v| + max|v error|``."""
    b = build_batch(lens, kvh=2, heads=4, d=32, bs=16, dtype=torch.float32, seed=1)
    got = run_v1(b, b["f8"], "fp8", *b["scales"])
    exact = run_v1(b, b["full"])
    (ks, vs), scale = b["scales"], 0.125
    q, kvh = b["q"], b["kvh"]
    fullk, fullv = b["full"]
    bound = []
    for s, n in enumerate(b["lens"].tolist()):
        blocks = b["tables"][s, : -(-n // b["bs"])].long()
        k = fullk[blocks].permute(0, 3, 1, 2, 4).reshape(-1, kvh, 32)[:n]  # [n, kvh, d]
        v = fullv[blocks].permute(0, 3, 1, 2).reshape(-1, kvh, 32)[:n]
        qh = q[s].view(kvh, 2, 32)
        k_err = k.abs() * 2.0**-4 + 2.0**-10 * ks
        delta = scale * torch.einsum("kgd,nkd->kgn", qh.abs(), k_err).amax()
        v_err = (v.abs() * 2.0**-4 + 2.0**-10 * vs).amax()
        bound.append(float((torch.exp(2 * delta) - 1) * v.abs().amax() + v_err))
    err = (got - exact).abs().amax(dim=(1, 2))
    for s, (e, bd) in enumerate(zip(err.tolist(), bound)):
        assert e <= bd, f"sequence {s}: error {e} above the bound {bd}"
    # ... and the quantization is really there (an fp8 path that silently kept full precision
    # would pass the bound with error 0).
    assert float(err.max()) > 1e-4
