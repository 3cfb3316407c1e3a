"""Graded tests for lab 01-01: scaled dot-product attention.

Two independent yardsticks: a float64 computation written out here one head and one query row at
a time, and torch's own ``scaled_dot_product_attention`` (with an explicit mask, because its
``is_causal`` aligns the mask top-left, which is wrong for a query block after a context).

Inputs are chosen so that a logic error is a large error, not a rounding one: queries sit after a
context of several tokens (a mask or a bias measured from the wrong place is off by whole
positions), slopes and scales are not the defaults, and where the contract says a value is never
used it holds NaN. Failures name the heads, query rows (with their positions) and keys that are
wrong. Task by task: every test uses only its task and the ones before it
(`python scripts/task_by_task.py 01-01` checks that the passing count grows after every task).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from mini_vllm.attention.reference import alibi_slopes as standard_alibi_slopes

lab = load_lab(__file__)

# (q_len, kv_len, num_heads, num_kv_heads, head_size): prefill, decode, a chunk after a context,
# one key, GQA and MQA, head sizes that are not powers of two.
SHAPES = [
    (1, 1, 1, 1, 8),
    (5, 5, 2, 2, 16),
    (1, 9, 4, 4, 16),
    (1, 17, 8, 1, 32),
    (4, 13, 8, 2, 24),
    (7, 7, 6, 3, 8),
    (3, 40, 4, 2, 64),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_DIMS = ("query row", "head", "dim")
SCORE_DIMS = ("head", "query row", "key")
# Slopes that are not ALiBi's standard ones (distinct per head, one negative), so a bias read
# from the wrong head or measured from the wrong position is off by whole units.
ODD_SLOPES = [0.5, -0.25, 1.5, 0.75, 2.0, 0.125, 1.0, 0.375]


def make_qkv(q_len, kv_len, num_heads, num_kv_heads, head_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, num_heads, head_size, generator=g)
    k = torch.randn(kv_len, num_kv_heads, head_size, generator=g)
    v = torch.randn(kv_len, num_kv_heads, head_size, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def slopes_for(num_heads, dtype=torch.float32):
    return torch.tensor((ODD_SLOPES * 2)[:num_heads], dtype=dtype)


def positions(q_len, kv_len):
    return ", ".join(f"row {i} at position {kv_len - q_len + i}" for i in range(min(q_len, 4)))


def naive_scores(q, k, *, scale=None, slopes=None, causal=True):
    """float64 logits [num_heads, q_len, kv_len], one (head, query, key) at a time."""
    q, k = q.double(), k.double()
    q_len, num_heads, head_size = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = head_size**-0.5 if scale is None else scale
    out = torch.empty(num_heads, q_len, kv_len, dtype=torch.float64)
    for h in range(num_heads):
        for i in range(q_len):
            pos = kv_len - q_len + i
            for j in range(kv_len):
                if causal and j > pos:
                    out[h, i, j] = float("-inf")
                    continue
                s = scale * float(q[i, h] @ k[j, h // group])
                if slopes is not None:
                    s += float(slopes[h]) * (j - pos)
                out[h, i, j] = s
    return out


def naive_attention(q, k, v, *, scale=None, slopes=None, causal=True):
    """float64, straight from the definition: softmax of each row of naive_scores times V."""
    scores = naive_scores(q, k, scale=scale, slopes=slopes, causal=causal)
    num_heads, q_len, _ = scores.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q_len, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        for i in range(q_len):
            w = torch.softmax(scores[h, i], dim=0)
            out[i, h] = w @ v[:, h // group].double()
    return out


def sdpa_reference(q, k, v, *, slopes=None):
    """torch SDPA in float32 with an explicit bottom-right causal mask (ALiBi as a float mask)."""
    q_len, num_heads, head_size = q.shape
    kv_len, num_kv_heads, _ = k.shape
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    keys = torch.arange(kv_len)[None, :]
    mask = torch.zeros(num_heads, q_len, kv_len)
    mask = mask.masked_fill(keys > pos, float("-inf"))
    if slopes is not None:
        mask = mask + slopes.float()[:, None, None] * (keys - pos).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(0, 1).to(q.dtype)


def assert_no_sdpa_in_source():
    source = lab.source_path.read_text(encoding="utf-8")
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    assert not re.search(r"scaled_dot_product_attention\s*\(", code), (
        f"{lab.source_path.name} calls torch's scaled_dot_product_attention; "
        "compute the attention yourself (scores, mask, softmax, weighted sum)"
    )


def bias_diagnosis(got, want):
    """A sentence when every row of (got - want) is off by one constant: ALiBi measured from
    the wrong position (which softmax cannot see, so only the bias and the scores show it)."""
    finite = torch.isfinite(want) & torch.isfinite(got)
    diff = torch.where(finite, got.double() - want.double(), torch.zeros((), dtype=torch.float64))
    if diff.shape[-1] < 2 or not bool((diff.abs() > 1e-3).any()):
        return ""
    lo = torch.where(finite, diff, torch.full_like(diff, float("inf"))).amin(dim=-1)
    hi = torch.where(finite, diff, torch.full_like(diff, float("-inf"))).amax(dim=-1)
    if bool(((hi - lo).abs() < 1e-3).all()):
        return (
            "\n  every row is off by one constant (slope times a fixed distance): the bias is "
            "measured from the wrong position. Measure j - pos_i, with pos_i = kv_len - q_len + "
            "i the query's absolute position, not its row index."
        )
    return ""


def message_has_numbers(message, *numbers):
    return all(re.search(rf"(?<![\d.]){re.escape(str(n))}(?![\d.])", message) for n in numbers)


# ---------------------------------------------------------------------------------------------
# task 1: the causal mask


@pytest.mark.parametrize(
    "q_len,kv_len", [(1, 1), (4, 4), (1, 6), (3, 8), (6, 7), (0, 5), (0, 0)], ids=str
)
def test_causal_mask_lets_each_query_see_up_to_its_own_position(q_len, kv_len):
    mask = lab.causal_mask(q_len, kv_len)
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool, (
        f"causal_mask must return a torch.bool tensor, got {getattr(mask, 'dtype', type(mask))}"
    )
    assert tuple(mask.shape) == (q_len, kv_len), f"shape {tuple(mask.shape)}"
    wrong = []
    for i in range(q_len):
        pos = kv_len - q_len + i
        seen = [j for j in range(kv_len) if bool(mask[i, j])]
        if seen != list(range(pos + 1)):
            wrong.append(f"row {i} (position {pos}) sees keys {seen}, should see 0..{pos}")
    assert not wrong, f"causal_mask({q_len}, {kv_len}): " + "; ".join(wrong)


def test_causal_mask_is_built_on_the_requested_device():
    # The meta device holds shapes only: a mask built on the CPU and not moved shows up here.
    mask = lab.causal_mask(3, 5, device="meta")
    assert mask.device.type == "meta", f"device='meta' gave a mask on {mask.device}"
    assert mask.dtype == torch.bool and tuple(mask.shape) == (3, 5), (
        f"causal_mask(3, 5, device='meta') should be a torch.bool [3, 5] mask, "
        f"got {mask.dtype} {tuple(mask.shape)}"
    )
    assert lab.causal_mask(2, 3).device == torch.empty(0).device, "default: torch's default device"


@pytest.mark.parametrize("q_len,kv_len", [(5, 4), (-1, 3), (2, -1)], ids=str)
def test_causal_mask_rejects_impossible_lengths(q_len, kv_len):
    with pytest.raises(ValueError) as info:
        lab.causal_mask(q_len, kv_len)
    assert message_has_numbers(str(info.value), q_len, kv_len), (
        f"the message should give q_len={q_len} and kv_len={kv_len}: {info.value}"
    )


# ---------------------------------------------------------------------------------------------
# task 2: the ALiBi bias


def expected_bias(slopes, q_len, kv_len):
    out = torch.empty(len(slopes), q_len, kv_len, dtype=torch.float64)
    for h in range(len(slopes)):
        for i in range(q_len):
            for j in range(kv_len):
                out[h, i, j] = float(slopes[h]) * (j - (kv_len - q_len + i))
    return out


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (3, 3), (1, 7), (2, 9), (4, 12), (0, 4)], ids=str)
def test_alibi_bias_is_slope_times_distance_from_the_query_position(q_len, kv_len):
    slopes = slopes_for(4)
    bias = lab.alibi_bias(slopes, q_len, kv_len)
    assert bias.dtype == torch.float32, f"float32 slopes must give a float32 bias, got {bias.dtype}"
    assert tuple(bias.shape) == (4, q_len, kv_len), f"shape {tuple(bias.shape)}"
    want = expected_bias(slopes, q_len, kv_len)
    try:
        assert_close(bias, want, dims=SCORE_DIMS, msg=f"alibi_bias, {positions(q_len, kv_len)}")
    except AssertionError as exc:
        raise AssertionError(str(exc) + bias_diagnosis(bias, want)) from None


@pytest.mark.parametrize(
    "slope_dtype,want",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
    ids=str,
)
def test_alibi_bias_is_computed_in_the_slopes_compute_dtype(slope_dtype, want):
    slopes = slopes_for(3, slope_dtype)
    bias = lab.alibi_bias(slopes, 2, 6)
    assert bias.dtype == want, f"{slope_dtype} slopes must give a {want} bias, got {bias.dtype}"
    assert_close(bias, expected_bias(slopes, 2, 6), dims=SCORE_DIMS, msg="alibi_bias")


def test_alibi_bias_is_built_on_the_slopes_device():
    bias = lab.alibi_bias(torch.ones(2, device="meta"), 2, 5)
    assert bias.device.type == "meta" and tuple(bias.shape) == (2, 2, 5), (
        f"slopes on the meta device gave a bias on {bias.device} with shape {tuple(bias.shape)}"
    )


def test_alibi_bias_rejects_slopes_that_are_not_one_dimensional_and_bad_lengths():
    with pytest.raises(ValueError):
        lab.alibi_bias(torch.ones(2, 2), 1, 1)
    with pytest.raises(ValueError):
        lab.alibi_bias(torch.ones(2), 4, 3)


# ---------------------------------------------------------------------------------------------
# task 3: grouped-query heads


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 4), (8, 2), (6, 3), (4, 1), (6, 2)])
def test_repeat_kv_gives_query_head_h_the_kv_head_h_div_group(num_heads, num_kv_heads):
    tokens, head_size = 3, 5
    # Entry (t, g, d) holds 100 t + 10 g + d: every token, KV head and component is distinct.
    t, g, d = torch.meshgrid(
        torch.arange(tokens), torch.arange(num_kv_heads), torch.arange(head_size), indexing="ij"
    )
    x = (100 * t + 10 * g + d).to(torch.bfloat16 if num_kv_heads == 2 else torch.float32)
    before = x.clone()
    out = lab.repeat_kv(x, num_heads)
    assert tuple(out.shape) == (tokens, num_heads, head_size), f"shape {tuple(out.shape)}"
    assert out.dtype == x.dtype, f"repeat_kv changed the dtype from {x.dtype} to {out.dtype}"
    group = num_heads // num_kv_heads
    got = [int(out[0, h, 0]) // 10 for h in range(num_heads)]
    want = [h // group for h in range(num_heads)]
    assert got == want, f"query heads read KV heads {got}; expected h // group = {want}"
    expected = torch.stack([x[:, h // group] for h in range(num_heads)], dim=1)
    assert_close(out, expected, atol=0, rtol=0, dims=("token", "head", "dim"), msg="repeat_kv")
    assert torch.equal(x, before), "repeat_kv modified its input"
    # A group of one (as many query heads as KV heads) is the input as it is.
    same = lab.repeat_kv(x, num_kv_heads)
    assert_close(same, x, atol=0, rtol=0, dims=("token", "head", "dim"),
                 msg=f"repeat_kv with num_heads = num_kv_heads = {num_kv_heads}")


@pytest.mark.parametrize(
    "shape,num_heads", [((2, 3, 4), 4), ((2, 4, 4), 6), ((2, 3), 3), ((2, 1, 3, 4), 2)], ids=str
)
def test_repeat_kv_rejects_bad_shapes_and_head_counts(shape, num_heads):
    with pytest.raises(ValueError) as info:
        lab.repeat_kv(torch.zeros(shape), num_heads)
    if len(shape) == 3:
        assert message_has_numbers(str(info.value), num_heads, shape[1]), (
            f"the message should give num_heads={num_heads} and num_kv_heads={shape[1]}: "
            f"{info.value}"
        )


# ---------------------------------------------------------------------------------------------
# task 4: scores


def check_scores(scores, want, what):
    assert tuple(scores.shape) == tuple(want.shape), f"{what}: shape {tuple(scores.shape)}"
    masked_got, masked_want = torch.isneginf(scores), torch.isneginf(want)
    if not torch.equal(masked_got, masked_want):
        bad = (masked_got != masked_want).nonzero().tolist()[:6]
        raise AssertionError(
            f"{what}: -inf in the wrong places (head, row, key): {bad}; exactly the keys after "
            "each query's position kv_len - q_len + i are -inf (and none with causal=False)"
        )
    try:
        assert_close(scores, want, dtype=torch.float32, dims=SCORE_DIMS, msg=what)
    except AssertionError as exc:
        raise AssertionError(str(exc) + bias_diagnosis(scores, want)) from None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_attention_scores_are_scaled_biased_masked_and_float32(dtype):
    # Three queries after a context of 8: a mask or bias taken from the wrong position is off by
    # whole positions; GQA 4 over 2.
    q, k, _ = make_qkv(3, 11, 4, 2, 16, dtype, seed=1)
    slopes = slopes_for(4)
    scores = lab.attention_scores(q, k, alibi_slopes=slopes)
    assert scores.dtype == torch.float32, (
        f"scores of {dtype} inputs must be float32 (accumulate in fp32), got {scores.dtype}"
    )
    check_scores(scores, naive_scores(q, k, slopes=slopes), f"attention_scores ({dtype})")


def test_attention_scores_of_half_inputs_equal_those_of_the_same_values_in_float32():
    q, k, _ = make_qkv(4, 9, 2, 1, 64, torch.float16, seed=11)
    q, k = q * 4, k * 4  # products large enough that float16 rounding would show
    half = lab.attention_scores(q, k)
    single = lab.attention_scores(q.float(), k.float())
    check_scores(single, naive_scores(q, k), "float32 inputs")
    assert_close(half, single, dtype=torch.float32, dims=SCORE_DIMS, msg="fp16 vs fp32 inputs")


def test_attention_scores_are_on_the_query_device_with_slopes_from_elsewhere():
    # The meta device holds shapes only: slopes left on the CPU, or a mask built there, cannot be
    # combined with scores on "meta" (torch refuses to mix devices).
    q, k = torch.zeros(3, 4, 8, device="meta"), torch.zeros(5, 2, 8, device="meta")
    scores = lab.attention_scores(q, k, alibi_slopes=slopes_for(4))
    assert scores.device.type == "meta" and tuple(scores.shape) == (4, 3, 5), (
        f"scores on {scores.device} with shape {tuple(scores.shape)}; want meta, (4, 3, 5)"
    )


def test_attention_scores_keep_the_compute_dtype_whatever_the_slopes_dtype():
    q, k, _ = make_qkv(2, 6, 2, 2, 8, torch.float32, seed=20)
    slopes = slopes_for(2, torch.float64)
    scores = lab.attention_scores(q, k, alibi_slopes=slopes)
    assert scores.dtype == torch.float32, (
        f"float32 inputs with float64 slopes must give float32 scores, got {scores.dtype}"
    )
    check_scores(scores, naive_scores(q, k, slopes=slopes), "float64 slopes")


def test_attention_scores_default_scale_is_one_over_sqrt_head_size():
    q, k, _ = make_qkv(2, 6, 3, 3, 24, torch.float32, seed=12)
    check_scores(lab.attention_scores(q, k), naive_scores(q, k), "default scale (24 ** -0.5)")


@pytest.mark.parametrize("scale", [0.0, 2.5, 0.05], ids=str)
def test_attention_scores_use_the_scale_they_are_given(scale):
    # scale=0.0 is a scale like any other: only the bias is left.
    q, k, _ = make_qkv(2, 7, 4, 2, 16, torch.float32, seed=13)
    slopes = slopes_for(4)
    scores = lab.attention_scores(q, k, scale=scale, alibi_slopes=slopes)
    check_scores(scores, naive_scores(q, k, scale=scale, slopes=slopes), f"scale={scale}")


@pytest.mark.parametrize("use_alibi", [False, True], ids=["no_alibi", "alibi"])
def test_attention_scores_without_the_causal_mask_mask_nothing(use_alibi):
    q, k, _ = make_qkv(3, 8, 2, 2, 8, torch.float32, seed=14)
    slopes = slopes_for(2) if use_alibi else None
    scores = lab.attention_scores(q, k, alibi_slopes=slopes, causal=False)
    check_scores(scores, naive_scores(q, k, slopes=slopes, causal=False), "causal=False")


def test_attention_scores_alibi_is_measured_from_the_query_position():
    # scale=0 leaves the bias alone; one query (a decode step) after 11 keys.
    q, k, _ = make_qkv(1, 12, 2, 1, 8, torch.float32, seed=15)
    slopes = torch.tensor([1.0, 0.5])
    scores = lab.attention_scores(q, k, scale=0.0, alibi_slopes=slopes)
    check_scores(scores, naive_scores(q, k, scale=0.0, slopes=slopes), "decode-step ALiBi bias")


def test_attention_scores_do_not_modify_their_inputs():
    q, k, _ = make_qkv(3, 5, 4, 2, 8, torch.float16, seed=16)
    slopes = slopes_for(4)
    saved = [t.clone() for t in (q, k, slopes)]
    want = naive_scores(q, k, slopes=slopes)
    scores = lab.attention_scores(q, k, alibi_slopes=slopes)
    for t, c in zip((q, k, slopes), saved):
        assert torch.equal(t, c), "attention_scores changed an input tensor in place"
    check_scores(scores, want, "attention_scores, whose inputs must stay as they were")


def test_attention_scores_reject_bad_input():
    with pytest.raises(ValueError):
        lab.attention_scores(torch.zeros(6, 2, 8), torch.zeros(5, 2, 8))  # more queries than keys
    with pytest.raises(ValueError):
        lab.attention_scores(torch.zeros(2, 3, 8), torch.zeros(5, 2, 8))  # 3 heads over 2
    with pytest.raises(ValueError):
        lab.attention_scores(torch.zeros(2, 2, 8), torch.zeros(5, 2, 8), alibi_slopes=torch.ones(3))


# ---------------------------------------------------------------------------------------------
# task 5: attention for one sequence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("use_alibi", [False, True], ids=["no_alibi", "alibi"])
def test_ref_attention_matches_float64_definition(shape, dtype, use_alibi):
    q, k, v = make_qkv(*shape, dtype)
    slopes = slopes_for(shape[2]) if use_alibi else None
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    assert out.dtype == dtype, f"output dtype must be the query dtype {dtype}, got {out.dtype}"
    # Tolerance of the input dtype: one rounding of the float32 result, nothing more.
    assert_close(
        out,
        naive_attention(q, k, v, slopes=slopes),
        dtype=dtype,
        dims=OUT_DIMS,
        msg=f"{shape}, {positions(shape[0], shape[1])}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ref_attention_matches_torch_sdpa_without_calling_it(shape, dtype):
    q, k, v = make_qkv(*shape, dtype, seed=2)
    slopes = torch.rand(shape[2]) if shape[2] > 1 else None
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    assert_close(
        out, sdpa_reference(q, k, v, slopes=slopes), dtype=dtype, dims=OUT_DIMS, msg=f"{shape}"
    )
    assert_no_sdpa_in_source()


def test_ref_attention_float64_stays_float64():
    q, k, v = make_qkv(4, 9, 4, 2, 16, torch.float64, seed=3)
    out = lab.ref_attention(q, k, v)
    assert out.dtype == torch.float64, (
        f"ref_attention on float64 inputs should return float64 (query.dtype), got {out.dtype}: "
        f"is the result cast back to query.dtype?"
    )
    assert_close(out, naive_attention(q, k, v), dims=OUT_DIMS, msg="float64")


def test_ref_attention_scale_and_non_causal():
    q, k, v = make_qkv(3, 5, 2, 1, 8, torch.float32, seed=4)
    out = lab.ref_attention(q, k, v, scale=0.3, causal=False)
    want = naive_attention(q, k, v, scale=0.3, causal=False)
    assert_close(out, want, dims=OUT_DIMS, msg="scale=0.3, causal=False")


def test_ref_attention_with_scale_zero_averages_the_visible_values():
    # With scale 0 every visible key weighs the same: row i is the mean of values 0..pos_i.
    q, k, v = make_qkv(3, 7, 2, 2, 8, torch.float32, seed=17)
    out = lab.ref_attention(q, k, v, scale=0.0)
    want = torch.stack([v[: 5 + i].double().mean(dim=0) for i in range(3)])  # pos_i = 4 + i
    assert_close(out, want, dims=OUT_DIMS, msg="scale=0.0: the mean of the visible values")


def test_ref_attention_non_causal_with_alibi_after_a_context():
    q, k, v = make_qkv(2, 9, 4, 2, 8, torch.float32, seed=18)
    slopes = slopes_for(4)
    out = lab.ref_attention(q, k, v, scale=0.7, alibi_slopes=slopes, causal=False)
    want = naive_attention(q, k, v, scale=0.7, slopes=slopes, causal=False)
    assert_close(out, want, dims=OUT_DIMS, msg="causal=False, scale=0.7, ALiBi")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_ref_attention_of_no_queries_is_empty(dtype):
    q, k, v = make_qkv(2, 5, 4, 2, 8, dtype, seed=19)
    # Two queries over these keys first (the attention is computed), then none of them.
    two = lab.ref_attention(q, k, v, alibi_slopes=slopes_for(4))
    assert_close(two, naive_attention(q, k, v, slopes=slopes_for(4)), dtype=dtype,
                 dims=OUT_DIMS, msg="two queries (before the same call with none)")
    q = q[:0]
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes_for(4))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 4, 8), (
        f"q_len == 0 must give an empty [0, 4, 8] tensor, got {getattr(out, 'shape', out)}"
    )
    assert out.dtype == dtype, f"empty output must still be {dtype}, got {out.dtype}"


def test_ref_attention_survives_huge_logits():
    # Logits near +-1e4: exp() of them overflows float32 unless the row max is subtracted.
    q, k, v = make_qkv(4, 8, 2, 2, 16, torch.float32, seed=5)
    q = q * 400.0
    out = lab.ref_attention(q, k, v)
    assert torch.isfinite(out).all(), "huge logits gave inf/nan: subtract the max before exp"
    assert_close(out, naive_attention(q, k, v), dims=OUT_DIMS, msg="huge logits")


def test_ref_attention_does_not_modify_its_inputs():
    q, k, v = make_qkv(3, 5, 4, 2, 8, torch.float32, seed=6)
    copies = [t.clone() for t in (q, k, v)]
    slopes = standard_alibi_slopes(4)
    want = naive_attention(q, k, v, slopes=slopes)
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c), "ref_attention changed an input tensor in place"
    assert_close(out, want, dims=OUT_DIMS, msg="ref_attention, whose inputs must stay as they were")


@pytest.mark.parametrize(
    "q_shape,kv_shape,v_shape,slopes",
    [
        ((3, 3, 8), (5, 2, 8), (5, 2, 8), None),  # 3 heads over 2 KV heads
        ((6, 2, 8), (5, 2, 8), (5, 2, 8), None),  # more queries than keys
        ((3, 2, 8), (5, 2, 4), (5, 2, 4), None),  # head sizes differ
        ((3, 4, 8), (5, 2, 8), (5, 2, 8), torch.ones(3)),  # wrong number of slopes
        ((3, 2, 8), (5, 2, 8), (4, 2, 8), None),  # key and value differ
    ],
)
def test_ref_attention_rejects_bad_shapes(q_shape, kv_shape, v_shape, slopes):
    with pytest.raises(ValueError):
        lab.ref_attention(
            torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(v_shape), alibi_slopes=slopes
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_ref_attention_of_no_queries_still_rejects_wrong_slopes(dtype):
    # The checks come before the q_len == 0 shortcut: 3 slopes for 4 heads is an error even when
    # there is nothing to attend.
    q, k, v = make_qkv(0, 5, 4, 2, 8, dtype, seed=19)
    with pytest.raises(ValueError):
        lab.ref_attention(q, k, v, alibi_slopes=torch.ones(3))


@given(
    q_len=st.integers(1, 6),
    context=st.integers(0, 10),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_size=st.sampled_from([4, 8, 12]),
    use_alibi=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ref_attention_any_shape_matches_definition(
    q_len, context, num_kv_heads, group, head_size, use_alibi, seed
):
    num_heads = num_kv_heads * group
    q, k, v = make_qkv(
        q_len, q_len + context, num_heads, num_kv_heads, head_size, torch.float64, seed
    )
    slopes = torch.rand(num_heads, dtype=torch.float64) if use_alibi else None
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    assert_close(out, naive_attention(q, k, v, slopes=slopes), dims=OUT_DIMS, msg="any shape")


# ---------------------------------------------------------------------------------------------
# task 6: a ragged batch


def pack(seqs, dtype=torch.float32):
    """(q_len, kv_len) per sequence -> packed q, k, v and both cu_seqlens."""
    g = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_size = 4, 2, 16
    q = torch.randn(sum(a for a, _ in seqs), num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(sum(b for _, b in seqs), num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(sum(b for _, b in seqs), num_kv_heads, head_size, generator=g).to(dtype)
    cu_q = torch.tensor([0] + [a for a, _ in seqs]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in seqs]).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


# prefills, decodes and chunks after a context, in one batch; a sequence with no query tokens.
RAGGED = [(5, 5), (1, 12), (3, 9), (1, 1), (0, 4), (7, 7)]


def check_each_sequence(out, q, k, v, cu_q, cu_k, seqs, **kwargs):
    for s, (a, b) in enumerate(seqs):
        qs, ks = int(cu_q[s]), int(cu_k[s])
        want = naive_attention(q[qs : qs + a], k[ks : ks + b], v[ks : ks + b], **kwargs)
        assert_close(
            out[qs : qs + a],
            want,
            dtype=q.dtype,
            dims=OUT_DIMS,
            msg=f"sequence {s} (q_len={a}, kv_len={b}; its query rows {qs}..{qs + a - 1})",
        )


@pytest.mark.parametrize("use_alibi", [False, True], ids=["no_alibi", "alibi"])
def test_varlen_attention_attends_each_sequence_on_its_own(use_alibi):
    q, k, v, cu_q, cu_k = pack(RAGGED)
    slopes = slopes_for(4) if use_alibi else None
    out = lab.ref_varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    assert tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype, (
        f"ref_varlen_attention should return a tensor like query, {tuple(q.shape)} {q.dtype}, "
        f"got {tuple(out.shape)} {out.dtype}"
    )
    check_each_sequence(out, q, k, v, cu_q, cu_k, RAGGED, slopes=slopes)


def test_varlen_attention_passes_scale_and_causal_on_to_every_sequence():
    q, k, v, cu_q, cu_k = pack(RAGGED)
    slopes = slopes_for(4)
    out = lab.ref_varlen_attention(
        q, k, v, cu_q, cu_k, scale=0.6, alibi_slopes=slopes, causal=False
    )
    check_each_sequence(out, q, k, v, cu_q, cu_k, RAGGED, scale=0.6, slopes=slopes, causal=False)


def test_varlen_attention_returns_the_query_dtype():
    q, k, v, cu_q, cu_k = pack(RAGGED, torch.bfloat16)
    out = lab.ref_varlen_attention(q, k, v, cu_q, cu_k)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(q.shape), (
        f"ref_varlen_attention on bfloat16 inputs should return bfloat16 {tuple(q.shape)}, "
        f"got {out.dtype} {tuple(out.shape)}"
    )
    check_each_sequence(out, q, k, v, cu_q, cu_k, RAGGED)


# Sequences with query rows: one without (RAGGED[4]) has no output row that NaN could reach.
@pytest.mark.parametrize("s", [s for s, (q_len, _) in enumerate(RAGGED) if q_len])
def test_varlen_attention_never_reads_another_sequences_rows(s):
    # Every row that belongs to another sequence holds NaN: none of it may reach sequence s.
    q, k, v, cu_q, cu_k = pack(RAGGED)
    qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
    junk = [t.clone() for t in (q, k, v)]
    for t, (a, b) in zip(junk, ((qs, qe), (ks, ke), (ks, ke))):
        t[:a] = float("nan")
        t[b:] = float("nan")
    out = lab.ref_varlen_attention(*junk, cu_q, cu_k)
    want = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke])
    assert_close(
        out[qs:qe], want, dims=OUT_DIMS, msg=f"sequence {s} with every other row set to NaN"
    )


@pytest.mark.parametrize(
    "cu_q,cu_k",
    [
        ([0, 5, 6], [0, 5, 17]),  # does not end at the packed length (q has 9 rows)
        ([0, 6, 9], [0, 5, 12]),  # sequence 0: 6 queries, 5 keys
        ([0, 9], [0, 5, 12]),  # different numbers of sequences
        ([0, 6, 5, 9], [0, 6, 10, 12]),  # decreasing offsets
    ],
)
def test_varlen_attention_rejects_bad_offsets(cu_q, cu_k):
    q, k, v = make_qkv(9, 12, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError):
        lab.ref_varlen_attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k))


@pytest.mark.parametrize(
    "cu_q,cu_k,bad",
    [
        ([0, 2, 3, 8, 9], [0, 3, 9, 13, 15], (2, 5, 4)),  # in the middle, after good ones
        ([0, 2, 3, 4, 11], [0, 3, 9, 15, 21], (3, 7, 6)),  # the last one
        ([0, 1, 8], [0, 1, 3], (1, 7, 2)),  # more queries than keys in the whole batch too
    ],
    ids=["middle", "last", "all"],
)
def test_varlen_attention_names_the_sequence_with_more_queries_than_keys(cu_q, cu_k, bad):
    q, k, v = make_qkv(cu_q[-1], cu_k[-1], 2, 1, 8, torch.float32)
    with pytest.raises(ValueError) as info:
        lab.ref_varlen_attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k))
    s, q_len, kv_len = bad
    assert message_has_numbers(str(info.value), s, q_len, kv_len), (
        f"the message should name sequence {s}, its {q_len} queries and its {kv_len} keys: "
        f"{info.value}"
    )


def test_varlen_attention_checks_the_slopes_even_for_a_batch_of_no_sequences():
    # No sequence means no ref_attention call to catch them: the batch's own check must.
    q, k, v = make_qkv(0, 0, 4, 2, 8, torch.float32)
    empty = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError):
        lab.ref_varlen_attention(q, k, v, empty, empty, alibi_slopes=torch.ones(3))
    out = lab.ref_varlen_attention(q, k, v, empty, empty, alibi_slopes=torch.ones(4))
    assert tuple(out.shape) == (0, 4, 8), f"an empty batch gives an empty output, got {out.shape}"


def test_varlen_attention_rejects_float_offsets():
    q, k, v = make_qkv(3, 5, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError):
        lab.ref_varlen_attention(q, k, v, torch.tensor([0.0, 3.0]), torch.tensor([0.0, 5.0]))
