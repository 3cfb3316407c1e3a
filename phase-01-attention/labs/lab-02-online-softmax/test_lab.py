"""Graded tests for lab 01-02: online softmax.

The yardstick is lab 01's reference (``mini_vllm.attention.reference``) and, for the state
itself, softmax over all keys at once in float64. Inputs are chosen so that a logic error is a
large error: maxima that rise in some rows and fall in others between blocks (a sum or an
accumulator left relative to the wrong maximum is off by a factor like ``e^6``), junk values
behind masked keys, scales and slopes that are not the defaults. Failures name the heads, query
rows and components that are wrong. Task by task: every test uses only its task and the ones
before it (`python scripts/task_by_task.py 01-02` checks that the passing count grows after
every task).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from course.student.measure import peak_tensor_bytes
from mini_vllm.attention.reference import ref_attention

lab = load_lab(__file__)

NEG_INF = float("-inf")
ROW_DIMS = ("head", "query row")
ACC_DIMS = ("head", "query row", "dim")
OUT_DIMS = ("query row", "head", "dim")
FNS = ["blockwise_attention", "split_kv_attention"]


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def full_softmax(scores, values):
    """softmax(scores) @ values over the last dimension, in float64, rows of all -inf give 0.
    Returns (out, max, sum) with max and sum of shape S."""
    s, v = scores.double(), values.double()
    if s.shape[-1] == 0:  # no keys: the empty partial
        S = s.shape[:-1]
        return v.new_zeros(*S, v.shape[-1]), s.new_full(S, NEG_INF), s.new_zeros(S)
    m = s.amax(dim=-1, keepdim=True)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - safe)
    total = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(total > 0, total, torch.ones_like(total))
    return out, m.squeeze(-1), total.squeeze(-1)


def full_state(scores, values):
    """The exact running state over all keys at once: (max, sum, acc) in float64."""
    s, v = scores.double(), values.double()
    m = s.amax(dim=-1)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - safe[..., None])
    return m, p.sum(dim=-1), p @ v


def assert_state(state, scores, values, what):
    m, total, acc = full_state(scores, values)
    for name, got, want, dims in (
        ("max_logit", state.max_logit, m, ROW_DIMS),
        ("exp_sum", state.exp_sum, total, ROW_DIMS),
        ("acc (not divided by the sum yet)", state.acc, acc, ACC_DIMS),
    ):
        assert not torch.isnan(got).any(), f"{what}: {name} holds NaN"
        assert_close(got, want, dtype=torch.float64, dims=dims, msg=f"{what}: {name}")


def run_blocks(scores, values, cuts):
    """Fold blocks [0,c0), [c0,c1), ..., [c_last, n) into a fresh state with the lab's update."""
    H, Q, n = scores.shape
    state = lab.SoftmaxState.initial((H, Q), values.shape[-1], dtype=scores.dtype)
    edges = [0, *cuts, n]
    for a, b in zip(edges[:-1], edges[1:]):
        state = lab.online_update(state, scores[..., a:b], values[:, a:b])
    return state


def partial_of(scores, values):
    """A Partial for one block, computed here (not with the lab's code): out, max, sum."""
    out, m, total = full_softmax(scores, values)
    return lab.Partial(out, m, total)


def empty_partial(H, Q, D):
    return lab.Partial(
        torch.zeros(H, Q, D, dtype=torch.float64),
        torch.full((H, Q), NEG_INF, dtype=torch.float64),
        torch.zeros(H, Q, dtype=torch.float64),
    )


def assert_partial(got, scores, values, what):
    out, m, total = full_softmax(scores, values)
    assert not torch.isnan(got.out).any(), f"{what}: out holds NaN"
    assert_close(got.out, out, dtype=torch.float64, dims=ACC_DIMS, msg=f"{what}: out")
    assert_close(got.max_logit, m, dtype=torch.float64, dims=ROW_DIMS, msg=f"{what}: max_logit")
    assert_close(got.exp_sum, total, dtype=torch.float64, dims=ROW_DIMS, msg=f"{what}: exp_sum")


def rising_and_falling(H=3, Q=2, n=8, cut=4, seed=0):
    """Scores where head 0's maximum comes in the second block, head 1's in the first, head 2's
    in neither by much: a state rescaled the wrong way is off by about e^6 in some head."""
    scores = rand(H, Q, n, seed=seed)
    scores[0, :, cut:] += 6.0
    scores[1, :, :cut] += 6.0
    return scores, rand(H, n, 5, seed=seed + 1)


