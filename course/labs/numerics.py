"""One place for numeric comparisons in tests: tolerances keyed by dtype, readable mismatches,
and the chi-square test of sampled tokens against the distribution they must follow."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

import torch

# (atol, rtol) by the dtype the computation ran in. fp16 keeps ~3 decimal digits and bf16 ~2, so
# their tolerances reflect one rounding of an O(1) output, not a loosened bar.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    dtype: torch.dtype | None = None,
    msg: str = "",
    show: int = 5,
    dims: tuple[str, ...] | None = None,
) -> None:
    """Assert |actual - expected| <= atol + rtol * |expected| elementwise.

    Tolerances default to those of `dtype` (by default the less precise of the two inputs).
    On failure the message gives the shapes, the NaN and inf values the result holds (how many,
    the first index), the largest finite errors and the first mismatching positions with both
    values, which is what one needs to find an off-by-one. With `dims`
    (one name per dimension, e.g. ``("query", "head", "dim")``) it also says, for each
    dimension, which indices hold a mismatch: "wrong in query rows 0, 1 of 3, in every head".
    """
    prefix = f"{msg}: " if msg else ""
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(
            f"{prefix}expected two tensors, got {type(actual)} and {type(expected)}"
        )
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs "
            f"expected {tuple(expected.shape)}"
        )
    if dtype is None:
        a_eps = torch.finfo(actual.dtype).eps if actual.dtype.is_floating_point else 0.0
        e_eps = torch.finfo(expected.dtype).eps if expected.dtype.is_floating_point else 0.0
        dtype = actual.dtype if a_eps >= e_eps else expected.dtype
    d_atol, d_rtol = tolerances(dtype) if dtype.is_floating_point else (0.0, 0.0)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol

    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    err = (a - e).abs()
    bad = (err > atol + rtol * e.abs()) | nan_mismatch
    bad &= ~(torch.isnan(a) & torch.isnan(e))
    if not bool(bad.any()):
        return
    lines = [
        f"{prefix}{int(bad.sum())} of {bad.numel()} elements differ beyond "
        f"atol={atol:g}, rtol={rtol:g} ({dtype}); shape {tuple(actual.shape)}",
        *not_finite_lines(a, e, bad),
        *error_size_lines(a, e, bad),
        "  first mismatches (index: actual vs expected):",
    ]
    for i in bad.nonzero()[:show].tolist():
        t = tuple(i)
        lines.append(f"    {t}: {float(a[t]):.6g} vs {float(e[t]):.6g}")
    if dims is not None:
        lines.append("  " + where_wrong(bad, dims))
    raise AssertionError("\n".join(lines))


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(mask.nonzero()[0].tolist())


def not_finite_lines(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor) -> list[str]:
    """One line per kind of non-finite value among the mismatches of `actual` (NaN, +inf, -inf),
    with its count and first index; and one for NaN expected where `actual` holds a number.

    A NaN or inf result has no finite error to measure, so these lines, not an error size, are
    what tells a student that a value was never written, divided by zero or overflowed."""
    lines = []
    kinds = (("NaN", torch.isnan(actual)), ("+inf", actual == float("inf")),
             ("-inf", actual == -float("inf")))
    for name, is_kind in kinds:
        mask = bad & is_kind
        n = int(mask.sum())
        if n:
            lines.append(f"  {name} in {n} element{'s' if n != 1 else ''} of the result "
                         f"(first at index {_first_index(mask)})")
    mask = bad & torch.isnan(expected) & ~torch.isnan(actual)
    n = int(mask.sum())
    if n:
        lines.append(f"  a number in {n} element{'s' if n != 1 else ''} where NaN is expected "
                     f"(first at index {_first_index(mask)})")
    return lines


def error_size_lines(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor) -> list[str]:
    """The largest absolute and relative errors among the mismatches where both values are
    finite; nothing when there is none (an error of 0 next to "elements differ" misleads)."""
    both = bad & torch.isfinite(actual) & torch.isfinite(expected)
    n = int(both.sum())
    if not n:
        return []
    err = (actual - expected).abs()[both]
    rel = err / expected.abs()[both].clamp_min(1e-12)
    plural = "es" if n != 1 else ""
    scope = "" if n == int(bad.sum()) else f" (over the {n} finite mismatch{plural})"
    return [f"  max abs error {float(err.max()):.3g}, max rel error {float(rel.max()):.3g}{scope}"]


def where_wrong(bad: torch.Tensor, dims: tuple[str, ...]) -> str:
    """Which indices of each named dimension of the boolean `bad` hold a True, in words."""
    if len(dims) != bad.dim():
        raise ValueError(f"dims names {len(dims)} dimensions, the tensor has {bad.dim()}")
    parts = []
    for d, name in enumerate(dims):
        others = [i for i in range(bad.dim()) if i != d]
        hit = bad.any(dim=others) if others else bad
        idx = hit.nonzero().flatten().tolist()
        size = bad.shape[d]
        if len(idx) == size:
            parts.append(f"every {name} ({size})")
        else:
            shown = ", ".join(str(i) for i in idx[:12]) + (", ..." if len(idx) > 12 else "")
            parts.append(f"{name} {shown} of {size}")
    return "mismatches in: " + "; ".join(parts)


# ---------------------------------------------------------------------------- sampled tokens


def chi_square(counts: Mapping[int, int], expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom for token ``counts`` against ``expected``
    counts (one per token id), the categories expected fewer than 5 times pooled into one (and
    that one folded into the largest category when even the pool is under 5). For counts
    gathered under several contexts, with ``expected`` the sum of their distributions, the
    statistic is, if anything, smaller than chi-square: a test keeps its level."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    observed = torch.tensor([counts.get(t, 0) for t in range(len(expected))],
                            dtype=torch.float64)
    big = expected >= 5
    obs = [*observed[big].tolist(), float(observed[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] < 5:
        i = max(range(len(exp) - 1), key=exp.__getitem__)
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), len(obs) - 1


def chi_square_limit(df: int, z: float = 3.09) -> float:
    """The value a chi-square statistic with ``df`` degrees of freedom exceeds with the normal
    tail probability of ``z`` (3.09: 0.1%), by Wilson and Hilferty's cube-root approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def planted_draft_prompt(target: Callable[[list[int]], torch.Tensor], vocab_size: int,
                         ) -> tuple[list[int], int, int] | None:
    """A prompt ``[a, b] + rest`` whose likely next token is ``a``, and after ``a`` is ``b``:
    prompt lookup (n = 1) drafts ``b`` after a sampled ``a`` (``a`` is not in ``rest``), and the
    target accepts it often, not always. ``target(ids)`` is the distribution of the token after
    ``ids``. Found by a fixed-point search over seeded random ``rest``; ``None`` when no seed
    gives one. Returns ``(prompt, a, b)``."""
    for seed in range(200):
        rng = random.Random(seed)
        rest = [rng.randrange(vocab_size) for _ in range(30)]
        pair = [0, 0]
        for _ in range(6):
            p1 = target(pair + rest)
            a = int(p1.argmax())
            p2 = target([*pair, *rest, a])
            if [a, int(p2.argmax())] == pair:
                break
            pair = [a, int(p2.argmax())]
        else:
            continue
        if a not in rest and 0.4 < p1[a] and 0.5 < p2[pair[1]] < 0.9:
            return pair + rest, a, pair[1]
    return None
