"""Graded tests for lab 01-01: scaled dot-product attention.

Two independent yardsticks: a float64 computation written out here one head and one query row at
a time, and torch's own ``scaled_dot_product_attention`` (with an explicit mask, because its
``is_causal`` aligns the mask top-left, which is wrong for a query block after a context).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.loader import load_lab
from course.numerics import assert_close
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


def make_qkv(q_len, kv_len, num_heads, num_kv_heads, head_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, num_heads, head_size, generator=g)
    k = torch.randn(kv_len, num_kv_heads, head_size, generator=g)
    v = torch.randn(kv_len, num_kv_heads, head_size, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def naive_attention(q, k, v, *, scale=None, slopes=None, causal=True):
    """float64, one (head, query) at a time, straight from the definition."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, head_size = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = head_size**-0.5 if scale is None else scale
    out = torch.zeros(q_len, num_heads, head_size, dtype=torch.float64)
    for h in range(num_heads):
        kv_h = h // group
        for i in range(q_len):
            pos = kv_len - q_len + i
            logits = []
            for j in range(kv_len):
                if causal and j > pos:
                    logits.append(float("-inf"))
                    continue
                s = scale * float(q[i, h] @ k[j, kv_h])
                if slopes is not None:
                    s += float(slopes[h]) * (j - pos)
                logits.append(s)
            w = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)
            out[i, h] = w @ v[:, kv_h]
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


# ---------------------------------------------------------------------------------------------
# task 1: the causal mask


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (4, 4), (1, 6), (3, 8), (0, 5)])
def test_causal_mask_lets_each_query_see_up_to_its_own_position(q_len, kv_len):
    mask = lab.causal_mask(q_len, kv_len)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (q_len, kv_len)
    for i in range(q_len):
        pos = kv_len - q_len + i
        for j in range(kv_len):
            assert bool(mask[i, j]) == (j <= pos), (
                f"mask[{i}, {j}] for q_len={q_len}, kv_len={kv_len}: query {i} sits at position "
                f"{pos} and must {'see' if j <= pos else 'not see'} key {j}"
            )


def test_causal_mask_rejects_more_queries_than_keys():
    with pytest.raises(ValueError):
        lab.causal_mask(5, 4)


# ---------------------------------------------------------------------------------------------
# task 2: the ALiBi bias


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (3, 3), (1, 7), (2, 9)])
def test_alibi_bias_is_slope_times_distance_to_the_query(q_len, kv_len):
    slopes = standard_alibi_slopes(4)
    bias = lab.alibi_bias(slopes, q_len, kv_len)
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (4, q_len, kv_len)
    expected = torch.empty(4, q_len, kv_len)
    for h in range(4):
        for i in range(q_len):
            for j in range(kv_len):
                expected[h, i, j] = float(slopes[h]) * (j - (kv_len - q_len + i))
    assert_close(bias, expected, msg="alibi_bias")


def test_alibi_bias_rejects_slopes_that_are_not_one_dimensional():
    with pytest.raises(ValueError):
        lab.alibi_bias(torch.ones(2, 2), 1, 1)