# ---------------------------------------------------------------------------------------------
# task 1: one update


def test_one_block_gives_the_running_max_sum_and_accumulator():
    scores, values = rand(2, 3, 7, seed=1), rand(2, 7, 4, seed=2)
    state = lab.online_update(
        lab.SoftmaxState.initial((2, 3), 4, dtype=torch.float64), scores, values
    )
    assert_state(state, scores, values, "one block")


@pytest.mark.parametrize("cuts", [[4], [2, 4, 6], [1, 7]], ids=str)
def test_later_blocks_with_larger_and_smaller_maxima_give_the_whole_state(cuts):
    # Head 0's maximum arrives late (the old sum and accumulator must shrink by
    # exp(old - new)); head 1's arrives first (later blocks are taken relative to the old
    # maximum, not their own).
    scores, values = rising_and_falling(cut=4, seed=3)
    state = run_blocks(scores, values, cuts)
    assert_state(state, scores, values, f"blocks cut at {cuts}")


def test_empty_and_fully_masked_blocks_change_nothing():
    scores, values = rand(2, 2, 5, seed=5), rand(2, 5, 3, seed=6)
    state = run_blocks(scores, values, [])
    assert_state(state, scores, values, "one block (before the empty and fully masked ones)")
    junk = torch.full((2, 3, 3), 1e6, dtype=torch.float64)  # masked keys: their values are junk
    junk[1] = -3e7
    empty = lab.online_update(state, scores[..., :0], values[:, :0])
    masked = lab.online_update(state, torch.full((2, 2, 3), NEG_INF, dtype=torch.float64), junk)
    for name, new in (("empty block", empty), ("fully masked block", masked)):
        for field in ("max_logit", "exp_sum", "acc"):
            assert torch.equal(getattr(new, field), getattr(state, field)), (
                f"{name} changed {field}: a block with no visible key must leave the state as "
                "it was"
            )


def test_a_block_masked_in_one_row_changes_only_the_other_rows():
    scores, values = rand(1, 2, 4, seed=24), rand(1, 4, 3, seed=25)
    state = run_blocks(scores, values, [])
    block = rand(1, 2, 3, seed=26) + 2.0
    block[0, 0] = NEG_INF  # row 0 sees none of the new keys
    new = lab.online_update(state, block, torch.full((1, 3, 3), 5e5, dtype=torch.float64))
    for field in ("max_logit", "exp_sum", "acc"):
        assert torch.equal(getattr(new, field)[0, 0], getattr(state, field)[0, 0]), (
            f"row 0 saw only masked keys, but its {field} changed"
        )
    assert_state(
        lab.SoftmaxState(*(t[:, 1:] for t in new)),
        torch.cat([scores, block], dim=-1)[:, 1:],
        torch.cat([values, torch.full((1, 3, 3), 5e5, dtype=torch.float64)], dim=1),
        "row 1 after a block it sees",
    )


def test_a_fully_masked_first_block_gives_no_nan():
    values = rand(1, 5, 2, seed=8)
    scores = rand(1, 1, 5, seed=9)
    scores[..., :3] = NEG_INF
    first = lab.online_update(
        lab.SoftmaxState.initial((1, 1), 2, dtype=torch.float64), scores[..., :3], values[:, :3]
    )
    assert bool(torch.isneginf(first.max_logit).all()), "a row with no visible key keeps -inf"
    assert not first.exp_sum.any() and not first.acc.any() and not torch.isnan(first.acc).any(), (
        "a row with no visible key keeps exp_sum = 0 and acc = 0 (no NaN from -inf - -inf)"
    )
    state = lab.online_update(first, scores[..., 3:], values[:, 3:])
    assert_state(state, scores, values, "masked first block, then keys")


