"""Predict, then measure: your naive, v1 and v2 kernels as one sequence's context grows (a GPU).

`python -m course measure 02-06 --plot v1_v2.png` times your starter.cu's naive kernel, v1 and
v2 (and the reference kernels beside them) on one decode step of a single sequence: 64 query
heads over 8 KV heads of 128, fp16, blocks of 16, the shape of upstream's benchmark at batch 1.
The figure is the read bandwidth the kernel reaches: the bytes a decode step must read at least
once (every K and V element of the context, once) over the kernel's time, with L2 flushed before
every run (benchmarks/paged_attention.py's method: a CUDA graph per kernel, CUDA events, median
of 20).

Timing needs a CUDA GPU. The CPU emulation runs your kernel thread by thread, which shows whether
it is right, not how fast it would be. Without a GPU (or with `--arch`) the command gives what
the compiled code alone says, labelled as static: your starter.cu's kernels beside the
reference's, compiled by nvcc for the chosen GPU (`--arch T4|A100|H100`, default H100): registers,
spills, shared memory, occupancy, the width of every global load, SASS instructions per KV
block, and the grid each kernel launches (scripts/gqa_sass_report.py's parsers, which report the
same for the GQA kernel). Answer the README's questions first.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
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


def can_time() -> bool:
    """Timing runs only on a CUDA GPU; without one the command prints `static_report`."""
    return torch.cuda.is_available()


def sizes(quick: bool) -> list[int]:
    return [512, 4096, 32768] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


# --- without a GPU: what the compiled code says (nothing is timed) ---------------------------

STATIC_CONTEXT = 4096  # the context at which occupancy (dynamic shared memory) is computed
KERNELS = (("naive", "paged_attention_naive_kernel", "paged_attention_naive.cu"),
           ("v1", "paged_attention_v1_kernel", "paged_attention_v1.cu"),
           ("v2", "paged_attention_v2_kernel", "paged_attention_v2.cu"),
           ("v2 reduce", "partition_reduce_kernel", "paged_attention_v2.cu"))
TASK_OF = {"naive": 0, "v1": 3, "v2": 3, "v2 reduce": 4}


def _sass_report():
    from course.labs.loader import load_script

    return load_script("gqa_sass_report", REPO_ROOT / "scripts" / "gqa_sass_report.py")


def static_rows(arch: str, starter: Path | None = None) -> dict[tuple[str, str], dict | str]:
    """{(kernel, "yours" | "reference"): row of the SASS report, or why there is none}. Your
    kernel of a task whose LAB_TASK_N_DONE is 0 is "not written yet", never measured."""
    import tempfile

    from mini_vllm.csrc import CSRC_DIR

    g = _sass_report()
    starter = starter or Path(__file__).resolve().parent / "starter.cu"
    done = {int(n) for n, v in re.findall(
        r"#define LAB_TASK_(\d)_DONE (\d)", starter.read_text()) if v == "1"}
    out: dict[tuple[str, str], dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="lab0206-static-") as tmp:
        def report(source: Path) -> list[dict] | str:
            try:
                return g.report_source(source, arch, CSRC_DIR, Path(tmp))
            except RuntimeError as exc:  # name nvcc's first error, as file(line): message
                errors = [line.strip() for line in str(exc).splitlines() if " error" in line]
                return f"does not compile: {(errors or [str(exc).strip()])[0]}"

        # An untouched starter has nothing to report: its compile is skipped.
        sources = [starter] * bool(done) + [CSRC_DIR / f for f in
                                             dict.fromkeys(k[2] for k in KERNELS)]
        with ThreadPoolExecutor(max_workers=2) as pool:  # nvcc is single-threaded
            compiled = dict(zip(sources, pool.map(report, sources)))
        for short, kernel, ref_file in KERNELS:
            for who, source in (("yours", starter), ("reference", CSRC_DIR / ref_file)):
                if who == "yours" and TASK_OF[short] not in done:
                    out[short, who] = f"not written yet (LAB_TASK_{TASK_OF[short]}_DONE is 0)"
                    continue
                rows = compiled[source]
                if isinstance(rows, str):
                    out[short, who] = rows
                    continue
                found = [r for r in rows if r["kernel"] == kernel]
                out[short, who] = found[0] if found else f"no {kernel} in {source.name}"
    return out


def static_report(arch_name: str, starter: Path | None = None) -> str:
    """The static report for one GPU (T4, A100, H100), as printed by `course measure 02-06`."""
    g = _sass_report()
    arch = g.ARCH_NAMES[arch_name]
    gpu, sms, max_threads = g.ARCHS[arch][0], g.ARCHS[arch][1], g.ARCHS[arch][2]
    rows = static_rows(arch, starter)
    lines = [
        f"STATIC report for {gpu} ({arch}): read from the SASS that nvcc compiles, nothing was "
        "run or timed.",
        f"One instantiation: fp16, head size {g.HEAD_SIZE}, block size {g.BLOCK_SIZE}, "
        f"{g.THREADS} threads; occupancy at one sequence of {STATIC_CONTEXT:,} tokens.",
        "",
    ]
    headers = ["kernel", "code", "regs", "spills st/ld B", "smem B", "blocks/SM (limit)",
               "occupancy", "global loads by width", "SASS per KV block"]
    table = []
    for short, _, _ in KERNELS:
        for who in ("yours", "reference"):
            r = rows[short, who]
            if isinstance(r, str):
                table.append([short, who, r] + [""] * 6)
                continue
            smem = r["static_smem"] + g.dynamic_smem(short, STATIC_CONTEXT)
            blocks, limit = g.occupancy(arch, r["registers"], smem)
            loads = ", ".join(f"{n}x{bits}-bit" for bits, n in sorted(r["loads"].items(),
                                                                       reverse=True)) or "none"
            table.append([short, who, str(r["registers"]),
                          f"{r['spill_stores']}/{r['spill_loads']}", f"{smem:,}",
                          f"{blocks} ({limit})", f"{100 * blocks * g.THREADS / max_threads:.0f}%",
                          loads, "-" if r["per_kv_block"] is None else f"{r['per_kv_block']:.0f}"])
    full = [row for row in table if row[3]]  # a row without numbers says why in one cell
    widths = [max(len(row[i]) for row in [headers, *full]) for i in range(len(headers))]
    for row in [headers, ["-" * w for w in widths], *table]:
        if row[3] or row[0].startswith("-"):
            lines.append("  ".join(f"{c:<{w}}" for c, w in zip(row, widths)).rstrip())
        else:
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}")
    heads = 64
    lines += [
        "",
        "Grids at one sequence (64 query heads), from the launchers:",
        f"  naive and v1: {heads} thread blocks at every context, on {sms} SMs.",
        "  v2: 64 x ceil(context / 512) blocks: " + ", ".join(
            f"{heads * -(-c // 512):,} at {c:,}" for c in (512, 4096, 32768)) +
        " tokens, then the reduce's 64.",
        "",
        "What these predict (without a clock):",
    ]
    lines += _predictions(rows, sms)
    lines += ["", "SASS per KV block: warp-instructions of one pass through each loop over the "
              "cache (estimated from the loop's header; a loop nested inside counts once).",
              "Timing needs a CUDA GPU: a free Colab T4 is enough (README, 'On a free GPU')."]
    return "\n".join(lines)


def _predictions(rows, sms: int) -> list[str]:
    """Plain sentences from the numbers: load width, spills, occupancy, grid."""
    out = []
    for short, _, _ in KERNELS:
        mine, ref = rows[short, "yours"], rows[short, "reference"]
        if not isinstance(mine, dict) or not isinstance(ref, dict):
            continue
        widest = max(mine["loads"], default=0)
        ref_widest = max(ref["loads"], default=0)
        if widest < ref_widest:
            out.append(f"- {short}: your widest global load is {widest} bits, the reference's "
                       f"{ref_widest}: {ref_widest // max(widest, 1)}x the load instructions "
                       "for the same bytes, so expect fewer GB/s.")
        if mine["spill_stores"] or mine["spill_loads"]:
            out.append(f"- {short}: yours spills registers to local memory (a round trip to "
                       "DRAM or L1 per spill): find the array the compiler cannot keep in "
                       "registers.")
        a, b = mine["per_kv_block"], ref["per_kv_block"]
        if a and b and a > 1.5 * b:
            out.append(f"- {short}: {a:.0f} instructions per KV block against {b:.0f}: at long "
                       "contexts yours may wait on issue slots rather than on memory.")
    out.append(f"- naive and v1 launch 64 blocks whatever the context: {min(64, sms)} of the "
               f"{sms} SMs get one{' (some get two)' if sms < 64 else ''}, so a longer context "
               "only makes each block work longer; v2 has a block for every SM from "
               f"{-(-sms // 64) * 512:,} tokens on.")
    ref_naive, ref_v1 = rows["naive", "reference"], rows["v1", "reference"]
    if isinstance(ref_naive, dict) and isinstance(ref_v1, dict):
        out.append("- the reference's naive kernel reads the cache "
                   f"{min(ref_naive['loads'], default=0)} bits at a time, v1 up to "
                   f"{max(ref_v1['loads'], default=0)}: the same bytes in many more loads.")
    return out


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
