"""Predict, then measure: your naive, v1 and v2 kernels as one sequence's context grows (a GPU).

`python -m course measure 02-06 --plot v1_v2.png` times your starter.cu's naive kernel, v1 and
v2 (and the reference kernels beside them) on one decode step of a single sequence: 64 query
heads over 8 KV heads of 128, fp16, blocks of 16, the shape of upstream's benchmark at batch 1.
The figure is the read bandwidth the kernel reaches: the bytes a decode step must read at least
once (every K and V element of the context, once) over the kernel's time, with L2 flushed before
every run (benchmarks/paged_attention.py's method: a CUDA graph per kernel, CUDA events, median
of 20).

Timing needs a CUDA GPU. The CPU emulation runs your kernel thread by thread, which shows whether
it is right, not how fast it would be; without a GPU the command prints the questions and says
where to get one (a free Colab T4 is enough). Answer the README's questions
first.
"""

from __future__ import annotations

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[3]

TITLE = "One sequence's decode step: 64 query / 8 KV heads of 128, fp16, blocks of 16"
X_LABEL = "context tokens"
Y_LABEL = "GB/s of K and V read (each byte once) per second"
LOG_X = True
WARMUP, REPS = 5, 20


def _benchmark():
    """benchmarks/paged_attention.py, the lab benchmark's engine (Batch, time_gpu)."""
    from course.labs.loader import load_script

    return load_script("paged_attention_benchmark",
                       REPO_ROOT / "benchmarks" / "paged_attention.py")


def sizes(quick: bool) -> list[int]:
    if not torch.cuda.is_available():
        raise ValueError(
            "this measurement times your kernels, so it needs a CUDA GPU, and this machine has "
            "none. A free Colab T4 is enough (README, 'On a free GPU (Colab)'); on the "
            "CPU, the emulation tests tell you whether your kernels are right.")
    return [512, 4096, 32768] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def run(impl, context: int) -> dict[str, float | None]:
    """GB/s of `impl`'s naive kernel, v1 and v2 at one sequence of `context` tokens (None for a
    kernel whose task is not written, and for the naive one past its shared-memory limit, about
    12K tokens). Each kernel is called once through the lab's API first (an unwritten task
    raises NotImplementedError, a wrong result raises AssertionError), then timed through the
    built ops alone, as bench.py does, so that the Python checks stay out of the timing."""
    from course.labs.numerics import assert_close
    from mini_vllm.csrc.ops import naive_max_seq_len

    bench = _benchmark()
    props = torch.cuda.get_device_properties(0)
    batch = bench.Batch(bench.Shape(num_seqs=1, context_len=context), "cuda",
                        props.L2_cache_size)
    flush = torch.empty(2 * props.L2_cache_size // 4 + 1, dtype=torch.float32, device="cuda")
    expected = bench.expected_output(batch)
    ops = impl.build(backend="cuda")
    kernels = {
        "naive": (impl.paged_attention_naive, ops.paged_attention_naive, batch.naive_args),
        "v1": (impl.paged_attention_v1, ops.paged_attention_v1, batch.v1_args),
        "v2": (impl.paged_attention_v2, ops.paged_attention_v2, batch.v2_args),
    }
    results = {}
    for name, (checked, raw, args) in kernels.items():
        if name == "naive" and context > naive_max_seq_len(batch.shape.head_size):
            results[name] = None  # its logits do not fit in 48 KB of shared memory
            continue
        batch.out.fill_(float("nan"))
        try:
            checked(*args())
        except NotImplementedError:
            results[name] = None  # a task not written yet: its row says so, the others run
            continue
        torch.cuda.synchronize()
        assert_close(batch.out, expected, msg=f"your {name} at context {context}")
        call = bench.bound_call(raw, args())
        us = bench.time_gpu(bench.capture_graph(call) or call, flush, WARMUP, REPS)
        results[name] = batch.useful_bytes() / (us * 1e-6) / 1e9
    return results