@pytest.mark.parametrize(
    "state_dtype,score_dtype",
    [
        (torch.float64, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.float64),
    ],
    ids=str,
)
def test_update_works_in_the_states_dtype(state_dtype, score_dtype):
    scores, values = rising_and_falling(seed=27)
    scores, values = scores.to(score_dtype), values.to(score_dtype)
    state = lab.SoftmaxState.initial((3, 2), 5, dtype=state_dtype)
    state = lab.online_update(
        lab.online_update(state, scores[..., :4], values[:, :4]), scores[..., 4:], values[:, 4:]
    )
    for field in ("max_logit", "exp_sum", "acc"):
        assert getattr(state, field).dtype == state_dtype, (
            f"{field} is {getattr(state, field).dtype}: the state keeps its dtype {state_dtype}"
        )
    m, total, acc = full_state(scores, values)
    assert_close(state.exp_sum, total, dtype=state_dtype, dims=ROW_DIMS, msg="exp_sum")
    assert_close(state.acc, acc, dtype=state_dtype, dims=ACC_DIMS, msg="acc")


def test_update_with_logits_of_plus_minus_ten_thousand_stays_finite():
    # float32 scores of +-1e4: exp(1e4) is inf, so only differences from the running max work.
    scores = torch.tensor([[[-1e4, 9990.0, 1e4, -9999.0, 9995.0, 1e4 - 3.0]]])
    values = rand(1, 6, 3, seed=23, dtype=torch.float32)
    state = run_blocks(scores, values, [2, 4])
    assert torch.isfinite(state.acc).all() and torch.isfinite(state.exp_sum).all(), (
        "logits of 1e4 overflowed: subtract the running max before exp"
    )
    m, total, acc = full_state(scores, values)
    assert_close(state.acc, acc.float(), dims=ACC_DIMS, msg="+-1e4 logits: acc")


def test_update_does_not_modify_its_arguments():
    scores, values = rising_and_falling(seed=10)
    state = run_blocks(scores[..., :4], values[:, :4], [])
    saved = [t.clone() for t in (*state, scores, values)]
    new = lab.online_update(state, scores[..., 4:], values[:, 4:])
    for before, after in zip(saved, (*state, scores, values)):
        assert torch.equal(before, after), "online_update changed an argument in place"
    assert_state(new, scores, values, "the update, whose arguments must stay as they were")


