"""Graded tests for lab 01-02: online softmax.

The yardstick is lab 01's reference (``mini_vllm.attention.reference``) and, for the state
itself, softmax over all keys at once in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.loader import load_lab
from course.numerics import assert_close
from mini_vllm.attention.reference import ref_attention

lab = load_lab(__file__)

NEG_INF = float("-inf")


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def full_softmax(scores, values):
    """softmax(scores) @ values over the last dimension, in float64, rows of all -inf give 0."""
    s, v = scores.double(), values.double()
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    return (p @ v) / torch.where(total > 0, total, torch.ones_like(total)), m.squeeze(-1), total


def run_blocks(scores, values, cuts):
    """Fold blocks [0,c0), [c0,c1), ..., [c_last, n) into a fresh state with the lab's update."""
    H, Q, n = scores.shape
    state = lab.SoftmaxState.initial((H, Q), values.shape[-1], dtype=scores.dtype)
    edges = [0, *cuts, n]
    for a, b in zip(edges[:-1], edges[1:]):
        state = lab.online_update(state, scores[..., a:b], values[:, a:b])
    return state


def partial_of(scores, values):
    """A Partial for one block, from a fresh state."""
    H, Q, _ = scores.shape
    state = lab.SoftmaxState.initial((H, Q), values.shape[-1], dtype=scores.dtype)
    return lab.finalize(lab.online_update(state, scores, values))


# ---------------------------------------------------------------------------------------------
# task 1: one update


def test_one_block_gives_the_running_max_sum_and_accumulator():
    scores, values = rand(2, 3, 7, seed=1), rand(2, 7, 4, seed=2)
    state = lab.online_update(
        lab.SoftmaxState.initial((2, 3), 4, dtype=torch.float64), scores, values
    )
    m = scores.amax(dim=-1)
    p = torch.exp(scores - m[..., None])
    assert_close(state.max_logit, m, msg="max_logit")
    assert_close(state.exp_sum, p.sum(dim=-1), msg="exp_sum")
    assert_close(state.acc, p @ values, msg="acc (not divided by the sum yet)")


def test_a_larger_later_maximum_rescales_what_was_summed_before():
    scores, values = rand(1, 2, 6, seed=3), rand(1, 6, 3, seed=4)
    scores[..., 4] += 8.0  # the second block holds the largest score of every row
    state = run_blocks(scores, values, [3])
    m = scores.amax(dim=-1)
    p = torch.exp(scores - m[..., None])
    assert_close(state.max_logit, m, msg="max_logit after two blocks")
    assert_close(state.exp_sum, p.sum(dim=-1), msg="exp_sum after two blocks")
    assert_close(state.acc, p @ values, msg="acc after two blocks")


def test_empty_and_fully_masked_blocks_change_nothing():
    scores, values = rand(2, 2, 5, seed=5), rand(2, 5, 3, seed=6)
    state = run_blocks(scores, values, [])
    empty = lab.online_update(state, scores[..., :0], values[:, :0])
    masked = lab.online_update(
        state, torch.full((2, 2, 3), NEG_INF, dtype=torch.float64), rand(2, 3, 3, seed=7)
    )
    for name, new in (("empty block", empty), ("fully masked block", masked)):
        for field in ("max_logit", "exp_sum", "acc"):
            assert torch.equal(getattr(new, field), getattr(state, field)), f"{name}: {field}"


def test_a_fully_masked_first_block_gives_no_nan():
    values = rand(1, 5, 2, seed=8)
    scores = rand(1, 1, 5, seed=9)
    scores[..., :3] = NEG_INF
    state = run_blocks(scores, values, [3])
    assert not torch.isnan(state.acc).any() and not torch.isnan(state.exp_sum).any()
    want, _, _ = full_softmax(scores, values)
    assert_close(lab.finalize(state).out, want, msg="masked first block, then keys")


def test_update_with_logits_of_plus_minus_ten_thousand_stays_finite():
    # float32 scores of +-1e4: exp(1e4) is inf, so only differences from the running max work.
    scores = torch.tensor([[[-1e4, 9990.0, 1e4, -9999.0, 9995.0, 1e4 - 3.0]]])
    values = rand(1, 6, 3, seed=23, dtype=torch.float32)
    state = run_blocks(scores, values, [2, 4])
    assert torch.isfinite(state.acc).all() and torch.isfinite(state.exp_sum).all(), (
        "logits of 1e4 overflowed: subtract the running max before exp"
    )
    want, _, _ = full_softmax(scores, values)
    assert_close(lab.finalize(state).out, want.float(), msg="+-1e4 logits")


