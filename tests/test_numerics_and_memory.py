"""Tests of two helpers the labs' tests and measurements use: assert_close's report of where a
tensor is wrong (`dims=`) and of NaN and inf results, and
course.student.measure.peak_tensor_bytes."""

from __future__ import annotations

import pytest
import torch

from course.labs.numerics import assert_close, where_wrong
from course.student.measure import peak_tensor_bytes


def test_assert_close_names_the_rows_and_heads_that_are_wrong():
    expected = torch.zeros(3, 4, 5)
    actual = expected.clone()
    actual[1, 2] = 1.0
    actual[2, 2, 0] = 1.0
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, dims=("query row", "head", "dim"))
    assert "mismatches in: query row 1, 2 of 3; head 2 of 4; every dim (5)" in str(info.value)


def test_assert_close_counts_nan_and_inf_instead_of_an_error_of_zero():
    """A NaN result has no finite error: the report counts the NaN (and each sign of inf) with
    its first index, and gives an error size only over the mismatches where both are finite."""
    expected = torch.arange(40.0).reshape(5, 8)
    actual = expected.clone()
    actual[1:] = float("nan")
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected)
    lines = str(info.value).splitlines()
    assert lines[0] == "32 of 40 elements differ beyond atol=1e-05, rtol=1e-05 (torch.float32); " \
        "shape (5, 8)", lines
    assert lines[1] == "  NaN in 32 elements of the result (first at index (1, 0))", lines
    assert not any("max abs error" in line for line in lines), lines

    actual = expected.clone()
    actual[2, 3], actual[4, 5], actual[0, 1] = float("inf"), -float("inf"), 3.0
    expected[3, 3] = float("nan")  # NaN expected, a number given
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected)
    text = str(info.value)
    for line in ("+inf in 1 element of the result (first at index (2, 3))",
                 "-inf in 1 element of the result (first at index (4, 5))",
                 "a number in 1 element where NaN is expected (first at index (3, 3))",
                 "max abs error 2, max rel error 2 (over the 1 finite mismatch)"):
        assert line in text, f"missing {line!r} in:\n{text}"


def test_where_wrong_needs_one_name_per_dimension():
    with pytest.raises(ValueError):
        where_wrong(torch.zeros(2, 3, dtype=torch.bool), ("row",))


def test_peak_tensor_bytes_counts_what_is_alive_at_once_and_not_the_inputs():
    x = torch.ones(100, 100)  # 40,000 bytes, not counted

    def two_at_once():
        a = x * 2  # 40,000 bytes
        b = a.t().contiguous()  # 40,000 more while a is alive; the view adds nothing
        return float(b.sum())

    def one_at_a_time():
        for _ in range(3):
            float((x * 2).sum())  # each product is freed before the next

    assert peak_tensor_bytes(two_at_once, (x,)) == 80_000 + 4  # + the 0-d sum
    assert peak_tensor_bytes(one_at_a_time, (x,)) == 40_000 + 4
