"""Lab 02-06 benchmark: your kernels beside the reference ones and PyTorch's.

    python phase-02-paged-attention/labs/lab-06-cuda-kernel/bench.py [--sweep] [--json PATH]

It runs benchmarks/paged_attention.py (see its docstring for the method: correctness first,
warm-up, L2 flushed, CUDA events, a block pool several times the L2 size) with three more
kernels, ``student_naive``, ``student_v1`` and ``student_v2``: your starter.cu, built as the
tests build it. A task that is
not done yet shows as "not implemented"; a wrong result shows as WRONG and is not timed.
Needs a CUDA GPU; without one it says so and exits with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent
REPO_ROOT = LAB_DIR.parents[2]


def student_kernels() -> dict:
    """The starter build's raw naive / v1 / v2 (no Python checks inside the timed region)."""
    from course.labs.loader import load_script

    starter = load_script("lab_02_06_starter_bench", LAB_DIR / "starter.py")
    bench = load_script("paged_attention_benchmark",
                        REPO_ROOT / "benchmarks" / "paged_attention.py")
    mod = starter.build(backend="cuda")
    return {
        "student_naive": lambda b: bench.bound_call(mod.paged_attention_naive, b.naive_args()),
        "student_v1": lambda b: (lambda: mod.paged_attention_v1(*b.v1_args())),
        "student_v2": lambda b: (lambda: mod.paged_attention_v2(*b.v2_args())),
    }


def main(argv: list[str] | None = None) -> int:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from course.labs.loader import load_script

    bench = load_script("paged_attention_benchmark",
                        REPO_ROOT / "benchmarks" / "paged_attention.py")
    return bench.main(argv, extra_kernels=student_kernels)


if __name__ == "__main__":
    sys.exit(main())