def test_update_rejects_scores_and_values_that_do_not_fit_the_state():
    state = lab.SoftmaxState.initial((2, 3), 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        lab.online_update(state, rand(2, 4, 5), rand(2, 5, 4))  # S is [2, 4], not [2, 3]
    with pytest.raises(ValueError):
        lab.online_update(state, rand(2, 3, 5), rand(2, 6, 4))  # 6 values for 5 keys
    with pytest.raises(ValueError):
        lab.online_update(state, rand(2, 3, 5), rand(2, 5, 3))  # head_size 3, not 4


# ---------------------------------------------------------------------------------------------
# task 2: finalize


def test_finalize_divides_by_the_sum_and_gives_zero_for_no_keys():
    scores, values = rand(2, 3, 6, seed=12), rand(2, 6, 4, seed=13)
    scores[1, 2] = NEG_INF  # one row sees nothing
    state = lab.SoftmaxState(*full_state(scores, values))
    saved = [t.clone() for t in state]
    part = lab.finalize(state)
    assert_partial(part, scores, values, "finalize")
    assert float(part.exp_sum[1, 2]) == 0.0 and bool(torch.isneginf(part.max_logit[1, 2])), (
        f"finalize: row (1, 2) saw no key, so exp_sum must stay 0 and max_logit -inf, got "
        f"{float(part.exp_sum[1, 2])} and {float(part.max_logit[1, 2])}: "
        f"return the state's max_logit and exp_sum as they are"
    )
    assert torch.equal(part.out[1, 2], torch.zeros(4, dtype=torch.float64)), (
        f"a row that saw no key must give out = 0, got {part.out[1, 2].tolist()}"
    )
    for before, after in zip(saved, state):
        assert torch.equal(before, after), "finalize changed the state in place"


def test_finalize_of_a_state_that_saw_nothing_is_all_zero():
    part = lab.finalize(lab.SoftmaxState.initial((2, 3), 4, dtype=torch.float32))
    assert not torch.isnan(part.out).any(), "0 / 0 gave NaN: a row with no key has out = 0"
    assert torch.equal(part.out, torch.zeros(2, 3, 4)), (
        f"finalize of a state that saw no key must give out = float32 zeros [2, 3, 4], got "
        f"{part.out.dtype} {tuple(part.out.shape)} starting {part.out.flatten()[:4].tolist()}"
    )
    assert torch.equal(part.exp_sum, torch.zeros(2, 3)), (
        f"finalize of a state that saw no key must keep exp_sum = float32 zeros [2, 3], got "
        f"{part.exp_sum.dtype} {tuple(part.exp_sum.shape)} {part.exp_sum.flatten()[:6].tolist()}"
    )
    assert bool(torch.isneginf(part.max_logit).all()), (
        f"finalize of a state that saw no key must keep max_logit = -inf, got "
        f"{part.max_logit.flatten()[:6].tolist()}"
    )


# ---------------------------------------------------------------------------------------------
# task 3: merging two partials


@pytest.mark.parametrize("cut", [1, 3, 4, 7])
def test_merge_of_two_halves_equals_the_whole(cut):
    scores, values = rising_and_falling(cut=4, seed=14)
    a = partial_of(scores[..., :cut], values[:, :cut])
    b = partial_of(scores[..., cut:], values[:, cut:])
    merged = lab.merge_partials(a, b)
    assert_partial(merged, scores, values, f"merge at {cut}")
    assert_close(merged.lse, torch.logsumexp(scores, dim=-1), dims=ROW_DIMS, msg="merged lse")
    swapped = lab.merge_partials(b, a)
    assert_close(swapped.out, merged.out, dims=ACC_DIMS, msg="merge(b, a) against merge(a, b)")


def test_merge_with_an_empty_side_returns_the_other_side():
    scores, values = rand(2, 2, 4, seed=16), rand(2, 4, 3, seed=17)
    full = partial_of(scores, values)
    empty = empty_partial(2, 2, 3)
    for merged in (lab.merge_partials(full, empty), lab.merge_partials(empty, full)):
        assert_partial(merged, scores, values, "merge with an empty side")


def test_merge_of_two_empty_sides_is_empty_without_nan():
    # Two sides that saw keys first (the merge combines them), then two that saw none.
    scores, values = rand(2, 3, 6, seed=44), rand(2, 6, 4, seed=45)
    real = lab.merge_partials(partial_of(scores[..., :2], values[:, :2]),
                              partial_of(scores[..., 2:], values[:, 2:]))
    assert_partial(real, scores, values, "merge of two sides that saw keys")
    both = lab.merge_partials(empty_partial(2, 3, 4), empty_partial(2, 3, 4))
    assert not torch.isnan(both.out).any(), "merging two empty partials gave NaN"
    assert torch.equal(both.out, torch.zeros(2, 3, 4, dtype=torch.float64)), (
        f"merging two empty partials must give out = float64 zeros [2, 3, 4], got "
        f"{both.out.dtype} {tuple(both.out.shape)} starting {both.out.flatten()[:4].tolist()}"
    )
    assert torch.equal(both.exp_sum, torch.zeros(2, 3, dtype=torch.float64)), (
        f"merging two empty partials must give exp_sum = float64 zeros [2, 3], got "
        f"{both.exp_sum.dtype} {tuple(both.exp_sum.shape)} {both.exp_sum.flatten()[:6].tolist()}"
    )
    assert bool(torch.isneginf(both.max_logit).all()), (
        f"merging two empty partials must keep max_logit = -inf, got "
        f"{both.max_logit.flatten()[:6].tolist()}"
    )


def test_merge_where_each_side_is_empty_in_different_rows():
    scores, values = rising_and_falling(seed=28)
    scores[0, 0, :4] = NEG_INF  # row (0, 0): the first side saw nothing
    scores[1, 1, 4:] = NEG_INF  # row (1, 1): the second side saw nothing
    merged = lab.merge_partials(
        partial_of(scores[..., :4], values[:, :4]), partial_of(scores[..., 4:], values[:, 4:])
    )
    assert_partial(merged, scores, values, "sides empty in some rows")


def test_merge_does_not_modify_its_arguments():
    scores, values = rising_and_falling(seed=29)
    a = partial_of(scores[..., :4], values[:, :4])
    b = partial_of(scores[..., 4:], values[:, 4:])
    saved = [t.clone() for t in (*a, *b)]
    merged = lab.merge_partials(a, b)
    for before, after in zip(saved, (*a, *b)):
        assert torch.equal(before, after), "merge_partials changed an argument in place"
    assert_partial(merged, scores, values, "merge, whose arguments must stay as they were")


def test_merge_rejects_partials_of_different_shapes():
    a = partial_of(rand(2, 2, 3), rand(2, 3, 4))
    b = partial_of(rand(2, 3, 3), rand(2, 3, 4))
    with pytest.raises(ValueError):
        lab.merge_partials(a, b)
    # The same out shape, but the rows laid out differently: [2, 3] against [3, 2].
    c = lab.Partial(b.out, b.max_logit.reshape(3, 2), b.exp_sum.reshape(3, 2))
    with pytest.raises(ValueError):
        lab.merge_partials(b, c)


# ---------------------------------------------------------------------------------------------
# task 4: reducing P partials


def stacked(parts):
    return (
        torch.stack([p.out for p in parts], dim=-2),
        torch.stack([p.max_logit for p in parts], dim=-1),
        torch.stack([p.exp_sum for p in parts], dim=-1),
    )


@pytest.mark.parametrize("cuts", [[2], [1, 4, 6], [0, 3, 3, 8], [8], [1, 2, 3, 5, 6, 7]], ids=str)
def test_reduce_of_many_partials_equals_the_whole(cuts):
    scores, values = rand(2, 3, 8, seed=18), rand(2, 8, 4, seed=19)
    scores[1, :, 5:] -= 7.0
    scores[0, :, 6] += 9.0
    edges = [0, *cuts, 8]
    parts = [partial_of(scores[..., a:b], values[:, a:b]) for a, b in zip(edges, edges[1:])]
    reduced = lab.reduce_partials(*stacked(parts))
    assert_partial(reduced, scores, values, f"reduce over {len(parts)} partials")


def test_reduce_of_one_partial_returns_it():
    scores, values = rand(2, 3, 5, seed=30), rand(2, 5, 4, seed=31)
    reduced = lab.reduce_partials(*stacked([partial_of(scores, values)]))
    assert_partial(reduced, scores, values, "reduce of one partial")


def test_reduce_of_rows_where_every_partial_is_empty_gives_zero():
    scores, values = rand(2, 3, 6, seed=32), rand(2, 6, 4, seed=33)
    scores[0, 1] = NEG_INF  # row (0, 1) sees no key in any partial
    scores[1, 2, :3] = NEG_INF  # row (1, 2) sees keys of the second partial only
    parts = [partial_of(scores[..., :3], values[:, :3]), partial_of(scores[..., 3:], values[:, 3:])]
    reduced = lab.reduce_partials(*stacked(parts))
    assert not torch.isnan(reduced.out).any(), "a row where every partial is empty gave NaN"
    assert_partial(reduced, scores, values, "rows with empty partials")
    assert torch.equal(reduced.out[0, 1], torch.zeros(4, dtype=torch.float64)), (
        f"reduce_partials: row (0, 1) is empty in every partial and must give out = 0, got "
        f"{reduced.out[0, 1].tolist()}"
    )


def test_reduce_equals_merging_two_at_a_time():
    scores, values = rand(3, 2, 9, seed=34), rand(3, 9, 4, seed=35)
    scores[2, :, 7:] += 8.0
    parts = [partial_of(scores[..., a : a + 3], values[:, a : a + 3]) for a in (0, 3, 6)]
    merged = lab.merge_partials(lab.merge_partials(parts[0], parts[1]), parts[2])
    reduced = lab.reduce_partials(*stacked(parts))
    assert_close(reduced.out, merged.out, dims=ACC_DIMS, msg="reduce against merge")
    assert_close(reduced.exp_sum, merged.exp_sum, dims=ROW_DIMS, msg="reduce against merge: sum")


def test_reduce_does_not_modify_its_arguments():
    scores, values = rising_and_falling(seed=36)
    args = stacked(
        [partial_of(scores[..., :4], values[:, :4]), partial_of(scores[..., 4:], values[:, 4:])]
    )
    saved = [t.clone() for t in args]
    reduced = lab.reduce_partials(*args)
    for before, after in zip(saved, args):
        assert torch.equal(before, after), "reduce_partials changed an argument in place"
    assert_partial(reduced, scores, values, "reduce, whose arguments must stay as they were")


def test_reduce_of_a_single_row():
    # S may be empty: one row, P partials [P, head_size], maxima and sums [P].
    scores, values = rand(7, seed=42), rand(7, 3, seed=43)
    scores[5] += 6.0
    parts = [partial_of(scores[a:b], values[a:b]) for a, b in ((0, 2), (2, 6), (6, 7))]
    reduced = lab.reduce_partials(*stacked(parts))
    assert_partial(reduced, scores, values, "one row (S = [])")


@pytest.mark.parametrize(
    "shapes",
    [
        ((4,), (), ()),  # a single number is not a stack of partials
        ((2, 0, 4), (2, 0), (2, 0)),  # no partial at all
        ((2, 3, 4), (2, 2), (2, 2)),  # out has 3 partials, max and sum 2
        ((2, 3, 4), (2, 3), (2, 2)),  # sum has 2 partials, max 3
    ],
    ids=["no-P-dimension", "P=0", "out-vs-max", "sum-vs-max"],
)
def test_reduce_rejects_shapes_that_do_not_fit(shapes):
    out, m, s = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError):
        lab.reduce_partials(out, m, s)


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