def test_update_does_not_modify_its_arguments():
    scores, values = rand(2, 2, 4, seed=10), rand(2, 4, 3, seed=11)
    state = run_blocks(scores[..., :2], values[:, :2], [])
    saved = [t.clone() for t in (*state, scores, values)]
    lab.online_update(state, scores[..., 2:], values[:, 2:])
    for before, after in zip(saved, (*state, scores, values)):
        assert torch.equal(before, after), "online_update changed an argument in place"


def test_update_rejects_scores_that_do_not_fit_the_state():
    state = lab.SoftmaxState.initial((2, 3), 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        lab.online_update(state, rand(2, 4, 5), rand(2, 5, 4))
    with pytest.raises(ValueError):
        lab.online_update(state, rand(2, 3, 5), rand(2, 6, 4))


# ---------------------------------------------------------------------------------------------
# task 2: finalize


def test_finalize_divides_by_the_sum_and_gives_zero_for_no_keys():
    scores, values = rand(2, 3, 6, seed=12), rand(2, 6, 4, seed=13)
    scores[1, 2] = NEG_INF  # one row sees nothing
    part = lab.finalize(run_blocks(scores, values, [2, 4]))
    want, m, total = full_softmax(scores, values)
    assert_close(part.out, want, msg="out")
    assert_close(part.exp_sum, total.squeeze(-1), msg="exp_sum")
    assert float(part.exp_sum[1, 2]) == 0.0 and bool(torch.isneginf(part.max_logit[1, 2]))
    assert torch.equal(part.out[1, 2], torch.zeros(4, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# tasks 3 and 4: merging partials


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_merge_of_two_halves_equals_the_whole(cut):
    scores, values = rand(3, 2, 6, seed=14), rand(3, 6, 5, seed=15)
    scores[0, :, cut:] += 6.0  # different maxima on the two sides
    scores[2, :, :cut] += 6.0
    merged = lab.merge_partials(
        partial_of(scores[..., :cut], values[:, :cut]),
        partial_of(scores[..., cut:], values[:, cut:]),
    )
    want, m, total = full_softmax(scores, values)
    assert_close(merged.out, want, msg="merged out")
    assert_close(merged.max_logit, m, msg="merged max_logit")
    assert_close(merged.exp_sum, total.squeeze(-1), msg="merged exp_sum")
    assert_close(merged.lse, torch.logsumexp(scores, dim=-1), msg="merged lse")


def test_merge_with_an_empty_side_returns_the_other_side():
    scores, values = rand(2, 2, 4, seed=16), rand(2, 4, 3, seed=17)
    full = partial_of(scores, values)
    empty = partial_of(torch.full((2, 2, 3), NEG_INF, dtype=torch.float64), rand(2, 3, 3))
    for merged in (lab.merge_partials(full, empty), lab.merge_partials(empty, full)):
        assert_close(merged.out, full.out, msg="merge with empty")
        assert_close(merged.exp_sum, full.exp_sum, msg="merge with empty: exp_sum")
    both = lab.merge_partials(empty, empty)
    assert not torch.isnan(both.out).any() and torch.equal(both.exp_sum, empty.exp_sum)


def test_merge_rejects_partials_of_different_shapes():
    a = partial_of(rand(2, 2, 3), rand(2, 3, 4))
    b = partial_of(rand(2, 3, 3), rand(2, 3, 4))
    with pytest.raises(ValueError):
        lab.merge_partials(a, b)


@pytest.mark.parametrize("cuts", [[2], [1, 4, 6], [0, 3, 3, 8], [8]])
def test_reduce_of_many_partials_equals_the_whole(cuts):
    scores, values = rand(2, 3, 8, seed=18), rand(2, 8, 4, seed=19)
    scores[1, :, 5:] -= 7.0
    scores[0, :, 6] += 9.0
    edges = [0, *cuts, 8]
    parts = [partial_of(scores[..., a:b], values[:, a:b]) for a, b in zip(edges, edges[1:])]
    reduced = lab.reduce_partials(
        torch.stack([p.out for p in parts], dim=-2),
        torch.stack([p.max_logit for p in parts], dim=-1),
        torch.stack([p.exp_sum for p in parts], dim=-1),
    )
    want, m, total = full_softmax(scores, values)
    assert_close(reduced.out, want, msg=f"reduce over {len(parts)} partials")
    assert_close(reduced.exp_sum, total.squeeze(-1), msg="reduced exp_sum")


def test_reduce_rejects_zero_partials():
    with pytest.raises(ValueError):
        lab.reduce_partials(torch.zeros(2, 0, 4), torch.zeros(2, 0), torch.zeros(2, 0))


# ---------------------------------------------------------------------------------------------
# tasks 5 and 6: attention over blocks equals lab 01


def make_qkv(q_len, kv_len, num_heads, num_kv_heads, head_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(n, h, head_size, generator=g).to(dtype)
        for n, h in ((q_len, num_heads), (kv_len, num_kv_heads), (kv_len, num_kv_heads))
    )


@st.composite
def attention_case(draw):
    q_len = draw(st.integers(1, 5))
    kv_len = q_len + draw(st.integers(0, 12))
    num_kv_heads = draw(st.integers(1, 2))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    # Split points anywhere in [0, kv_len], repeats allowed: empty blocks, a block after the last
    # visible key of the early queries (fully masked for them), single keys.
    cuts = sorted(draw(st.lists(st.integers(0, kv_len), max_size=6)))
    use_alibi = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return q_len, kv_len, num_heads, num_kv_heads, cuts, use_alibi, seed


@given(attention_case())
def test_any_split_of_the_keys_gives_lab_01_attention(case):
    q_len, kv_len, num_heads, num_kv_heads, cuts, use_alibi, seed = case
    q, k, v = make_qkv(q_len, kv_len, num_heads, num_kv_heads, 8, torch.float64, seed)
    slopes = torch.rand(num_heads, dtype=torch.float64) if use_alibi else None
    want = ref_attention(q, k, v, alibi_slopes=slopes)
    got = lab.blockwise_attention(q, k, v, cuts, alibi_slopes=slopes)
    assert_close(got, want, msg=f"blockwise_attention, cuts={cuts}")
    got = lab.split_kv_attention(q, k, v, cuts, alibi_slopes=slopes)
    assert_close(got, want, msg=f"split_kv_attention, cuts={cuts}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", ["blockwise_attention", "split_kv_attention"])
def test_block_attention_in_half_precision_matches_lab_01(fn, dtype):
    q, k, v = make_qkv(3, 21, 4, 2, 16, dtype, seed=20)
    out = getattr(lab, fn)(q, k, v, [4, 4, 9, 16])
    assert out.dtype == dtype, f"{fn} must return the query dtype"
    assert_close(out, ref_attention(q, k, v), msg=fn)


@pytest.mark.parametrize("fn", ["blockwise_attention", "split_kv_attention"])
def test_logits_of_ten_thousand_do_not_overflow(fn):
    # Scores near +-1e4 in float32: exp() without subtracting the running max overflows to inf.
    q, k, v = make_qkv(2, 12, 2, 1, 16, torch.float32, seed=21)
    q = q / q.norm(dim=-1, keepdim=True) * 1e4 * 4.0  # scale = 1/4, so |score| ~ 1e4 |cos|
    k = k / k.norm(dim=-1, keepdim=True)
    out = getattr(lab, fn)(q, k, v, [3, 7], causal=False)
    assert torch.isfinite(out).all(), f"{fn}: logits of 1e4 overflowed"
    want = ref_attention(q.double(), k.double(), v.double(), causal=False)
    assert_close(out, want.float(), msg=f"{fn} with huge logits")


@pytest.mark.parametrize("cuts", [[5, 2], [-1], [13]])
def test_bad_boundaries_are_rejected(cuts):
    q, k, v = make_qkv(2, 12, 2, 1, 8, torch.float32, seed=22)
    with pytest.raises(ValueError):
        lab.blockwise_attention(q, k, v, cuts)
    with pytest.raises(ValueError):
        lab.split_kv_attention(q, k, v, cuts)