# ---------------------------------------------------------------------------------------------
# task 3: grouped-query heads


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3), (4, 1)])
def test_repeat_kv_gives_query_head_h_the_kv_head_h_div_group(num_heads, num_kv_heads):
    tokens, head_size = 3, 5
    # Each KV head is filled with its own index, so the output shows which head went where.
    x = torch.arange(num_kv_heads, dtype=torch.float32)[None, :, None].expand(
        tokens, num_kv_heads, head_size
    )
    out = lab.repeat_kv(x, num_heads)
    assert tuple(out.shape) == (tokens, num_heads, head_size)
    group = num_heads // num_kv_heads
    got = [int(out[0, h, 0]) for h in range(num_heads)]
    want = [h // group for h in range(num_heads)]
    assert got == want, f"query heads read KV heads {got}; expected h // group = {want}"


def test_repeat_kv_rejects_a_head_count_that_is_not_a_multiple():
    with pytest.raises(ValueError):
        lab.repeat_kv(torch.zeros(2, 3, 4), 4)


# ---------------------------------------------------------------------------------------------
# task 4: scores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_attention_scores_are_masked_scaled_and_float32(dtype):
    q, k, _ = make_qkv(3, 6, 4, 2, 16, dtype, seed=1)
    slopes = standard_alibi_slopes(4)
    scores = lab.attention_scores(q, k, alibi_slopes=slopes)
    assert scores.dtype == torch.float32, (
        f"scores of {dtype} inputs must be float32 (accumulate in fp32), got {scores.dtype}"
    )
    assert tuple(scores.shape) == (4, 3, 6)
    expected = torch.empty(4, 3, 6, dtype=torch.float64)
    qd, kd = q.double(), k.double()
    for h in range(4):
        for i in range(3):
            pos = 3 + i
            for j in range(6):
                if j > pos:
                    expected[h, i, j] = float("-inf")
                else:
                    s = float(qd[i, h] @ kd[j, h // 2]) / 4.0 + float(slopes[h]) * (j - pos)
                    expected[h, i, j] = s
    assert_close(scores, expected, dtype=torch.float32, msg="attention_scores")


# ---------------------------------------------------------------------------------------------
# task 5: attention for one sequence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("use_alibi", [False, True], ids=["no_alibi", "alibi"])
def test_ref_attention_matches_float64_definition(shape, dtype, use_alibi):
    q, k, v = make_qkv(*shape, dtype)
    slopes = standard_alibi_slopes(shape[2]) if use_alibi else None
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    assert out.dtype == dtype, f"output dtype must be the query dtype {dtype}, got {out.dtype}"
    # Tolerance of the input dtype: one rounding of the float32 result, nothing more.
    assert_close(out, naive_attention(q, k, v, slopes=slopes), dtype=dtype, msg=f"{shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ref_attention_matches_torch_sdpa_without_calling_it(shape, dtype):
    q, k, v = make_qkv(*shape, dtype, seed=2)
    slopes = torch.rand(shape[2]) if shape[2] > 1 else None
    out = lab.ref_attention(q, k, v, alibi_slopes=slopes)
    assert_close(out, sdpa_reference(q, k, v, slopes=slopes), dtype=dtype, msg=f"{shape}")
    assert_no_sdpa_in_source()


def test_ref_attention_float64_stays_float64():
    q, k, v = make_qkv(4, 9, 4, 2, 16, torch.float64, seed=3)
    out = lab.ref_attention(q, k, v)
    assert out.dtype == torch.float64
    assert_close(out, naive_attention(q, k, v), msg="float64")


def test_ref_attention_scale_and_non_causal():
    q, k, v = make_qkv(3, 5, 2, 1, 8, torch.float32, seed=4)
    out = lab.ref_attention(q, k, v, scale=0.3, causal=False)
    assert_close(out, naive_attention(q, k, v, scale=0.3, causal=False), msg="scale=0.3")


def test_ref_attention_survives_huge_logits():
    # Logits near +-1e4: exp() of them overflows float32 unless the row max is subtracted.
    q, k, v = make_qkv(4, 8, 2, 2, 16, torch.float32, seed=5)
    q = q * 400.0
    out = lab.ref_attention(q, k, v)
    assert torch.isfinite(out).all(), "huge logits gave inf/nan: subtract the max before exp"
    assert_close(out, naive_attention(q, k, v), msg="huge logits")


def test_ref_attention_does_not_modify_its_inputs():
    q, k, v = make_qkv(3, 5, 4, 2, 8, torch.float32, seed=6)
    copies = [t.clone() for t in (q, k, v)]
    lab.ref_attention(q, k, v, alibi_slopes=standard_alibi_slopes(4))
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c), "ref_attention changed an input tensor in place"


@pytest.mark.parametrize(
    "q_shape,kv_shape,slopes",
    [
        ((3, 3, 8), (5, 2, 8), None),  # 3 heads over 2 KV heads
        ((6, 2, 8), (5, 2, 8), None),  # more queries than keys
        ((3, 2, 8), (5, 2, 4), None),  # head sizes differ
        ((3, 4, 8), (5, 2, 8), torch.ones(3)),  # wrong number of slopes
    ],
)
def test_ref_attention_rejects_bad_shapes(q_shape, kv_shape, slopes):
    with pytest.raises(ValueError):
        lab.ref_attention(
            torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape), alibi_slopes=slopes
        )


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
    assert_close(out, naive_attention(q, k, v, slopes=slopes), msg="hypothesis case")


# ---------------------------------------------------------------------------------------------
# task 6: a ragged batch


def pack(seqs):
    """(q_len, kv_len) per sequence -> packed q, k, v and both cu_seqlens."""
    g = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_size = 4, 2, 16
    q = torch.randn(sum(a for a, _ in seqs), num_heads, head_size, generator=g)
    k = torch.randn(sum(b for _, b in seqs), num_kv_heads, head_size, generator=g)
    v = torch.randn(sum(b for _, b in seqs), num_kv_heads, head_size, generator=g)
    cu_q = torch.tensor([0] + [a for a, _ in seqs]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in seqs]).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


# prefills, decodes and chunks after a context, in one batch; a sequence with no query tokens.
RAGGED = [(5, 5), (1, 12), (3, 9), (1, 1), (0, 4), (7, 7)]


@pytest.mark.parametrize("use_alibi", [False, True], ids=["no_alibi", "alibi"])
def test_varlen_attention_attends_each_sequence_on_its_own(use_alibi):
    q, k, v, cu_q, cu_k = pack(RAGGED)
    slopes = standard_alibi_slopes(4) if use_alibi else None
    out = lab.ref_varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    assert tuple(out.shape) == tuple(q.shape)
    for s, (a, b) in enumerate(RAGGED):
        qs, ks = int(cu_q[s]), int(cu_k[s])
        want = naive_attention(q[qs : qs + a], k[ks : ks + b], v[ks : ks + b], slopes=slopes)
        assert_close(out[qs : qs + a], want, msg=f"sequence {s} (q_len={a}, kv_len={b})")


def test_varlen_attention_does_not_leak_between_sequences():
    q, k, v, cu_q, cu_k = pack(RAGGED)
    before = lab.ref_varlen_attention(q, k, v, cu_q, cu_k)
    k2, v2 = k.clone(), v.clone()
    k2[int(cu_k[2]) : int(cu_k[3])] += 5.0  # change only sequence 2's keys and values
    v2[int(cu_k[2]) : int(cu_k[3])] -= 5.0
    after = lab.ref_varlen_attention(q, k2, v2, cu_q, cu_k)
    for s in range(len(RAGGED)):
        sl = slice(int(cu_q[s]), int(cu_q[s + 1]))
        if s == 2:
            assert not torch.allclose(before[sl], after[sl]), "sequence 2 ignored its own keys"
        else:
            assert torch.equal(before[sl], after[sl]), f"sequence {s} saw sequence 2's keys"


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