def check_any_split(fn, case):
    q_len, kv_len, num_heads, num_kv_heads, cuts, use_alibi, seed = case
    q, k, v = make_qkv(q_len, kv_len, num_heads, num_kv_heads, 8, torch.float64, seed)
    slopes = torch.rand(num_heads, dtype=torch.float64) if use_alibi else None
    want = ref_attention(q, k, v, alibi_slopes=slopes)
    got = getattr(lab, fn)(q, k, v, cuts, alibi_slopes=slopes)
    assert_close(got, want, dims=OUT_DIMS, msg=f"{fn}, cuts={cuts}")


@given(attention_case())
def test_blockwise_attention_for_any_split_of_the_keys_is_lab_01_attention(case):
    check_any_split("blockwise_attention", case)


@given(attention_case())
def test_split_kv_attention_for_any_split_of_the_keys_is_lab_01_attention(case):
    check_any_split("split_kv_attention", case)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": 0.3},
        {"scale": 0.0},
        {"causal": False},
        {"scale": 0.7, "causal": False, "alibi_slopes": torch.tensor([0.5, -0.25, 1.5, 1.0])},
    ],
    ids=["scale", "scale0", "noncausal", "all"],
)
@pytest.mark.parametrize("fn", FNS)
def test_block_attention_passes_scale_alibi_and_causal_on(fn, kwargs):
    q, k, v = make_qkv(3, 14, 4, 2, 8, torch.float64, seed=37)
    got = getattr(lab, fn)(q, k, v, [2, 5, 5, 11], **kwargs)
    assert_close(got, ref_attention(q, k, v, **kwargs), dims=OUT_DIMS, msg=f"{fn} {kwargs}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", FNS)
