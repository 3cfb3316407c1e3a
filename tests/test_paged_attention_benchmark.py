"""benchmarks/paged_attention.py's bookkeeping, on a CPU: every shape stays inside the error
handling, so a point that runs out of GPU memory is reported as skipped and the sweep goes on.
(The timings themselves need a GPU; here a stand-in timer returns a fixed time.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from course.labs.loader import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script("paged_attention_benchmark", REPO_ROOT / "benchmarks" / "paged_attention.py")


SHAPE = dict(num_seqs=2, context_len=40, num_heads=4, num_kv_heads=2, head_size=64,
             block_size=16, dtype="fp32")


def fixed_timer(fn, flush, warmup, reps):
    fn()
    return 10.0  # µs


def out_of_memory(batch):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def test_a_kernel_out_of_memory_is_skipped_and_the_others_are_measured(bench):
    shape = bench.Shape(**SHAPE)
    kernels = {"too-big": out_of_memory, "sdpa_gathered": bench.sdpa_gathered}
    roofs = {"read": 100.0, "copy": 50.0}
    records = bench.bench_shape(shape, kernels, None, 1 << 16, torch.empty(1), 0, 1, roofs,
                                device="cpu", timer=fixed_timer)
    by_name = {r["kernel"]: r for r in records}
    assert by_name["too-big"]["status"].startswith("skipped: out of memory")
    assert by_name["too-big"]["us"] is None and by_name["too-big"]["gbps"] is None
    ok = by_name["sdpa_gathered"]
    assert ok["status"] == "ok" and ok["us"] == 10.0
    batch = bench.Batch(shape, "cpu", 1 << 16)
    gbps = batch.useful_bytes() / 10e-6 / 1e9
    assert ok["gbps"] == round(gbps, 1)
    assert ok["pct_of_read_bandwidth"] == round(100 * gbps / 100.0, 1)
    assert ok["pct_of_copy_bandwidth"] == round(100 * gbps / 50.0, 1)


def test_a_shape_whose_inputs_do_not_fit_is_skipped_for_every_kernel(bench, monkeypatch):
    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 120.00 GiB")

    monkeypatch.setattr(bench, "Batch", no_room)
    kernels = {"v1": out_of_memory, "v2": out_of_memory, "sdpa_gathered": out_of_memory}
    records = bench.bench_shape(bench.Shape(**SHAPE), kernels, {"v1", "sdpa_gathered"},
                                1 << 16, torch.empty(1), 0, 1, {"copy": 50.0}, device="cpu",
                                timer=fixed_timer)
    assert [r["kernel"] for r in records] == ["v1", "sdpa_gathered"]  # `only` is respected
    for r in records:
        assert r["status"].startswith("skipped: out of memory for the inputs"), r
        assert r["num_seqs"] == 2 and r["pct_of_copy_bandwidth"] is None


def test_a_wrong_kernel_is_reported_not_timed(bench):
    def wrong(batch):
        def run():
            batch.out.zero_()
        return run

    records = bench.bench_shape(bench.Shape(**SHAPE), {"wrong": wrong}, None, 1 << 16,
                                torch.empty(1), 0, 1, {"copy": 50.0}, device="cpu",
                                timer=lambda *a: pytest.fail("a wrong kernel was timed"))
    assert records[0]["status"].startswith("WRONG: wrong")


def test_the_roofline_places_each_kernel_by_its_intensity_and_is_drawn_next_to_the_json(
        bench, tmp_path):
    import json

    shape = bench.Shape(**SHAPE)
    records = bench.bench_shape(shape, {"sdpa_gathered": bench.sdpa_gathered,
                                        "too-big": out_of_memory},
                                None, 1 << 16, torch.empty(1), 0, 1, {"read": 100.0},
                                device="cpu", timer=fixed_timer)
    results = {"device": "a CPU (stand-in timings)", "read_bandwidth_gbps": 100.0,
               "matmul_tflops": {"fp32": 50.0, "fp16": 700.0}, "records": records}
    (point,) = bench.roofline_points(results)  # the skipped kernel has no point
    # 2 sequences x 4 heads x 40 tokens x 64: q.k and p.v, a multiply and an add each.
    flops = 4 * 2 * 4 * 40 * 64
    # K and V of 2 KV heads (fp32) for every token, plus the queries and the output.
    moved = 2 * 2 * 40 * 2 * 64 * 4 + 2 * 2 * 4 * 64 * 4
    assert point["kernel"] == "sdpa_gathered"
    assert point["intensity"] == pytest.approx(flops / moved)
    assert point["gflops"] == pytest.approx(flops / 10e-6 / 1e9)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results, default=str))
    assert bench.main(["--roofline", str(path)]) == 0  # no GPU needed to redraw it
    png = tmp_path / "results.roofline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("shape", [
    dict(SHAPE, num_seqs=3),  # 40 tokens: the last block is partly filled
    dict(SHAPE, num_seqs=2, context_len=33, num_heads=8, num_kv_heads=1, head_size=32),
])
def test_the_flexattention_baseline_reads_each_sequence_through_its_own_block_table(bench, shape):
    """The FlexAttention row (PyTorch's paged-attention helper, one cache block per KV tile) is
    checked against the oracle like every kernel; on a CPU it runs eagerly."""
    pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    records = bench.bench_shape(bench.Shape(**shape), {"flex": bench.flex_paged}, None,
                                1 << 16, torch.empty(1), 0, 1, {"read": 100.0}, device="cpu",
                                timer=fixed_timer)
    assert records[0]["status"] == "ok", records[0]["status"]


@pytest.mark.parametrize("content", [None, "not json", '{"records": []}'])
def test_redrawing_from_a_missing_or_foreign_file_says_so_and_exits_2(bench, tmp_path, capsys,
                                                                       content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert bench.main(["--roofline", str(path)]) == 2
    assert "cannot draw the roofline" in capsys.readouterr().err
    assert not (tmp_path / "results.roofline.png").exists()


@pytest.mark.emulation
def test_the_naive_kernels_row_is_checked_and_an_fp8_cache_is_not_implemented(bench):
    """The naive kernel (lab 02-06's task 0) gets v1's arguments without the cache dtype; it
    reads no fp8 cache, so that row says "not implemented" instead of failing the sweep. Run
    here through the CPU emulation, so the row's output is checked against the oracle."""
    from functools import partial

    from mini_vllm.csrc.ops import paged_attention_naive

    naive = partial(paged_attention_naive, backend="emulation")  # also where a GPU is present
    kernels = {"naive": lambda b: bench.bound_call(naive, b.naive_args())}
    for cache, status in (("auto", "ok"), ("fp8", "not implemented: the naive kernel reads")):
        shape = bench.Shape(**{**SHAPE, "kv_cache_dtype": cache})
        (record,) = bench.bench_shape(shape, kernels, None, 1 << 16, torch.empty(1), 0, 1,
                                      {"copy": 50.0}, device="cpu", timer=fixed_timer)
        assert record["status"].startswith(status), record


def test_without_a_gpu_nothing_is_captured_and_the_output_is_checked_again_after_timing(bench):
    """capture_graph gives None where it cannot capture (here: no GPU), and the record says the
    kernel was timed eagerly. A kernel whose timed runs leave a wrong output (a graph that
    replays nothing would) is reported WRONG, not timed."""
    assert bench.capture_graph(lambda: None) is None or torch.cuda.is_available()
    shape = bench.Shape(**SHAPE)
    (ok,) = bench.bench_shape(shape, {"sdpa_gathered": bench.sdpa_gathered}, None, 1 << 16,
                              torch.empty(1), 0, 1, {"copy": 50.0}, device="cpu",
                              timer=fixed_timer)
    assert ok["status"] == "ok" and ok["timing"] == "eager"

    def timer_that_loses_the_output(fn, flush, warmup, reps):
        return 10.0  # never runs fn: b.out keeps the NaN it was filled with before timing

    (bad,) = bench.bench_shape(shape, {"sdpa_gathered": bench.sdpa_gathered}, None, 1 << 16,
                               torch.empty(1), 0, 1, {"copy": 50.0}, device="cpu",
                               timer=timer_that_loses_the_output)
    assert bad["status"].startswith("WRONG: sdpa_gathered after the timed runs"), bad


@pytest.mark.emulation
def test_the_gqa_kernel_with_its_own_partition_sizes_is_checked_like_any_row(bench):
    """--gqa-partitions rows: each size gets buffers as wide as it needs and its output is
    checked against the oracle (here through the CPU emulation); "auto" asks ops for the size."""
    from mini_vllm.csrc import load_ops

    gqa_op = load_ops(backend="emulation").paged_attention_gqa
    shape = bench.Shape(**{**SHAPE, "context_len": 200, "num_heads": 8, "dtype": "fp16"})
    kernels = {f"p{size}": bench.gqa_partitioned(gqa_op, size, num_sms=132)
               for size in ("64", "auto")}
    records = bench.bench_shape(shape, kernels, None, 1 << 16, torch.empty(1), 0, 1,
                                {"copy": 50.0}, device="cpu", timer=fixed_timer)
    assert [r["status"] for r in records] == ["ok", "ok"], records
