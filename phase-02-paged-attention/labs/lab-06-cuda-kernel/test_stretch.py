"""Lab 02-06, stretch (optional, not graded): the GQA-aware kernel against the PyTorch oracle.

With ``LAB_IMPL=starter`` these run *your* ``stretch_gqa.cu`` (through ``stretch.py``) once it
marks a stretch task done, and are skipped before that: the stretch is optional, so an untouched
one is not a failure. With ``LAB_IMPL=solution`` they run the reference,
``mini_vllm.csrc.ops.paged_attention_gqa``. The grader runs ``test_lab.py`` only.

Kernels run on a GPU when there is one, in test_lab.py's worker process (one kernel that breaks
its CUDA context fails its own test only), and in the CPU emulation otherwise (as ``test_lab.py``),
on the same poisoned batches: NaN in the unused slots of last blocks and block-table columns
past a sequence's end that point far outside the cache.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from course.labs.loader import chosen_impl, load_script
from course.labs.numerics import assert_close
from mini_vllm.csrc import resolve_backend

LAB_DIR = Path(__file__).resolve().parent
KERNEL_BACKEND = resolve_backend()
ON_GPU = KERNEL_BACKEND == "cuda"
DEVICE = "cuda" if ON_GPU else "cpu"

_spec = importlib.util.spec_from_file_location("lab_02_06_tests_for_stretch",
                                               LAB_DIR / "test_lab.py")
lab_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab_tests)  # make_batch, expected_output, require


def kernel_module():
    """Where the GQA-aware kernel under test lives, as the isolated GPU worker takes it: the
    reference's module name, or a loader of the student's stretch.py, which belongs to no
    package (skipped until the stretch is started)."""
    if chosen_impl() == "solution":
        return "mini_vllm.csrc.ops"
    stretch = load_script("lab_02_06_stretch", LAB_DIR / "stretch.py")
    if not stretch.stretch_started():
        pytest.skip("the stretch is optional: set STRETCH_TASK_1_DONE in stretch_gqa.cu to 1 "
                    "when you start it (README: Stretch)")
    return functools.partial(load_script, "lab_02_06_stretch", LAB_DIR / "stretch.py")


def kernel():
    where = kernel_module()
    if not isinstance(where, str):
        return where().paged_attention_gqa
    from mini_vllm.csrc.ops import paged_attention_gqa

    return paged_attention_gqa


def run(b: dict, partition_size: int, backend: str = KERNEL_BACKEND) -> torch.Tensor:
    """The kernel on the poisoned caches, partition buffers sized for `partition_size` and
    filled with NaN so that an entry never written shows."""
    num_seqs, num_heads, head_size = b["query"].shape
    parts = -(-b["max_seq_len"] // partition_size)
    dev = b["query"].device
    exp_sums = torch.full((num_seqs, num_heads, parts), float("nan"), device=dev)
    max_logits = torch.full_like(exp_sums, float("nan"))
    tmp_out = torch.full((num_seqs, num_heads, parts, head_size), float("nan"),
                         dtype=b["query"].dtype, device=dev)
    out = torch.full_like(b["query"], float("nan"))
    args = (out, exp_sums, max_logits, tmp_out, b["query"], b["poisoned_k"], b["poisoned_v"],
            b["num_kv_heads"], b["scale"], b["block_tables"], b["seq_lens"], b["block_size"],
            b["max_seq_len"], b["alibi_slopes"])
    if backend == "cuda":  # in test_lab's worker process: a kernel that breaks its CUDA
        # context fails this test only
        (result,) = lab_tests.gpu_worker().call(
            "mini_vllm.csrc.isolation", "run_on_gpu", kernel_module(), "paged_attention_gqa",
            [0], *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args],
            backend="cuda", partition_size=partition_size)
        return result.to(out.device)
    kernel()(*args, backend=backend, partition_size=partition_size)
    return out


# (query heads, KV heads), dtype, head size, block size, ALiBi, partition size: groups of 8 (one
# chunk), 3 (a chunk not full), 2, and 20 (three chunks, the last of 4 heads); every block size;
# the largest and the smallest partitions.
CASES = [
    pytest.param((16, 2), torch.float16, 128, 16, True, 512, id="group8-fp16-d128-b16-alibi"),
    pytest.param((12, 4), torch.bfloat16, 64, 32, False, 128, id="group3-bf16-d64-b32-p128"),
    pytest.param((4, 2), torch.float16, 96, 8, True, 64, id="group2-fp16-d96-b8-alibi-p64"),
    pytest.param((20, 1), torch.bfloat16, 128, 16, False, 256, id="group20-bf16-d128-b16-p256"),
]


@pytest.mark.oracle
@pytest.mark.parametrize("num_heads, dtype, head_size, block_size, use_alibi, partition_size",
                         CASES)
def test_stretch_gqa_kernel_matches_the_oracle(num_heads, dtype, head_size, block_size,
                                               use_alibi, partition_size):
    lab_tests.require(KERNEL_BACKEND)
    kw = {} if ON_GPU else dict(num_seqs=lab_tests.EMU_NUM_SEQS, max_len=lab_tests.EMU_MAX_LEN)
    b = lab_tests.make_batch(num_heads=num_heads, head_size=head_size, block_size=block_size,
                             dtype=dtype, use_alibi=use_alibi, device=DEVICE, **kw)
    assert_close(run(b, partition_size), lab_tests.expected_output(b),
                 msg=f"the GQA-aware kernel, {num_heads[0]} query / {num_heads[1]} KV heads, "
                     f"partitions of {partition_size}")


@pytest.mark.asan
@pytest.mark.emulation
def test_stretch_gqa_kernel_stays_inside_its_buffers():
    lab_tests.require(lab_tests.ASAN)
    b = lab_tests.tight_batch(num_heads=(8, 2), head_size=128, block_size=16, use_alibi=True)
    assert_close(run(b, 128, backend=lab_tests.ASAN), lab_tests.expected_output(b),
                 msg="the GQA-aware kernel under AddressSanitizer")


@pytest.mark.race
@pytest.mark.emulation
def test_stretch_gqa_kernel_has_no_data_race():
    lab_tests.require(lab_tests.RACE)
    b = lab_tests.small_batch(num_heads=(4, 1), head_size=64, block_size=16, use_alibi=True)
    assert_close(run(b, 512, backend=lab_tests.RACE), lab_tests.expected_output(b),
                 msg="the GQA-aware kernel under ThreadSanitizer")


def test_stretch_refuses_fp32_and_bad_partitions_before_writing():
    stretch = load_script("lab_02_06_stretch", LAB_DIR / "stretch.py")
    for dtype, partition_size, phrase in ((torch.float32, 512, "float16 and bfloat16"),
                                          (torch.float16, 100, "partition_size")):
        b = lab_tests.make_batch(num_heads=(4, 2), head_size=64, block_size=16, lens=[40],
                                 dtype=dtype, device="cpu")
        out = torch.zeros_like(b["query"])
        bufs = (torch.zeros(1, 4, 1), torch.zeros(1, 4, 1), torch.zeros(1, 4, 1, 64, dtype=dtype))
        with pytest.raises(ValueError, match=phrase):
            stretch.paged_attention_gqa(out, *bufs, b["query"], b["key_cache"], b["value_cache"],
                                        2, b["scale"], b["block_tables"], b["seq_lens"], 16, 40,
                                        backend="emulation", partition_size=partition_size)
        assert not out.any(), "a refused call must not write out"