def test_block_attention_in_half_precision_matches_lab_01(fn, dtype):
    q, k, v = make_qkv(3, 21, 4, 2, 16, dtype, seed=20)
    out = getattr(lab, fn)(q, k, v, [4, 4, 9, 16])
    assert out.dtype == dtype, f"{fn} must return the query dtype {dtype}, got {out.dtype}"
    assert_close(out, ref_attention(q, k, v), dims=OUT_DIMS, msg=fn)


@pytest.mark.parametrize("fn", FNS)
def test_logits_of_ten_thousand_do_not_overflow(fn):
    # Scores near +-1e4 in float32: exp() without subtracting the running max overflows to inf.
    q, k, v = make_qkv(2, 12, 2, 1, 16, torch.float32, seed=21)
    q = q / q.norm(dim=-1, keepdim=True) * 1e4 * 4.0  # scale = 1/4, so |score| ~ 1e4 |cos|
    k = k / k.norm(dim=-1, keepdim=True)
    out = getattr(lab, fn)(q, k, v, [3, 7], causal=False)
    assert torch.isfinite(out).all(), f"{fn}: logits of 1e4 overflowed"
    want = ref_attention(q.double(), k.double(), v.double(), causal=False)
    assert_close(out, want.float(), dims=OUT_DIMS, msg=f"{fn} with huge logits")


