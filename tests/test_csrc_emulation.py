"""The CPU emulation of CUDA kernels (mini_vllm/csrc/emulation), on small kernels of its own.

tests/csrc/emulation_cases.cu holds one kernel per behaviour: warp collectives and barriers used
right (results checked here against Python), and each kind of misuse the emulation must report
instead of hanging or computing garbage, with the tier that reports it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).resolve().parent / "csrc" / "emulation_cases.cu"

pytestmark = pytest.mark.emulation


def emulator(flavor: str = "plain") -> Path:
    from mini_vllm.csrc.emulation import Build, Variant, flavor_supported

    reason = flavor_supported(flavor)
    if reason:
        pytest.skip(reason)
    build = Build("emulation_cases", (CASES,), flavor=flavor, bindings=(), own_files=(CASES,))
    return build.executable(Variant())


def run(op: str, flavor: str = "plain", device: str | None = None, **args) -> None:
    """Run `op`; tensors are buffers (written back when their name ends in _out), numbers
    scalars."""
    from mini_vllm.csrc.emulation import Arg, run_op

    buffers = {k.removesuffix("_out"): Arg(v, writable=k.endswith("_out"))
               for k, v in args.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
    run_op(emulator(flavor), op, buffers, scalars, device=device, own_files=(CASES,))


def failure(op: str, flavor: str = "plain", **args) -> str:
    from mini_vllm.csrc.emulation import EmulationError

    with pytest.raises(EmulationError) as err:
        run(op, flavor, **args)
    return str(err.value)


def line(snippet: str) -> int:
    text = CASES.read_text(encoding="utf-8")
    return text[: text.index(snippet)].count("\n") + 1


# ---- what correct code computes ------------------------------------------------------------------


def test_warp_collectives_and_barrier_counts_compute_what_cuda_specifies():
    torch.manual_seed(0)
    threads = 64
    x = torch.randn(threads)
    out = torch.zeros(5 * threads)
    votes = torch.zeros(3 * threads, dtype=torch.int32)
    run("warp_ops", **{"in": x, "out_out": out, "votes_out": votes, "threads": threads})
    got = out[: 4 * threads].view(threads, 4)
    for t in range(threads):
        w, lane = divmod(t, 32)
        warp = x[32 * w: 32 * w + 32]
        assert got[t, 0] == pytest.approx(float(warp.sum()), abs=1e-5)
        assert got[t, 1] == warp[(lane + 1) % 32]
        assert got[t, 2] == warp[min(lane + 1, 31)]  # lane 31 has no lane below: its own
        # __shfl_up_sync with width 8: the first lane of each segment keeps its own value.
        assert got[t, 3] == (warp[lane - 1] if lane % 8 else warp[lane])
        ballot = sum(1 << i for i in range(32) if warp[i] > 0)
        assert votes[3 * t] == torch.tensor(ballot, dtype=torch.int64).to(torch.int32)
        assert votes[3 * t + 1] == 0
        assert votes[3 * t + 2] == int((x > 0).sum())
        half = out[4 * threads + t]
        partner = lane ^ 1 if lane < 16 else lane ^ 2
        assert half == warp[partner]


def test_shared_memory_is_fresh_and_nan_in_every_block(monkeypatch):
    out = torch.zeros(256)
    run("fresh_shared", out_out=out)
    assert out.isnan().all(), "unwritten shared memory must read as NaN, in every block"
    # The second pattern: a value a max cannot drop (fmaxf drops NaN), bytes 0x7f.
    monkeypatch.setenv("MINI_VLLM_EMU_SHARED_FILL", "huge")
    run("fresh_shared", out_out=out)
    huge = torch.tensor([0x7F7F7F7F], dtype=torch.int32).view(torch.float32)
    assert torch.equal(out, huge.expand(256)), (
        f"with MINI_VLLM_EMU_SHARED_FILL=huge unwritten shared memory must read {float(huge):g} "
        f"in every block; read {out.unique().tolist()[:4]}")
    monkeypatch.setenv("MINI_VLLM_EMU_SHARED_FILL", "zero")
    with pytest.raises(ValueError, match="MINI_VLLM_EMU_SHARED_FILL must be one of"):
        run("fresh_shared", out_out=out)


def test_a_correct_block_reduction_runs_in_every_build():
    x = torch.randn(3 * 128)
    for flavor in ("plain", "asan", "race"):
        out = torch.zeros(3)
        run("shared_sum", flavor, **{"in": x, "out_out": out, "blocks": 3})
        assert torch.allclose(out, x.view(3, 128).sum(1), atol=1e-4), flavor


def test_half_and_bfloat16_conversions_are_bit_exact():
    """Every fp16 and bf16 bit pattern to float, and awkward floats (ties, subnormals,
    overflow, NaN) to fp16 and bf16 with round-to-nearest-even, as torch does."""
    torch.manual_seed(1)
    specials = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65520.0, 65519.0, 1e-8, 5.96e-8, 2.98e-8,
                             2.9802322e-08, 6.1e-5, 1 + 2**-11, 1 + 3 * 2**-11, float("inf"),
                             -float("inf"), 3.0e38, 1 + 2**-8, 1 + 3 * 2**-8])
    x = torch.cat([specials, torch.randn(5000) * 10, torch.randn(2000) * 1e-5,
                   (torch.rand(1000) * 2**16).round() * 2**-24])
    all_bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    half_bits = torch.zeros(len(x), dtype=torch.int16)
    bf16_bits = torch.zeros(len(x), dtype=torch.int16)
    from_half = torch.zeros(65536)
    from_bf16 = torch.zeros(65536)
    run("convert", **{"in": x, "half_bits_out": half_bits, "bf16_bits_out": bf16_bits,
                      "all_bits": all_bits, "from_half_out": from_half,
                      "from_bf16_out": from_bf16, "n": len(x)})
    assert torch.equal(half_bits, x.half().view(torch.int16))
    assert torch.equal(bf16_bits, x.bfloat16().view(torch.int16))
    want_half = all_bits.view(torch.float16).float()
    want_bf16 = all_bits.view(torch.bfloat16).float()
    assert torch.equal(from_half.isnan(), want_half.isnan())
    assert torch.equal(from_half.nan_to_num(), want_half.nan_to_num())
    assert torch.equal(from_bf16.isnan(), want_bf16.isnan())
    assert torch.equal(from_bf16.nan_to_num(), want_bf16.nan_to_num())
    nan_in = torch.tensor([float("nan")])
    h = torch.zeros(1, dtype=torch.int16)
    run("convert", **{"in": nan_in, "half_bits_out": h, "bf16_bits_out": h.clone(),
                      "all_bits": all_bits, "from_half_out": from_half,
                      "from_bf16_out": from_bf16, "n": 1})
    assert h.view(torch.float16).isnan().all()


def test_fp8_e4m3_conversions_match_torch():
    """Every e4m3 bit pattern decodes as torch.float8_e4m3fn does, and floats encode as torch's
    cast after the clamp to +-448 that the FP8 cache applies (the toolkit's __NV_SATFINITE):
    round to nearest even at every tie between neighbours, subnormals, the 448 edge, values
    far out of range, infinities; NaN stays NaN."""
    torch.manual_seed(2)
    all_bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = all_bits.view(torch.float8_e4m3fn).float()
    finite = grid[grid.isfinite()].unique()  # sorted, +-0 merged
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties (one bit past e4m3's mantissa)
    near = torch.cat([mids, mids.nextafter(torch.tensor(float("inf"))),
                      mids.nextafter(torch.tensor(-float("inf")))])
    specials = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 463.9, 464.0, 479.0, 480.0, 500.0,
                             1e4, 3e38, -3e38, float("inf"), -float("inf"), 2.0**-9, 2.0**-10,
                             3 * 2.0**-11, 2.0**-6, 1e-30, -1e-30, 1e-45])
    x = torch.cat([finite, near, specials, torch.randn(4000) * 50, torch.randn(2000) * 0.01,
                   torch.randn(1000) * 1000])
    fp8_bits = torch.zeros(len(x), dtype=torch.uint8)
    from_fp8 = torch.zeros(256)
    run("convert_fp8", **{"in": x, "fp8_bits_out": fp8_bits, "from_fp8_out": from_fp8,
                          "n": len(x)})
    assert torch.equal(from_fp8.isnan(), grid.isnan())
    assert torch.equal(from_fp8.nan_to_num(), grid.nan_to_num())
    assert torch.equal(from_fp8.signbit(), grid.signbit())  # -0.0 included
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (fp8_bits != want).nonzero().flatten()[:8].tolist()
    assert not bad, [(x[i].item(), fp8_bits[i].item(), want[i].item()) for i in bad]
    nan_in = torch.tensor([float("nan"), -float("nan")])
    out = torch.zeros(2, dtype=torch.uint8)
    run("convert_fp8", **{"in": nan_in, "fp8_bits_out": out, "from_fp8_out": from_fp8, "n": 2})
    assert out.view(torch.float8_e4m3fn).float().isnan().all()


@pytest.mark.parametrize("device, optin, fits", [("default", 48 * 1024, False),
                                                 ("t4", 64 * 1024, True),
                                                 ("a100", 163 * 1024, True),
                                                 ("h100", 227 * 1024, True)])
def test_the_shared_memory_opt_in_of_the_modelled_device(device, optin, fits):
    """60000 bytes of dynamic shared memory: refused without opting in (as on every GPU);
    after opting in, allowed where the device's limit is larger."""
    result = torch.zeros(4, dtype=torch.int32)
    run("dynamic_shared_optin", device=device, result_out=result, out_out=torch.zeros(32),
        bytes=60000)
    invalid = 1  # cudaErrorInvalidValue
    assert result.tolist() == [optin, invalid, 0 if fits else invalid, 0 if fits else invalid]


@pytest.mark.parametrize("m, n", [(32, 8), (8, 32), (16, 16)])
def test_wmma_multiplies_matrices_as_cuda_specifies(m, n):
    """The tensor-core API (nvcuda::wmma) in the three fp16 shapes, through shared memory:
    D = A B + C with fp32 accumulation, as torch computes it."""
    k = 16
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(m, k, generator=gen).half()
    b = torch.randn(k, n, generator=gen).half()
    c = torch.randn(m, n, generator=gen)
    d = torch.zeros(m, n)
    run("wmma_multiply", a=a, bt=b.t().contiguous(), c=c, d_out=d, m=m)
    want = a.float() @ b.float() + c
    assert torch.allclose(d, want, atol=1e-4), (d - want).abs().max()


# ---- misuse, reported instead of hanging ---------------------------------------------------------


def test_a_thread_that_leaves_while_the_others_wait_at_a_barrier():
    message = failure("early_exit", out_out=torch.zeros(64), quitter=5)
    barrier = line("  __syncthreads();\n  out[threadIdx.x] = 1.f;")
    assert message == (
        f"early_exit: thread 5 left the kernel while threads 0-4, 6-63 wait at the barrier at "
        f"emulation_cases.cu:{barrier} (in early_exit, block (0,0,0))"
    )


def test_threads_at_different_barriers():
    message = failure("two_barriers", out_out=torch.zeros(64))
    assert re.search(r"threads 1, 3, \.\.\., 63 wait at the barrier at emulation_cases.cu:\d+ "
                     r"while threads 0, 2, \.\.\., 62 wait at the barrier at "
                     r"emulation_cases.cu:\d+: every thread of a block must reach the same "
                     r"__syncthreads\(\)", message), message


def test_a_shuffle_under_divergence():
    message = failure("shuffle_in_branch", out_out=torch.zeros(64))
    shfl = line("if (threadIdx.x % 2 == 0) v = __shfl_xor_sync")
    want = f"threads 0, 2, ..., 30 wait at __shfl_xor_sync() at emulation_cases.cu:{shfl}"
    assert want in message, message
    assert "threads 1, 3, ..., 31 wait at the barrier" in message, message


def test_a_wmma_operation_under_divergence():
    message = failure("wmma_in_branch", d_out=torch.zeros(256))
    mma = line("if (threadIdx.x >= 16) wmma::mma_sync(acc, fa, fb, acc);")
    store = line("wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);\n}")
    assert (f"threads 0-15 wait at wmma::store_matrix_sync() at emulation_cases.cu:{store}"
            in message), message
    assert f"threads 16-31 wait at wmma::mma_sync() at emulation_cases.cu:{mma}" in message, message
    assert "the lanes of a warp collective must reach the same call" in message, message


def test_a_wmma_load_from_a_misaligned_pointer():
    message = failure("wmma_misaligned", a=torch.zeros(512, dtype=torch.float16),
                      d_out=torch.zeros(32))
    assert "wmma::load_matrix_sync() at emulation_cases.cu:" in message, message
    assert "is not 256-bit (32-byte) aligned" in message, message


def test_a_shuffle_that_reads_a_lane_outside_its_mask():
    message = failure("shuffle_outside_mask", out_out=torch.zeros(32))
    assert "thread 0 reads lane 16 through __shfl_xor_sync()" in message
    assert "not in the mask 0x0000ffff" in message, message


def test_reading_past_a_buffer_crashes_even_without_a_sanitizer():
    message = failure("read_past_end", **{"in": torch.zeros(100), "out_out": torch.zeros(32)},
                      n=100)
    assert re.search(r"segmentation fault at emulation_cases.cu:\d+, block \(0,0,0\), "
                     r"thread 31: a read of address 0x[0-9a-f]+ near in \(just past its end\)",
                     message), message


def test_address_sanitizer_names_the_buffer_line_block_and_thread():
    message = failure("read_past_end", "asan", **{"in": torch.zeros(100),
                                                  "out_out": torch.zeros(32)}, n=100)
    read = line("out[threadIdx.x] = in[threadIdx.x + n - 31];")
    assert message.startswith(f"read_past_end: out-of-bounds read of in at "
                              f"emulation_cases.cu:{read}, block (0,0,0), thread 31"), message


def test_writing_an_input_is_refused():
    message = failure("write_input", **{"in": torch.zeros(32)})
    assert "write to in, an input the op must not change" in message, message


def test_misaligned_vector_loads_and_integer_overflow():
    message = failure("misaligned_vector_load", "asan",
                      **{"in": torch.zeros(32), "out_out": torch.zeros(32)})
    assert "misaligned access of in at emulation_cases.cu:" in message
    assert "requires 16 byte alignment" in message, message
    message = failure("int_overflow", "asan", **{"in": torch.tensor([65536, 65536],
                                                                    dtype=torch.int32),
                                                 "out_out": torch.zeros(32)})
    assert "signed integer overflow: 65536 * 65536" in message, message


def test_a_race_on_shared_memory_between_warps():
    message = failure("race_on_shared", "race", **{"in": torch.zeros(128),
                                                   "out_out": torch.zeros(128)})
    assert re.search(r"data race on shared memory 'cells' in block \(0,0,0\): thread \d+ "
                     r"(reads|writes) it at emulation_cases.cu:\d+ and thread \d+ (reads|writes) "
                     r"it at emulation_cases.cu:\d+ with no __syncthreads\(\)", message), message


def test_a_race_between_blocks():
    message = failure("race_between_blocks", "race", out_out=torch.zeros(1))
    assert re.search(r"data race on out: thread 0 of block \(0,0,0\) writes it at "
                     r"emulation_cases.cu:\d+ and thread 1 of block \(1,0,0\) writes it", message)
    assert "different blocks of a launch run in no particular order" in message, message


def test_dynamic_shared_memory_must_end_on_a_16_byte_boundary():
    """nvcc may read a shared array's tail with one 16-byte load (seen on an H200 with
    compute-sanitizer); the emulation cannot run SASS, so it refuses the size that allows it."""
    run("dynamic_shared_tail", out_out=torch.zeros(32), bytes=128)
    message = failure("dynamic_shared_tail", out_out=torch.zeros(32), bytes=132)
    cells = line("MINI_VLLM_DYNAMIC_SHARED(float, cells)")
    assert message.startswith(
        "dynamic_shared_tail: the launch gives 132 bytes of dynamic shared memory (cells at "
        f"emulation_cases.cu:{cells}), not a whole number of 16-byte groups"), message
    assert "float_smem_bytes(n)" in message, message


def test_static_shared_memory_past_48_kb():
    message = failure("big_static_shared", out_out=torch.zeros(32))
    assert "56000 bytes of static shared memory" in message, message


def test_a_block_pool_larger_than_memory_costs_only_the_pages_written():
    """shared_empty maps a sparse file: 16 GiB of virtual memory, a few pages committed."""
    from mini_vllm.csrc.emulation import shared_empty

    big = shared_empty(2**33, dtype=torch.float16)
    big[-5:] = 1.0
    assert big.numel() == 2**33 and float(big[-1]) == 1.0


def test_an_edit_recompiles_only_the_edited_source(tmp_path):
    """Each kernel source's object is cached on its own (by its content, the headers, the flags
    and its path): editing one source of a build recompiles that one and links anew."""
    import uuid

    from mini_vllm.csrc.emulation import Build, Variant, flavor_supported
    from mini_vllm.csrc.emulation.build import _build_root

    if flavor_supported("plain"):
        pytest.skip(flavor_supported("plain"))
    extra = tmp_path / f"extra_{uuid.uuid4().hex[:8]}.cu"
    extra.write_text("int mini_vllm_test_marker() { return 1; }\n")
    build = Build("two_sources", (CASES, extra), bindings=(), own_files=(CASES,))

    def objects(stem: str) -> dict[Path, int]:
        return {p: p.stat().st_mtime_ns for p in _build_root().glob(f"object-{stem}-*/*.o")}

    first = build.executable(Variant())
    cases_before = objects("emulation_cases")
    assert len(objects(extra.stem)) == 1
    extra.write_text("int mini_vllm_test_marker() { return 2; }\n")
    second = build.executable(Variant())
    assert second != first and second.is_file()
    assert len(objects(extra.stem)) == 2, "the edited source is compiled anew"
    assert objects("emulation_cases") == cases_before, "the unchanged one is not compiled again"


def test_a_compile_error_is_reported_by_its_first_error_line(tmp_path):
    """The first line of a failed build names the source file, the line and the compiler's
    text (what a student fixes); the whole output and the command follow."""
    from mini_vllm.csrc import first_compiler_error
    from mini_vllm.csrc.emulation import Build, EmulationBuildError, Variant, flavor_supported

    if flavor_supported("plain"):
        pytest.skip(flavor_supported("plain"))
    bad = tmp_path / "broken.cu"
    bad.write_text("int fine = 1;\nint oops = undeclared_thing;\nint also = missing_too;\n")
    with pytest.raises(EmulationBuildError) as err:
        Build("broken", (bad,), bindings=(), own_files=(bad,)).executable(Variant())
    first, *rest = str(err.value).splitlines()
    assert re.match(r"broken\.cu:2: error: .*undeclared_thing.* \(compiling broken\.cu for the "
                    r"CPU emulation: fix this first error, then run again\)$", first), first
    assert any("missing_too" in line for line in rest), "the whole output follows the first line"
    # nvcc's spelling of an error line, and an output without one.
    assert first_compiler_error('/x/starter.cu(17): error: identifier "q" is undefined\n') == (
        'starter.cu:17: error: identifier "q" is undefined')
    assert first_compiler_error("/usr/bin/ld: cannot find -lfoo\n") is None