def test_blockwise_attention_never_holds_all_the_scores():
    # A prefill of 1,024 tokens cut into blocks of 16. All the scores at once would be
    # 2 heads x 1024 x 1024 float32 = 8 MiB; one block's are 2 x 1024 x 16 x 4 bytes = 128 KiB.
    q, k, v = make_qkv(1024, 1024, 2, 2, 8, torch.float32, seed=38)
    full = 2 * 1024 * 1024 * 4
    outputs = []
    peak = peak_tensor_bytes(
        lambda: outputs.append(lab.blockwise_attention(q, k, v, range(16, 1024, 16))), (q, k, v),
        beside=lab,  # measured where the lab's code runs
    )
    assert_close(outputs[0], ref_attention(q, k, v), dims=OUT_DIMS,
                 msg="blockwise_attention over blocks of 16 (the run whose memory is measured)")
    assert peak < full // 4, (
        f"blockwise_attention held {peak / 2**20:.1f} MiB of tensors at once; all the scores are "
        f"{full / 2**20:.0f} MiB. Compute each block's scores when you reach it (_block_scores), "
        "and keep only the running state between blocks"
    )


def test_split_kv_attention_reduces_independent_partials_in_one_call(monkeypatch):
    module = lab.module_of(lab.split_kv_attention)
    calls = []
    original = module.reduce_partials

    def counting(out, max_logit, exp_sum):
        calls.append(tuple(max_logit.shape))
        return original(out, max_logit, exp_sum)

    monkeypatch.setattr(module, "reduce_partials", counting)
    q, k, v = make_qkv(2, 10, 2, 1, 8, torch.float64, seed=39)
    out = lab.split_kv_attention(q, k, v, [3, 3, 7])
    assert_close(out, ref_attention(q, k, v), dims=OUT_DIMS, msg="split_kv_attention")
    assert len(calls) == 1, (
        f"split_kv_attention called reduce_partials {len(calls)} times; the v2 structure is "
        "one partial per block, then one reduce of all of them"
    )
    assert 3 <= calls[0][-1] <= 4, (
        f"reduce_partials got {calls[0][-1]} partials for the blocks [0,3) [3,3) [3,7) [7,10)"
    )


@pytest.mark.parametrize("fn", FNS)
def test_block_attention_runs_on_the_query_device(fn):
    # The meta device holds shapes only: a state or a mask made on the CPU cannot meet it.
    # The same shapes on the CPU first: there the attention is computed.
    cpu = make_qkv(3, 9, 4, 2, 8, torch.float64, seed=46)
    got = getattr(lab, fn)(*cpu, [2, 6], alibi_slopes=torch.ones(4))
    want = ref_attention(*cpu, alibi_slopes=torch.ones(4, dtype=torch.float64))
    assert_close(got, want, dims=OUT_DIMS, msg=f"{fn} on the CPU (before the meta device)")
    q, k, v = (torch.zeros(n, h, 8, device="meta") for n, h in ((3, 4), (9, 2), (9, 2)))
    out = getattr(lab, fn)(q, k, v, [2, 6], alibi_slopes=torch.ones(4))
    assert out.device.type == "meta" and tuple(out.shape) == (3, 4, 8), (
        f"{fn} gave {tuple(out.shape)} on {out.device}; want (3, 4, 8) on the query's device"
    )


@pytest.mark.parametrize("cuts", [[5, 2], [-1], [13]], ids=str)
@pytest.mark.parametrize("fn", FNS)
def test_bad_boundaries_are_rejected(fn, cuts):
    q, k, v = make_qkv(2, 12, 2, 1, 8, torch.float32, seed=22)
    with pytest.raises(ValueError):
        getattr(lab, fn)(q, k, v, cuts)


@pytest.mark.parametrize("fn", FNS)
def test_bad_shapes_are_rejected(fn):
    q, k, v = make_qkv(3, 6, 3, 2, 8, torch.float32, seed=40)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        getattr(lab, fn)(q, k, v, [2])
    q, k, v = make_qkv(7, 6, 2, 2, 8, torch.float32, seed=41)  # more queries than keys
    with pytest.raises(ValueError):
        getattr(lab, fn)(q, k, v, [2])
    q, k, v = make_qkv(3, 6, 4, 2, 8, torch.float32, seed=42)  # 3 slopes for 4 heads
    with pytest.raises(ValueError):
        getattr(lab, fn)(q, k, v, [2], alibi_slopes=torch.ones(3))
