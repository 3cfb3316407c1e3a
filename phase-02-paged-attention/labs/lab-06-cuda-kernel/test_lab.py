"""Lab 02-06 tests: the CUDA paged-attention kernels against lab 02-04's PyTorch oracle.

The kernels run on a GPU when there is one and in the CPU emulation when there is not (see
``mini_vllm.csrc.emulation``; $MINI_VLLM_KERNEL_BACKEND overrides the choice). Tiers, by marker:

* no marker (CPU, everywhere): the implementation imports without building anything, calls no
  PyTorch attention, and rejects bad inputs before touching anything;
* ``nvcc`` (where nvcc is installed): the CUDA sources compile with plain nvcc (no torch headers)
  into kernels that each load and store global memory, with vector loads for the cache;
* ``oracle`` (also ``cuda`` or ``emulation``, by where it runs): v1 and v2 against the oracle.
  On a GPU, a grid like upstream's test (7 sequences, (40, 40) and (64, 8) heads, head sizes
  64/80/128/256, block sizes 16/32, ALiBi on and off) plus every dtype and the other head
  sizes; in the emulation a reduced grid that still covers every dtype, head sizes
  64/80/96/112/128/256, block sizes 8/16/32, GQA and ALiBi. Lengths include 1, a block plus
  one, 512 and 513 (partition edges) and several partitions, so last blocks are partial; the
  unused slots of those blocks hold NaN and block-table columns past a sequence's end hold an id
  far outside the cache, so a kernel that reads either fails. Also: a context of 9 partitions,
  and v1 just below and just past the shared memory a block may use on the (modelled) device;
* ``asan`` (emulation with AddressSanitizer + UBSan): no access outside buffers sized exactly,
  no misaligned vector load, and a block pool of more than 2^31 elements (64-bit offsets);
* ``race`` (emulation with ThreadSanitizer, where only barriers and warp collectives order the
  threads of a block): no data race, even where the output happens to come out right.

Tests marked ``starter_ok`` check given code (input checks, the launchers' limits, reference-only
ops: the GQA-aware kernel, reshape_and_cache, copy/swap_blocks) and pass on the untouched starter
by design.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import random
import re
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from course.labs.student_process import beside_the_student
from mini_vllm.csrc import resolve_backend

lab = load_lab(__file__)

PARTITION_SIZE = 512
# Where the oracle tests run: "cuda" with a GPU, "emulation" without ($MINI_VLLM_KERNEL_BACKEND
# may name another backend).
KERNEL_BACKEND = resolve_backend()
ON_GPU = KERNEL_BACKEND == "cuda"
DEVICE = "cuda" if ON_GPU else "cpu"
WHERE = pytest.mark.cuda if ON_GPU else pytest.mark.emulation

# The GPU grid (upstream's shape).
GRID_HEADS = [(40, 40), (64, 8)]
GRID_HEAD_SIZES = [64, 80, 128, 256]
GRID_BLOCK_SIZES = [16, 32]
NUM_SEQS = 7
MAX_LEN = 1800  # four v2 partitions; keeps the oracle's gathered copies small
# The emulation grid: one case per head size, so that together they cover every dtype, block
# size, grouped-query and plain multi-head attention, with and without ALiBi. The first case is
# the most telling (GQA, ALiBi, fp16), so a broken kernel fails fast.
EMU_GRID = [
    (torch.float16, 128, 16, (8, 2), True),
    (torch.bfloat16, 64, 32, (4, 4), False),
    (torch.float32, 80, 8, (4, 1), True),
    (torch.float16, 96, 8, (6, 3), False),
    (torch.bfloat16, 112, 16, (4, 2), True),
    (torch.float32, 256, 32, (2, 1), False),
]
EMU_NUM_SEQS = 5
EMU_MAX_LEN = 1100  # three v2 partitions


def require(backend: str) -> None:
    """Skip (with the reason) when this machine cannot build `backend`."""
    if backend == "cuda":
        return
    from mini_vllm.csrc import EMULATION_FLAVORS
    from mini_vllm.csrc.emulation import flavor_supported

    reason = flavor_supported(EMULATION_FLAVORS[backend])
    if reason:
        pytest.skip(reason)


# ------------------------------------------------------------------------------------------
# Building a decode batch
# ------------------------------------------------------------------------------------------


def make_batch(
    *,
    num_heads: tuple[int, int],
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float16,
    use_alibi: bool = False,
    num_seqs: int = NUM_SEQS,
    max_len: int = MAX_LEN,
    seed: int = 0,
    device: str = DEVICE,
    lens: list[int] | None = None,
    spare_blocks: int = 3,
    table_fill: int = 2**30,
) -> dict:
    """A decode batch in the paged layout, plus a copy of the caches with poisoned tails.

    Each sequence gets its own physical blocks (a random permutation), so the unused slots of
    its last block belong to it alone: the kernel's caches hold NaN there, the oracle's hold the
    clean values. A kernel that lets an unused slot reach the output produces NaN. Block-table
    columns past a sequence's end hold `table_fill` (by default an id far outside the cache)
    that must never be read. `lens` replaces the default lengths (the last is the longest).
    """
    from mini_vllm.attention.reference import alibi_slopes

    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    nh, nkv = num_heads
    if lens is None:
        # Edge lengths first (one token, a block plus one, partition boundaries), then random
        # ones; the last sequence is the longest.
        lens = [1, block_size + 1, PARTITION_SIZE, PARTITION_SIZE + 1]
        lens += [rng.randint(1, max_len) for _ in range(num_seqs)]
        lens = lens[: num_seqs - 1] + [max_len]
    num_seqs = len(lens)
    max_blocks = -(-max(lens) // block_size)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen, device=device).cpu().tolist()
    table = torch.full((num_seqs, max_blocks), table_fill, dtype=torch.int32)
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n

    x = 16 // torch.empty((), dtype=dtype).element_size()
    key_cache = torch.randn(num_blocks, nkv, head_size // x, block_size, x, generator=gen,
                            device=device).to(dtype)
    value_cache = (torch.rand(num_blocks, nkv, head_size, block_size, generator=gen,
                              device=device) * 2 - 1).to(dtype)
    poisoned_k, poisoned_v = key_cache.clone(), value_cache.clone()
    for s, n in enumerate(lens):
        tail = n % block_size
        if tail:
            last = int(table[s, used[s] - 1])
            poisoned_k[last, :, :, tail:, :] = float("nan")
            poisoned_v[last, :, :, tail:] = float("nan")
    query = torch.randn(num_seqs, nh, head_size, generator=gen, device=device).to(dtype)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        poisoned_k=poisoned_k,
        poisoned_v=poisoned_v,
        num_kv_heads=nkv,
        scale=head_size**-0.5,
        block_tables=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_size=block_size,
        max_seq_len=max(lens),
        alibi_slopes=alibi_slopes(nh).to(device) if use_alibi else None,
    )


def partition_buffers(b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """exp_sums, max_logits, tmp_out for v2, filled with NaN so unwritten entries show."""
    num_seqs, nh, hs = b["query"].shape
    parts = -(-b["max_seq_len"] // PARTITION_SIZE)
    dev = b["query"].device
    exp_sums = torch.full((num_seqs, nh, parts), float("nan"), device=dev)
    max_logits = torch.full_like(exp_sums, float("nan"))
    tmp_out = torch.full((num_seqs, nh, parts, hs), float("nan"), dtype=b["query"].dtype,
                         device=dev)
    return exp_sums, max_logits, tmp_out


def expected_output(b: dict) -> torch.Tensor:
    """Lab 02-04's PyTorch v1 on the clean caches."""
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle_v1

    out = torch.empty_like(b["query"])
    oracle_v1(out, b["query"], b["key_cache"], b["value_cache"], b["num_kv_heads"], b["scale"],
              b["block_tables"], b["seq_lens"], b["block_size"], b["max_seq_len"],
              b["alibi_slopes"])
    return out


@cache
def gpu_worker():
    """The process that runs the kernels of the GPU tests (mini_vllm.csrc.isolation): a kernel
    that breaks its CUDA context fails its own test only."""
    from mini_vllm.csrc.isolation import IsolatedRunner

    return IsolatedRunner()


def run_kernel(version: str, b: dict, fn=None, backend: str = KERNEL_BACKEND) -> torch.Tensor:
    """Run naive, v1 or v2 (lab's, or `fn` with the v2 signature) on the poisoned caches."""
    out = torch.full_like(b["query"], float("nan"))
    common = (b["query"], b["poisoned_k"], b["poisoned_v"], b["num_kv_heads"], b["scale"],
              b["block_tables"], b["seq_lens"], b["block_size"], b["max_seq_len"],
              b["alibi_slopes"])
    if backend == "cuda":  # in the worker process, on CPU copies of the arguments
        args = (out, *(partition_buffers(b) if version == "v2" else ()), *common)
        where = fn.__module__ if fn else lab.module_loader()
        name = fn.__name__ if fn else f"paged_attention_{version}"
        (result,) = gpu_worker().call(
            "mini_vllm.csrc.isolation", "run_on_gpu", where, name, [0],
            *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], backend="cuda")
        return result.to(out.device)
    if version == "naive":
        lab.paged_attention_naive(out, *common, backend=backend)
    elif version == "v1":
        (fn or lab.paged_attention_v1)(out, *common, backend=backend)
    else:
        (fn or lab.paged_attention_v2)(out, *partition_buffers(b), *common, backend=backend)
    if backend == "cuda":
        torch.cuda.synchronize()
    return out


def kernel_source_paths() -> list[Path]:
    """The CUDA sources the implementation says it is built from (its ``kernel_sources()``)."""
    return [Path(p) for p in _kernel_source_paths(beside=lab)]


@beside_the_student
def _kernel_source_paths() -> list[str]:
    return [str(p) for p in lab.kernel_sources()]


# ------------------------------------------------------------------------------------------
# CPU: imports, sources, input checks
# ------------------------------------------------------------------------------------------


@beside_the_student
def _import_without_building() -> dict:
    """Import the implementation afresh with every build function refusing (an AssertionError
    that names the build); the type of each launcher it then defines, by name, and whether it
    can be called. Where the lab's code runs: importing it runs it."""
    import mini_vllm.csrc as csrc

    def refuse(*args, **kwargs):
        raise AssertionError("the implementation built an extension while being imported")

    with mock.patch.multiple(csrc, build_extension=refuse, load_ops=refuse,
                             emulation_build=refuse):
        spec = importlib.util.spec_from_file_location("lab_02_06_import_probe", lab.source_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # must not call build_extension / load_ops
    found = {v: getattr(module, f"paged_attention_{v}", None) for v in ("v1", "v2")}
    return {v: (type(f).__name__, callable(f)) for v, f in found.items()}


@pytest.mark.starter_ok
def test_importing_the_implementation_builds_nothing():
    found = _import_without_building(beside=lab)
    assert found["v1"][1] and found["v2"][1], (
        f"{Path(lab.source_path).name} must define paged_attention_v1 and paged_attention_v2 "
        f"(found v1: {found['v1'][0]}, v2: {found['v2'][0]})")


@pytest.mark.starter_ok
def test_the_implementation_calls_no_pytorch_attention():
    forbidden = ("scaled_dot_product_attention", "flex_attention", "mini_vllm.attention",
                 "torch.softmax", "F.softmax", ".softmax(")
    for path in [lab.source_path, *kernel_source_paths()]:
        text = Path(path).read_text(encoding="utf-8")
        for word in forbidden:
            assert word not in text, (
                f"{Path(path).name} uses {word!r}: the lab's kernels must compute attention "
                "themselves, in CUDA"
            )


def cpu_batch(**overrides) -> dict:
    """Valid-shaped CPU inputs (fp16, 4 query / 2 KV heads, head 64, block 16)."""
    torch.manual_seed(0)
    a = dict(
        out=torch.zeros(2, 4, 64, dtype=torch.float16),
        query=torch.randn(2, 4, 64).half(),
        key_cache=torch.randn(6, 2, 8, 16, 8).half(),
        value_cache=torch.randn(6, 2, 64, 16).half(),
        num_kv_heads=2,
        scale=0.125,
        block_tables=torch.zeros(2, 2, dtype=torch.int32),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32),
        block_size=16,
        max_seq_len=20,
        alibi_slopes=None,
    )
    a.update(overrides)
    return a


BAD_INPUTS = {
    "unsupported head size": (dict(query=torch.randn(2, 4, 72).half(),
                                   out=torch.zeros(2, 4, 72).half()), "head_size"),
    "unsupported block size": (dict(block_size=64, key_cache=torch.randn(6, 2, 8, 64, 8).half(),
                                    value_cache=torch.randn(6, 2, 64, 64).half()), "block_size"),
    "int8 query": (dict(query=torch.zeros(2, 4, 64, dtype=torch.int8)), "dtype"),
    "cache dtype differs": (dict(key_cache=torch.randn(6, 2, 8, 16, 8)), "dtype"),
    "key cache without x": (dict(key_cache=torch.randn(6, 2, 64, 16).half()), "key_cache"),
    "value cache transposed": (dict(value_cache=torch.randn(6, 2, 16, 64).half()), "value_cache"),
    "heads not a multiple": (dict(num_kv_heads=3), "num_kv_heads"),
    "int64 block tables": (dict(block_tables=torch.zeros(2, 2, dtype=torch.int64)),
                           "block_tables"),
    "seq_lens too short": (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), "seq_lens"),
    "alibi per kv head": (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    "out of another dtype": (dict(out=torch.zeros(2, 4, 64)), "out"),
    "non-contiguous query": (dict(query=torch.randn(2, 64, 4).half().transpose(1, 2)), "query"),
    "CPU tensors for the cuda backend": ({}, "CUDA"),
}


@pytest.mark.starter_ok
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_rejected_before_anything_is_written(version, case):
    overrides, phrase = BAD_INPUTS[case]
    a = cpu_batch(**overrides)
    before = a["out"].clone()
    num_seqs, nh, hs = a["out"].shape
    bufs = (torch.zeros(num_seqs, nh, 1), torch.zeros(num_seqs, nh, 1),
            torch.zeros(num_seqs, nh, 1, hs, dtype=a["out"].dtype))
    args = [a[k] for k in ("out", "query", "key_cache", "value_cache", "num_kv_heads", "scale",
                           "block_tables", "seq_lens", "block_size", "max_seq_len",
                           "alibi_slopes")]
    # backend="cuda": every check runs before anything is built, with or without a GPU.
    with pytest.raises(ValueError, match=phrase):
        if version in ("naive", "v1"):
            getattr(lab, f"paged_attention_{version}")(*args, backend="cuda")
        else:
            lab.paged_attention_v2(args[0], *bufs, *args[1:], backend="cuda")
    assert torch.equal(a["out"], before), (
        f"paged_attention_{version} raised for {case} but wrote out first "
        f"({int((a['out'] != before).sum())} entries changed): check inputs before launching")


@pytest.mark.starter_ok
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
def test_the_emulation_backend_rejects_tensors_off_the_cpu(version):
    a = cpu_batch(seq_lens=torch.empty(2, dtype=torch.int32, device="meta"))
    num_seqs, nh, hs = a["out"].shape
    bufs = (torch.zeros(num_seqs, nh, 1), torch.zeros(num_seqs, nh, 1),
            torch.zeros(num_seqs, nh, 1, hs, dtype=a["out"].dtype))
    args = [a[k] for k in ("out", "query", "key_cache", "value_cache", "num_kv_heads", "scale",
                           "block_tables", "seq_lens", "block_size", "max_seq_len",
                           "alibi_slopes")]
    with pytest.raises(ValueError, match="seq_lens is on meta"):
        if version in ("naive", "v1"):
            getattr(lab, f"paged_attention_{version}")(*args, backend="emulation")
        else:
            lab.paged_attention_v2(args[0], *bufs, *args[1:], backend="emulation")
    with pytest.raises(ValueError, match="must be one of"):
        lab.paged_attention_v1(*cpu_batch().values(), backend="gpu")


@pytest.mark.starter_ok
def test_the_probes_reject_bad_input_before_anything_is_written():
    """The task 1 and 2 probes check their inputs as the kernels' ops do (given code). CPU
    tensors and the emulation backend: each call fails its checks before anything is built."""
    emu = "emulation"
    a = cpu_batch()
    common = [a[k] for k in ("query", "key_cache", "value_cache", "num_kv_heads", "scale",
                             "block_tables", "seq_lens", "block_size", "max_seq_len")]
    logits, range_max = torch.zeros(2, 4, 32), torch.zeros(2, 4, 1)
    with pytest.raises(ValueError, match="logits must be"):
        lab.qk_logits_probe(torch.zeros(2, 4, 16), range_max, *common, backend=emu)
    with pytest.raises(ValueError, match="range_max must be"):
        lab.qk_logits_probe(logits, torch.zeros(2, 4, 2), *common, backend=emu)
    with pytest.raises(ValueError, match="range_tokens"):
        lab.qk_logits_probe(logits, range_max, *common, range_tokens=24, backend=emu)
    with pytest.raises(ValueError, match="head_size"):  # the kernels' own checks come first
        lab.qk_logits_probe(logits, range_max, torch.randn(2, 4, 72).half(), *common[1:],
                            backend=emu)
    assert not logits.any() and not range_max.any(), (
        f"a rejected qk_logits_probe must not write: {int(logits.count_nonzero())} logits and "
        f"{int(range_max.count_nonzero())} range maxes changed")
    rows, stats = torch.ones(3, 40), torch.zeros(3, 128, 2)
    for lengths, phrase in ((torch.tensor([1, 0, 5], dtype=torch.int32), "every length"),
                            (torch.tensor([1, 41, 5], dtype=torch.int32), "every length"),
                            (torch.tensor([1, 2, 5]), "lengths must be")):
        with pytest.raises(ValueError, match=phrase):
            lab.softmax_probe(rows, lengths, stats, backend=emu)
    with pytest.raises(ValueError, match="stats must be"):
        lab.softmax_probe(rows, torch.ones(3, dtype=torch.int32), torch.zeros(3, 64, 2),
                          backend=emu)
    assert torch.equal(rows, torch.ones(3, 40)) and not stats.any(), (
        f"a rejected softmax_probe must not write: rows changed in "
        f"{int((rows != 1).sum())} entries, stats in {int(stats.count_nonzero())}")


@pytest.mark.starter_ok
def test_v2_rejects_partition_buffers_too_small_for_max_seq_len():
    a = cpu_batch(max_seq_len=600)  # needs 2 partitions of 512
    small = (torch.zeros(2, 4, 1), torch.zeros(2, 4, 1), torch.zeros(2, 4, 1, 64).half())
    with pytest.raises(ValueError, match="exp_sums"):
        lab.paged_attention_v2(a["out"], *small, a["query"], a["key_cache"], a["value_cache"], 2,
                               0.125, a["block_tables"], a["seq_lens"], 16, 600)


@pytest.mark.starter_ok
def test_reference_cache_ops_reject_bad_input():
    from mini_vllm.csrc import ops

    k = torch.zeros(6, 2, 8, 16, 8).half()
    v = torch.zeros(6, 2, 64, 16).half()
    key = torch.zeros(3, 2, 64).half()
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache(key, key, k, v, torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="key_cache"):
        ops.reshape_and_cache(key, key, v, v, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="CUDA"):
        ops.reshape_and_cache(key, key, k, v, torch.zeros(3, dtype=torch.int64), backend="cuda")
    with pytest.raises(ValueError, match="outside"):
        ops.swap_blocks(k, k.clone(), torch.tensor([[0, 6]]))
    with pytest.raises(ValueError, match="twice"):
        ops.swap_blocks(k, k, torch.tensor([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match="CUDA"):
        ops.swap_blocks(k, k.clone(), torch.tensor([[0, 1]]), backend="cuda")
    with pytest.raises(ValueError, match="int64"):
        ops.copy_blocks([k], [v], torch.tensor([[0, 1]], dtype=torch.int32))


@pytest.mark.starter_ok
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_the_engine_is_told_to_use_the_pytorch_ops():
    import mini_vllm.csrc as csrc

    available = csrc.cuda_ops_available()
    assert available is False, (
        f"without a GPU cuda_ops_available() must be False (the engine then uses the PyTorch "
        f"ops); it returned {available!r}")
    with pytest.raises(csrc.CudaBuildError, match="GPU"):
        csrc.build_extension("never_built", ["cache_kernels.cu"])


# ------------------------------------------------------------------------------------------
# CPU with nvcc: the sources compile without torch, and no kernel is left empty
# ------------------------------------------------------------------------------------------

NVCC_ARCH = "sm_90"  # Hopper (H100/H200), the course's target


@cache
def _compile_to_ptx(path: str) -> tuple[int, str, str]:
    """(return code, compiler output, PTX) for one translation unit, plain nvcc, no torch.

    MINI_VLLM_COMPILE_CHECK limits the instantiations (all dtypes, head 128, block 16) so that
    this stays quick on a small machine; the full set is built on the GPU machine.
    """
    from mini_vllm.csrc import CSRC_DIR

    with tempfile.TemporaryDirectory(prefix="lab0206-") as tmp:
        ptx = Path(tmp) / "out.ptx"
        cmd = ["nvcc", "-std=c++17", f"-arch={NVCC_ARCH}", "-ptx", "-DMINI_VLLM_COMPILE_CHECK",
               f"-I{CSRC_DIR}", str(path), "-o", str(ptx)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        text = ptx.read_text() if ptx.is_file() else ""
    return proc.returncode, proc.stdout + proc.stderr, text


def compiled_sources() -> dict[str, tuple[int, str, str]]:
    paths = [str(p) for p in kernel_source_paths()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile_to_ptx, paths))
    return dict(zip(paths, results))


def ptx_kernels(ptx: str) -> dict[str, str]:
    """Kernel name (mangled) -> its PTX body."""
    pieces = re.split(r"(?m)^\.(?:visible|weak) \.entry ", ptx)[1:]
    return {piece.split("(", 1)[0]: piece for piece in pieces}


@cache
def kernel_name(mangled: str) -> str:
    """The C++ name of a PTX entry, `paged_attention_v1_kernel<__half, 128, 16, 128>`, from its
    mangled one (c++filt demangles it; without c++filt the mangled name is what there is)."""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return mangled
    return name.split("(", 1)[0].removeprefix("void ").removeprefix("mini_vllm::") or mangled


# The tasks of starter.cu each kernel runs: its launcher refuses it until they are marked done.
KERNEL_TASKS = {"paged_attention_naive_kernel": (0,), "qk_logits_probe_kernel": (1,),
                "softmax_probe_kernel": (2,), "paged_attention_v1_kernel": (1, 2, 3),
                "paged_attention_v2_kernel": (1, 2, 3), "partition_reduce_kernel": (4,)}


def unfinished_task(source: str, name: str) -> str | None:
    """starter.cu's own "lab 02-06, task N: ..." message for the first task kernel `name` needs
    that `source` does not mark done (LAB_TASK_N_DONE 0); None when every one is done, or when
    `source` has no such marks (the reference's sources)."""
    text = Path(source).read_text(encoding="utf-8")
    for task in KERNEL_TASKS.get(name.split("<", 1)[0], ()):
        if re.search(rf"^#define LAB_TASK_{task}_DONE\s+0\b", text, re.M):
            said = re.search(rf'"(lab 02-06, task {task}: [^"]*)"', text)
            return said.group(1) if said else f"lab 02-06, task {task}: not done in starter.cu"
    return None


def check_each_kernel(check, wanted=lambda name: True) -> None:
    """Call check(source file name, kernel's C++ name, PTX body) for every kernel of every
    source for which wanted(C++ name) holds, once each compiled. The kernels of finished tasks
    are checked first; then a kernel of an unfinished task raises NotImplementedError with its
    task's message, as the kernels' launchers do, instead of failing on a kernel the student
    has not written yet."""
    waiting = []
    for path, (code, output, ptx) in compiled_sources().items():
        assert code == 0, nvcc_failure(path, output)
        kernels = ptx_kernels(ptx)
        assert kernels, f"{Path(path).name} defines no kernel (no .entry in nvcc's PTX)"
        for mangled, body in kernels.items():
            name = kernel_name(mangled)
            if not wanted(name):
                continue
            todo = unfinished_task(path, name)
            if todo:
                waiting.append(todo)
            else:
                check(Path(path).name, name, body)
    if waiting:
        raise NotImplementedError(sorted(waiting)[0])


def nvcc_failure(path: str, output: str) -> str:
    """nvcc's first error on the first line (what to fix), then the end of its output."""
    from mini_vllm.csrc import first_compiler_error

    first = first_compiler_error(output) or "nvcc failed (its output below)"
    return f"nvcc could not compile {Path(path).name}: {first}\n{output[-4000:]}"


@pytest.mark.starter_ok
@pytest.mark.nvcc
def test_kernel_sources_compile_with_plain_nvcc():
    for path, (code, output, _) in compiled_sources().items():
        assert code == 0, nvcc_failure(path, output)


@pytest.mark.nvcc
def test_every_kernel_reads_and_writes_global_memory():
    def check(source: str, name: str, body: str) -> None:
        # Tested apart, so that a failure prints the message, not the whole PTX.
        stores, loads = "st.global" in body, "ld.global" in body
        assert stores, (
            f"lab 02-06: kernel {name} in {source} never stores to global memory, so its "
            "output is never written: finish its task (tasks 0-4 in the README)")
        assert loads, (
            f"lab 02-06: kernel {name} in {source} never loads from global memory: it must read "
            "its inputs (query, caches, block tables)")

    check_each_kernel(check)


@pytest.mark.nvcc
def test_attention_kernels_load_the_cache_with_vector_loads():
    # With head 128 and block 16 every dtype loads 8 or 16 bytes per lane for K and V.
    def check(source: str, name: str, body: str) -> None:
        vector_loads = re.search(r"ld\.global(\.nc)?\.v[24]\.", body) is not None
        assert vector_loads, (
            f"lab 02-06: kernel {name} in {source} reads the cache without vector loads (no "
            "ld.global.v2/.v4 in its PTX); load each lane's slice of a 16-byte chunk with "
            "load_as_float (tasks 1 and 3)")

    # The naive kernel (task 0) is the scalar-load baseline.
    check_each_kernel(check, lambda name: "paged_attention" in name and "naive" not in name)


# ------------------------------------------------------------------------------------------
# Kernels against the oracle: given reference ops first, then the lab's kernels
# ------------------------------------------------------------------------------------------

GQA_CASES = (
    [pytest.param(h, hs, a, marks=pytest.mark.cuda,
                  id=f"{name}-d{hs}-{'alibi' if a else 'plain'}")
     for h, name in [((40, 40), "mha"), ((64, 8), "group8"), ((48, 16), "group3"),
                     ((128, 8), "group16")]
     for hs in (64, 128, 256) for a in (False, True)]
    if ON_GPU else
    [pytest.param((16, 2), 128, True, marks=pytest.mark.emulation, id="group8-d128-alibi"),
     pytest.param((12, 4), 128, False, marks=pytest.mark.emulation, id="group3-d128-plain"),
     pytest.param((20, 1), 128, True, marks=pytest.mark.emulation, id="group20-d128-alibi")]
)


@pytest.mark.starter_ok
@pytest.mark.oracle
@pytest.mark.parametrize("num_heads, head_size, use_alibi", GQA_CASES)
def test_reference_gqa_kernel_matches_the_oracle(num_heads, head_size, use_alibi):
    from mini_vllm.csrc.ops import paged_attention_gqa

    require(KERNEL_BACKEND)
    kw = {} if ON_GPU else dict(num_seqs=EMU_NUM_SEQS, max_len=EMU_MAX_LEN)
    b = make_batch(num_heads=num_heads, head_size=head_size, block_size=16, use_alibi=use_alibi,
                   **kw)
    assert_close(run_kernel("v2", b, fn=paged_attention_gqa), expected_output(b),
                 msg="GQA-aware kernel")


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype, block_size", [(torch.float32, 8), (torch.bfloat16, 32)]
                         if ON_GPU else [(torch.float32, 8), (torch.bfloat16, 16)],
                         ids=["fp32-via-v2", "bf16"])
def test_reference_gqa_kernel_in_other_dtypes_and_block_sizes(dtype, block_size):
    from mini_vllm.csrc.ops import paged_attention_gqa

    require(KERNEL_BACKEND)
    kw = {} if ON_GPU else dict(num_seqs=EMU_NUM_SEQS, max_len=EMU_MAX_LEN)
    # In the emulation, instantiations the oracle grid builds anyway.
    head_size = 128 if ON_GPU else (80 if dtype == torch.float32 else 112)
    if not ON_GPU:
        block_size = 8 if dtype == torch.float32 else 16
    b = make_batch(num_heads=(32, 4) if ON_GPU else (8, 1), head_size=head_size,
                   block_size=block_size, dtype=dtype, use_alibi=True, **kw)
    assert_close(run_kernel("v2", b, fn=paged_attention_gqa), expected_output(b),
                 msg=f"GQA-aware kernel, {dtype}, block {block_size}")


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("partition_size", [64, 128, 256])
def test_reference_gqa_kernel_with_smaller_partitions(partition_size):
    """The GQA-aware kernel's partition size is chosen from the shape (small batches and short
    contexts get smaller partitions, so more thread blocks); every size gives v2's result."""
    from mini_vllm.csrc.ops import gqa_num_partitions, paged_attention_gqa

    require(KERNEL_BACKEND)
    kw = {} if ON_GPU else dict(num_seqs=EMU_NUM_SEQS, max_len=EMU_MAX_LEN)
    b = make_batch(num_heads=(8, 2), head_size=128, block_size=16, use_alibi=True, **kw)
    parts = gqa_num_partitions(b["max_seq_len"], partition_size)
    num_seqs, nh, hs = b["query"].shape
    dev = b["query"].device
    bufs = (torch.full((num_seqs, nh, parts), float("nan"), device=dev),
            torch.full((num_seqs, nh, parts), float("nan"), device=dev),
            torch.full((num_seqs, nh, parts, hs), float("nan"), dtype=b["query"].dtype,
                       device=dev))
    out = torch.full_like(b["query"], float("nan"))
    paged_attention_gqa(out, *bufs, b["query"], b["poisoned_k"], b["poisoned_v"],
                        b["num_kv_heads"], b["scale"], b["block_tables"], b["seq_lens"],
                        b["block_size"], b["max_seq_len"], b["alibi_slopes"],
                        backend=KERNEL_BACKEND, partition_size=partition_size)
    if ON_GPU:
        torch.cuda.synchronize()
    assert_close(out, expected_output(b),
                 msg=f"GQA-aware kernel, {partition_size}-token partitions")
    # Partitions past a sequence's end are never written (NaN stays), the others are.
    written = ~bufs[0][:, 0].isnan()
    lens = b["seq_lens"].cpu()
    for s in range(num_seqs):
        want = gqa_num_partitions(int(lens[s]), partition_size)
        assert written[s].tolist() == [i < want for i in range(parts)], (
            f"sequence {s} ({int(lens[s])} tokens) must have exactly its {want} partitions of "
            f"{partition_size} tokens written; written: {written[s].tolist()}")
    too_narrow = tuple(t[:, :, :1].contiguous() for t in bufs)
    if parts > 1:
        with pytest.raises(ValueError, match="exp_sums"):
            paged_attention_gqa(out, *too_narrow, b["query"], b["key_cache"], b["value_cache"],
                                b["num_kv_heads"], b["scale"], b["block_tables"], b["seq_lens"],
                                b["block_size"], b["max_seq_len"], b["alibi_slopes"],
                                backend=KERNEL_BACKEND, partition_size=partition_size)


@pytest.mark.starter_ok
@pytest.mark.oracle
@pytest.mark.emulation
def test_reference_gqa_kernel_on_a_modelled_t4(monkeypatch):
    """bf16 matrix operations need sm_80: on a T4 (sm_75) the launcher takes the scalar kernel
    for bf16 and the tensor-core kernel for fp16; both are right."""
    from mini_vllm.csrc.ops import paged_attention_gqa

    require("emulation")
    monkeypatch.setenv("MINI_VLLM_EMU_DEVICE", "t4")
    for dtype in (torch.bfloat16, torch.float16):
        b = make_batch(num_heads=(8, 1), head_size=112 if dtype == torch.bfloat16 else 128,
                       block_size=16, dtype=dtype, device="cpu", num_seqs=3, max_len=700)
        assert_close(run_kernel("v2", b, fn=paged_attention_gqa, backend="emulation"),
                     expected_output(b), msg=f"GQA-aware kernel on a T4, {dtype}")


def check_reshape_and_cache(dtype: torch.dtype, block_size: int, backend: str) -> None:
    from mini_vllm.attention import cache_ops
    from mini_vllm.csrc import ops

    dev = "cuda" if backend == "cuda" else "cpu"
    gen = torch.Generator(device=dev).manual_seed(1)
    num_tokens, nkv, hs, num_blocks = 37, 4, 128, 12
    x = 16 // torch.empty((), dtype=dtype).element_size()
    key = torch.randn(num_tokens, nkv, hs, generator=gen, device=dev).to(dtype)
    value = torch.randn(num_tokens, nkv, hs, generator=gen, device=dev).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:num_tokens]
    slots[::5] = -1  # padding tokens
    kc = torch.randn(num_blocks, nkv, hs // x, block_size, x, generator=gen, device=dev)
    vc = torch.randn(num_blocks, nkv, hs, block_size, generator=gen, device=dev)
    kc, vc = kc.to(dtype), vc.to(dtype)
    ek, ev = kc.clone(), vc.clone()
    cache_ops.reshape_and_cache(key, value, ek, ev, slots)
    ops.reshape_and_cache(key, value, kc, vc, slots, backend=backend)
    if backend == "cuda":
        torch.cuda.synchronize()
    assert_close(kc, ek, atol=0, rtol=0, msg=f"reshape_and_cache ({backend}): the key cache")
    assert_close(vc, ev, atol=0, rtol=0, msg=f"reshape_and_cache ({backend}): the value cache")
    # A padded batch: the slot mapping covers the first 30 tokens; the padding rows (NaN) of key
    # and value are not read, as upstream and the PyTorch op do.
    key[30:], value[30:] = float("nan"), float("nan")
    cache_ops.reshape_and_cache(key, value, ek, ev, slots[:30])
    ops.reshape_and_cache(key, value, kc, vc, slots[:30], backend=backend)
    if backend == "cuda":
        torch.cuda.synchronize()
    assert_close(kc, ek, atol=0, rtol=0, msg="reshape_and_cache of a padded batch: key cache")
    assert_close(vc, ev, atol=0, rtol=0, msg="reshape_and_cache of a padded batch: value cache")
    assert not kc.isnan().any(), (
        f"a padding row (slot_mapping -1 or past its end, NaN here) reached the key cache: "
        f"{int(kc.isnan().sum())} NaN entries")


def check_copy_and_swap_blocks(backend: str) -> None:
    from mini_vllm.attention import cache_ops
    from mini_vllm.csrc import ops

    dev = "cuda" if backend == "cuda" else "cpu"
    gen = torch.Generator(device=dev).manual_seed(2)
    layers = [(torch.randn(10, 2, 8, 16, 8, generator=gen, device=dev).half(),
               torch.randn(10, 2, 64, 16, generator=gen, device=dev).half()) for _ in range(3)]
    mapping = torch.tensor([[0, 5], [3, 7], [9, 1]], dtype=torch.int64)
    mine = [(k.clone(), v.clone()) for k, v in layers]
    ops.copy_blocks([k for k, _ in mine], [v for _, v in mine], mapping, backend=backend)
    cache_ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping)
    if backend == "cuda":
        torch.cuda.synchronize()
    for layer, ((k, v), (ek, ev)) in enumerate(zip(mine, layers)):
        assert_close(k, ek, atol=0, rtol=0, msg=f"copy_blocks ({backend}), key cache {layer}")
        assert_close(v, ev, atol=0, rtol=0, msg=f"copy_blocks ({backend}), value cache {layer}")

    gpu = layers[0][0]
    cpu = torch.zeros(4, *gpu.shape[1:], dtype=gpu.dtype)
    if backend == "cuda":
        cpu = cpu.pin_memory()
    ops.swap_blocks(gpu, cpu, torch.tensor([[2, 0], [8, 3]]), backend=backend)
    if backend == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(cpu[0], gpu[2].cpu()) and torch.equal(cpu[3], gpu[8].cpu()), (
        f"swap_blocks({backend}) with mapping [[2, 0], [8, 3]] must copy GPU block 2 to CPU "
        f"block 0 and 8 to 3; equal: {torch.equal(cpu[0], gpu[2].cpu())}, "
        f"{torch.equal(cpu[3], gpu[8].cpu())}")
    back = torch.zeros_like(gpu)
    ops.swap_blocks(cpu, back, torch.tensor([[3, 6]]), backend=backend)
    if backend == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(back[6], gpu[8]) and not back[:6].any(), (
        f"swap_blocks({backend}) with mapping [[3, 6]] must copy CPU block 3 to block 6 and "
        f"write nothing else; block 6 right: {torch.equal(back[6], gpu[8])}, nonzero entries "
        f"in blocks 0-5: {int(back[:6].count_nonzero())}")


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_reshape_and_cache_matches_the_oracle(dtype, block_size):
    require(KERNEL_BACKEND)
    check_reshape_and_cache(dtype, block_size, KERNEL_BACKEND)


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
def test_reference_copy_and_swap_blocks_match_the_oracle():
    require(KERNEL_BACKEND)
    check_copy_and_swap_blocks(KERNEL_BACKEND)


# ------------------------------------------------------------------------------------------
# The reference's FP8 (e4m3) KV cache: reshape_and_cache quantizes with k_scale / v_scale, v1 and
# v2 dequantize on read. Given code (the student's kernels read model-dtype caches only).
# ------------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn
# Different enough that a kernel using one scale for the other is far off; the caches' bytes
# span e4m3's range (normals and subnormals).
K_SCALE, V_SCALE = 0.02, 0.004
FP8_CASES = [  # (dtype, head_size, block_size, (num_heads, num_kv_heads), ALiBi)
    pytest.param(torch.float16, 128, 16, (8, 2), True, id="fp16-d128-b16-gqa-alibi"),
    pytest.param(torch.bfloat16, 64, 32, (4, 4), False, id="bf16-d64-b32"),
    pytest.param(torch.float32, 80, 8, (6, 1), True, id="fp32-d80-b8-mqa-alibi"),
]


def fp8_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache stores for x, by the test's own one-liner (not mini_vllm's)."""
    return (x.float() / scale).clamp(-448, 448).to(E4M3)


def fp8_batch(dtype, head_size, block_size, num_heads, use_alibi) -> dict:
    """make_batch's batch (block tables, lengths, query) with fp8 caches in place of its caches:
    random keys (values) quantized with K_SCALE (V_SCALE) in the fp8 layout (x = 16), and in the
    kernel's copies the unused slots of last blocks hold NaN (byte 0x7f)."""
    b = make_batch(num_heads=num_heads, head_size=head_size, block_size=block_size, dtype=dtype,
                   use_alibi=use_alibi, device="cpu", num_seqs=4, max_len=600)
    gen = torch.Generator().manual_seed(7)
    num_blocks, nkv = b["key_cache"].shape[:2]
    keys = torch.randn(num_blocks, nkv, head_size // 16, block_size, 16, generator=gen) * 3
    values = torch.rand(num_blocks, nkv, head_size, block_size, generator=gen) * 2 - 1
    b["key_cache"], b["value_cache"] = fp8_quant(keys, K_SCALE), fp8_quant(values, V_SCALE)
    b["poisoned_k"], b["poisoned_v"] = b["key_cache"].clone(), b["value_cache"].clone()
    for s, n in enumerate(b["seq_lens"].tolist()):
        if n % block_size:
            last = int(b["block_tables"][s, (n - 1) // block_size])
            b["poisoned_k"].view(torch.uint8)[last, :, :, n % block_size:, :] = 0x7F
            b["poisoned_v"].view(torch.uint8)[last, :, :, n % block_size:] = 0x7F
    return b


def run_fp8(version: str, b: dict, backend: str = KERNEL_BACKEND) -> torch.Tensor:
    """The reference v1 or v2 (mini_vllm.csrc.ops) on b's poisoned fp8 caches."""
    from mini_vllm.csrc import ops

    dev = "cuda" if backend == "cuda" else "cpu"
    on = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    out = torch.full_like(on["query"], float("nan"))
    args = (on["query"], on["poisoned_k"], on["poisoned_v"], on["num_kv_heads"], on["scale"],
            on["block_tables"], on["seq_lens"], on["block_size"], on["max_seq_len"],
            on["alibi_slopes"], "fp8", K_SCALE, V_SCALE)
    if version == "v1":
        ops.paged_attention_v1(out, *args, backend=backend)
    else:
        ops.paged_attention_v2(out, *partition_buffers(on), *args, backend=backend)
    return out.cpu()


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype, head_size, block_size, num_heads, use_alibi", FP8_CASES)
def test_reference_kernels_on_an_fp8_cache_match_the_oracle(version, dtype, head_size,
                                                            block_size, num_heads, use_alibi):
    """v1 and v2 read an fp8 cache as stored * k_scale (keys) and stored * v_scale (values):
    the result is lab 02-04's PyTorch oracle on the same fp8 cache and scales, to fp32
    rounding; the NaN bytes in unused slots never reach it."""
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle_v1

    require(KERNEL_BACKEND)
    b = fp8_batch(dtype, head_size, block_size, num_heads, use_alibi)
    want = torch.empty_like(b["query"])
    oracle_v1(want, b["query"], b["key_cache"], b["value_cache"], b["num_kv_heads"], b["scale"],
              b["block_tables"], b["seq_lens"], b["block_size"], b["max_seq_len"],
              b["alibi_slopes"], "fp8", K_SCALE, V_SCALE)
    assert_close(run_fp8(version, b), want, msg=f"{version} on an fp8 cache")


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_reshape_and_cache_writes_the_oracles_fp8_bytes(dtype):
    """reshape_and_cache into an fp8 cache stores e4m3(clamp(x / scale, -448, 448)) in the
    x = 16 layout: byte for byte the oracle's, saturation, padding slots and NaN included;
    slots it does not write keep their bytes."""
    from mini_vllm.attention import cache_ops
    from mini_vllm.csrc import ops

    require(KERNEL_BACKEND)
    dev = "cuda" if KERNEL_BACKEND == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(3)
    num_tokens, nkv, hs, bs, num_blocks = 29, 2, 64, 16, 5
    key = (torch.randn(num_tokens + 3, nkv, hs, generator=gen) * 4).to(dtype)
    value = (torch.randn(num_tokens + 3, nkv, hs, generator=gen) * 0.5).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, float("nan"), 0.0]).to(dtype)  # saturates, NaN
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens
    noise = torch.randint(0, 126, (num_blocks * nkv * hs * bs,), generator=gen, dtype=torch.uint8)
    kc = noise.clone().view(torch.float8_e4m3fn).view(num_blocks, nkv, hs // 16, bs, 16)
    vc = noise.flip(0).view(torch.float8_e4m3fn).view(num_blocks, nkv, hs, bs)
    ek, ev = kc.clone(), vc.clone()
    cache_ops.reshape_and_cache(key, value, ek, ev, slots, "fp8", K_SCALE, V_SCALE)
    got_k, got_v = kc.to(dev), vc.to(dev)
    ops.reshape_and_cache(key.to(dev), value.to(dev), got_k, got_v, slots.to(dev), "fp8",
                          K_SCALE, V_SCALE, backend=KERNEL_BACKEND)
    for name, got, want in (("key_cache", got_k, ek), ("value_cache", got_v, ev)):
        assert_close(got.cpu().view(torch.uint8), want.view(torch.uint8), atol=0, rtol=0,
                     msg=f"fp8 {name} bytes")
    assert not torch.equal(ek.view(torch.uint8), noise.view(ek.shape)), (
        "the oracle's reshape_and_cache wrote no byte of the key cache: this test's setup is "
        "broken, not the kernel")


FP8_BAD = {
    "k_scale zero": dict(k_scale=0.0),
    "v_scale negative": dict(v_scale=-0.5),
    "k_scale nan": dict(k_scale=float("nan")),
    "v_scale inf": dict(v_scale=float("inf")),
    "fp8 cache named auto": dict(kv_cache_dtype="auto"),
    "fp8 cache with x = 8": dict(key_layout_x=8),
    "model-dtype cache named fp8": dict(model_cache=True),
}


@pytest.mark.starter_ok
@pytest.mark.parametrize("op", ["v1", "v2", "reshape_and_cache"])
@pytest.mark.parametrize("case", sorted(FP8_BAD))
def test_reference_fp8_ops_reject_bad_input_before_writing(op, case):
    """A scale that is zero, negative or not finite, an fp8 cache without kv_cache_dtype="fp8"
    (or the reverse), an fp8 key cache in the x = 8 layout: ValueError, nothing written."""
    from mini_vllm.csrc import ops

    bad = dict(FP8_BAD[case])
    kv = dict(kv_cache_dtype=bad.pop("kv_cache_dtype", "fp8"), k_scale=bad.pop("k_scale", 0.1),
              v_scale=bad.pop("v_scale", 0.1))
    x = bad.pop("key_layout_x", 16)
    nb, nkv, hs, bs = 4, 2, 64, 16
    dtype = torch.float16
    if bad.pop("model_cache", False):
        kc, vc = torch.zeros(nb, nkv, hs // 8, bs, 8, dtype=dtype), torch.zeros(nb, nkv, hs, bs,
                                                                                dtype=dtype)
    else:
        kc = torch.zeros(nb, nkv, hs // x, bs, x).to(E4M3)
        vc = torch.zeros(nb, nkv, hs, bs).to(E4M3)
    before = (kc.clone(), vc.clone())
    with pytest.raises(ValueError):
        if op == "reshape_and_cache":
            key = torch.ones(3, nkv, hs, dtype=dtype)
            ops.reshape_and_cache(key, key.clone(), kc, vc, torch.tensor([0, 1, 2]), **kv,
                                  backend="emulation")
        else:
            q = torch.ones(2, 4, hs, dtype=dtype)
            out = torch.full_like(q, 7.0)
            args = (q, kc, vc, nkv, 0.125, torch.zeros(2, 2, dtype=torch.int32),
                    torch.tensor([3, 20], dtype=torch.int32), bs, 20)
            if op == "v1":
                ops.paged_attention_v1(out, *args, **kv, backend="emulation")
            else:
                bufs = (torch.zeros(2, 4, 1), torch.zeros(2, 4, 1), torch.zeros(2, 4, 1, hs,
                                                                                dtype=dtype))
                ops.paged_attention_v2(out, *bufs, *args, **kv, backend="emulation")
            assert (out == 7.0).all(), (
                f"{op} ({case}) raised but wrote out first: {int((out != 7.0).sum())} entries "
                "changed")

    def same_bytes(t: torch.Tensor, u: torch.Tensor) -> bool:
        return torch.equal(t.view(torch.uint8), u.view(torch.uint8)) if t.dtype == E4M3 else \
            torch.equal(t, u)

    for name, now, was in (("key_cache", kc, before[0]), ("value_cache", vc, before[1])):
        assert same_bytes(now, was), f"{op} ({case}) raised but wrote the {name} first"


@pytest.mark.starter_ok
@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype, head_size, block_size, num_heads, partition_size", [
    pytest.param(torch.float16, 128, 8, (16, 2), 64, id="fp16-d128-b8-group8-p64"),
    pytest.param(torch.bfloat16, 80, 32, (12, 1), 512, id="bf16-d80-b32-group12-p512"),
])
def test_reference_gqa_kernel_on_an_fp8_cache_matches_the_oracle(dtype, head_size, block_size,
                                                                 num_heads, partition_size):
    """The GQA-aware kernel reads an fp8 cache as v1 and v2 do (its scalar path): the oracle's
    result on the same cache and scales, groups larger than one thread block's 8 heads and
    partitions smaller than v2's included."""
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle_v1
    from mini_vllm.csrc import ops

    require(KERNEL_BACKEND)
    b = fp8_batch(dtype, head_size, block_size, num_heads, True)
    dev = "cuda" if KERNEL_BACKEND == "cuda" else "cpu"
    on = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    want = torch.empty_like(b["query"])
    common = (b["num_kv_heads"], b["scale"], b["block_tables"], b["seq_lens"], b["block_size"],
              b["max_seq_len"], b["alibi_slopes"], "fp8", K_SCALE, V_SCALE)
    oracle_v1(want, b["query"], b["key_cache"], b["value_cache"], *common)
    num_seqs, nh, hs = b["query"].shape
    parts = ops.gqa_num_partitions(b["max_seq_len"], partition_size)
    bufs = (torch.empty(num_seqs, nh, parts, device=dev), torch.empty(num_seqs, nh, parts,
                                                                       device=dev),
            torch.empty(num_seqs, nh, parts, hs, dtype=dtype, device=dev))
    out = torch.full_like(on["query"], float("nan"))
    ops.paged_attention_gqa(out, *bufs, on["query"], on["poisoned_k"], on["poisoned_v"],
                            *[on[k] for k in ("num_kv_heads", "scale", "block_tables",
                                              "seq_lens", "block_size", "max_seq_len",
                                              "alibi_slopes")],
                            "fp8", K_SCALE, V_SCALE, backend=KERNEL_BACKEND,
                            partition_size=partition_size)
    assert_close(out.cpu(), want, msg="GQA-aware kernel on an fp8 cache")


@pytest.mark.starter_ok
@pytest.mark.oracle
@pytest.mark.emulation
def test_paged_decode_passes_the_fp8_cache_to_the_kernel_it_chooses():
    """paged_decode (the engine's decode on a GPU) hands kv_cache_dtype and the scales to the
    kernel it chooses: here the GQA-aware one."""
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle_v1
    from mini_vllm.csrc import ops

    require("emulation")
    b = fp8_batch(torch.float16, 64, 16, (8, 2), False)
    args = (b["query"], b["key_cache"], b["value_cache"], b["num_kv_heads"], b["scale"],
            b["block_tables"], b["seq_lens"], b["block_size"], b["max_seq_len"], None)
    out = torch.full_like(b["query"], float("nan"))
    kernel = ops.paged_decode(out, *args, kv_cache_dtype="fp8", k_scale=K_SCALE,
                              v_scale=V_SCALE, backend="emulation")
    assert kernel == "gqa", (
        f"paged_decode chose the {kernel!r} kernel for 8 query heads on 2 KV heads, head 64, "
        "an fp8 cache; the GQA-aware one ('gqa') is the one that reads it")
    want = torch.empty_like(out)
    oracle_v1(want, *args, "fp8", K_SCALE, V_SCALE)
    assert_close(out, want, msg=f"paged_decode ({kernel}) on an fp8 cache")


# ------------------------------------------------------------------------------------------
# Tasks 1 and 2 alone: probes that run one step of the kernel and copy out its result
# (mini_vllm/csrc/attention_probes.cuh), so each task is checked before the next is written
# ------------------------------------------------------------------------------------------

# The probes' cases: the emulation grid's first three (GQA + ALiBi fp16, bf16 block 32, fp32
# block 8 with ALiBi and one KV head) cover every dtype, block size and the ALiBi term.
PROBE_GRID = [pytest.param(*case, id=f"{case[0]}-d{case[1]}-b{case[2]}".replace("torch.", ""))
              for case in EMU_GRID[:3]]
PROBE_LENS = [1, 9, 33, 100, 161, 300]  # one token, partial last blocks, several 64-token ranges


def run_probe(name: str, outputs: list[int], *args, backend: str = KERNEL_BACKEND,
              **kwargs) -> list[torch.Tensor]:
    """Call the lab's probe `name` on `backend` and return the arguments at `outputs` (which it
    writes)."""
    if backend == "cuda":  # in the worker process, on CPU copies, as run_kernel does
        return gpu_worker().call(
            "mini_vllm.csrc.isolation", "run_on_gpu", lab.module_loader(), name, outputs,
            *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], backend="cuda",
            **kwargs)
    getattr(lab, name)(*args, backend=backend, **kwargs)
    return [args[i] for i in outputs]


def expected_logits(b: dict) -> torch.Tensor:
    """[num_seqs, num_heads, slots] in float64: q . k_t * scale + ALiBi for every token t of a
    sequence (from the clean caches), 0 for the slots of its last block past its end, NaN for
    the slots of blocks it does not have (the probe does not write them)."""
    query, kc = b["query"].double().cpu(), b["key_cache"].double().cpu()
    num_seqs, num_heads, head_size = query.shape
    bs, group = b["block_size"], num_heads // b["num_kv_heads"]
    width = -(-b["max_seq_len"] // bs) * bs
    out = torch.full((num_seqs, num_heads, width), float("nan"), dtype=torch.float64)
    for s, n in enumerate(b["seq_lens"].tolist()):
        blocks = b["block_tables"][s, : -(-n // bs)].long().cpu()
        # [kv_heads, tokens, head_size] from [blocks, kv_heads, head_size / x, block, x]
        keys = kc[blocks].permute(1, 0, 3, 2, 4).reshape(kc.shape[1], -1, head_size)[:, :n]
        for h in range(num_heads):
            q = query[s, h].float().double() * b["scale"]
            logits = keys[h // group] @ q
            if b["alibi_slopes"] is not None:
                logits += float(b["alibi_slopes"][h]) * (torch.arange(n) - (n - 1))
            out[s, h, : blocks.numel() * bs] = 0.0
            out[s, h, :n] = logits
    return out


def check_task1(b: dict, range_tokens: int, what: str) -> None:
    from mini_vllm.csrc.probes import probe_shapes

    num_seqs, num_heads, _ = b["query"].shape
    width, ranges = probe_shapes(b["max_seq_len"], b["block_size"], range_tokens)
    logits = torch.full((num_seqs, num_heads, width), float("nan"), device=DEVICE)
    range_max = torch.full((num_seqs, num_heads, ranges), float("nan"), device=DEVICE)
    logits, range_max = run_probe(
        "qk_logits_probe", [0, 1], logits, range_max, b["query"], b["poisoned_k"],
        b["poisoned_v"], b["num_kv_heads"], b["scale"], b["block_tables"], b["seq_lens"],
        b["block_size"], b["max_seq_len"], b["alibi_slopes"], range_tokens=range_tokens)
    expected = expected_logits(b)
    assert_close(logits.cpu(), expected, dtype=torch.float32, dims=("sequence", "head", "slot"),
                 msg=f"lab 02-06, task 1 ({what}): the logits qk_logits stored (slot t of a "
                     "sequence's blocks: q . k_t + ALiBi for t < seq_len, 0 after; NaN: never "
                     "stored)")
    tokens = range_tokens or width
    valid = expected.nan_to_num(nan=-float("inf"))
    for s, n in enumerate(b["seq_lens"].tolist()):
        valid[s, :, n:] = -float("inf")
    want = torch.full((num_seqs, num_heads, ranges), float("nan"), dtype=torch.float64)
    for r in range(ranges):
        part = valid[:, :, r * tokens : (r + 1) * tokens]
        if part.numel():
            best = part.max(dim=2).values
            want[:, :, r] = torch.where(best > -float("inf"), best, float("nan"))
    assert_close(range_max.cpu(), want, dtype=torch.float32, dims=("sequence", "head", "range"),
                 msg=f"lab 02-06, task 1 ({what}): the max of the valid logits the threads "
                     "returned, over the thread block (NaN: a range the kernel never runs)")


@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype, head_size, block_size, num_heads, use_alibi", PROBE_GRID)
def test_task1_logits_over_a_whole_context(dtype, head_size, block_size, num_heads, use_alibi):
    """Task 1 alone, as v1 runs it: one thread block per (head, sequence) over all its blocks."""
    require(KERNEL_BACKEND)
    b = make_batch(num_heads=num_heads, head_size=head_size, block_size=block_size, dtype=dtype,
                   use_alibi=use_alibi, lens=PROBE_LENS, device=DEVICE)
    check_task1(b, 0, "one range per sequence, as v1")


@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("dtype, head_size, block_size, num_heads, use_alibi", PROBE_GRID)
def test_task1_logits_of_ranges_that_start_mid_sequence(dtype, head_size, block_size, num_heads,
                                                         use_alibi):
    """Task 1 alone, as v2 runs it, with ranges of 64 tokens: logits[i] is token start_token + i,
    and each range's max covers its own tokens only."""
    require(KERNEL_BACKEND)
    b = make_batch(num_heads=num_heads, head_size=head_size, block_size=block_size, dtype=dtype,
                   use_alibi=use_alibi, lens=PROBE_LENS, device=DEVICE, seed=1)
    check_task1(b, 64, "ranges of 64 tokens, as v2's partitions")


SOFTMAX_LENS = [1, 2, 31, 32, 33, 127, 128, 129, 300, 512, 700]
SOFTMAX_WIDTH = 704


def softmax_rows(offsets: list[float], filler: float,
                 lens: list[int] = SOFTMAX_LENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits (values in [-8, 8] plus each row's offset) of `lens` lengths; past
    a row's length every entry is `filler`, which the softmax must neither read nor write."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.full((len(lens), SOFTMAX_WIDTH), filler)
    for r, n in enumerate(lens):
        rows[r, :n] = torch.rand(n, generator=gen) * 16 - 8 + offsets[r % len(offsets)]
    return rows, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("offsets, filler", [
    pytest.param([0.0], 1e4, id="filler-above-the-max"),
    pytest.param([-600.0, 600.0], float("nan"), id="large-logits-nan-filler"),
])
def test_task2_softmax_in_place(offsets, filler):
    """Task 2 alone: exp(logit - max) over each row's first num_tokens entries, the max and the
    sum returned to every thread, and nothing past num_tokens read or written. Logits near
    -600 or 600 overflow or vanish unless the max is subtracted first."""
    require(KERNEL_BACKEND)
    check_task2(offsets, filler, KERNEL_BACKEND)


@pytest.mark.race
@pytest.mark.emulation
def test_task2_softmax_has_no_data_race():
    """Task 2 alone under ThreadSanitizer: each reduction has its own scratch buffer, or a fast
    warp writes its sum where a slow warp still reads the max (no barrier lies between them).
    The plain emulation runs the warps in an order where that comes out right."""
    require(RACE)
    check_task2([0.0], 1e4, RACE, lens=[33, 300])  # every warp of the block holds tokens


def check_task2(offsets: list[float], filler: float, backend: str,
                lens: list[int] = SOFTMAX_LENS) -> None:
    from mini_vllm.csrc.probes import PROBE_THREADS

    rows, lengths = softmax_rows(offsets, filler, lens)
    stats = torch.full((rows.shape[0], PROBE_THREADS, 2), float("nan"))
    before = rows.clone()
    dev = "cuda" if backend == "cuda" else "cpu"
    got, got_stats = run_probe("softmax_probe", [0, 2], rows.to(dev), lengths.to(dev),
                               stats.to(dev), backend=backend)
    got, got_stats = got.cpu(), got_stats.cpu()
    x = before.double()
    expected = x.clone()
    want_stats = torch.empty(rows.shape[0], PROBE_THREADS, 2, dtype=torch.float64)
    for r, n in enumerate(lens):
        m = x[r, :n].max()
        expected[r, :n] = (x[r, :n] - m).exp()
        want_stats[r, :, 0] = m
        want_stats[r, :, 1] = expected[r, :n].sum()
    assert_close(got, expected, dtype=torch.float32, dims=("row", "entry"),
                 msg="lab 02-06, task 2: logits[0, num_tokens) must become exp(logit - max); "
                     "the entries past num_tokens must be left as they are")
    assert_close(got_stats, want_stats, dtype=torch.float32, dims=("row", "thread", "stat"),
                 msg="lab 02-06, task 2: every thread must get the block's (max, sum of exp)")


def grid_params(versions=("v1", "v2")):
    if ON_GPU:
        return [
            pytest.param(version, torch.float16, hs, bs, h, alibi, marks=pytest.mark.cuda,
                         id=f"{version}-heads{h[0]}-{h[1]}-d{hs}-b{bs}-"
                            f"{'alibi' if alibi else 'plain'}")
            for h in GRID_HEADS for hs in GRID_HEAD_SIZES for bs in GRID_BLOCK_SIZES
            for alibi in (False, True) for version in versions
        ]
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return [
        pytest.param(version, dtype, hs, bs, h, alibi, marks=pytest.mark.emulation,
                     id=f"{version}-{names[dtype]}-heads{h[0]}-{h[1]}-d{hs}-b{bs}-"
                        f"{'alibi' if alibi else 'plain'}")
        for dtype, hs, bs, h, alibi in EMU_GRID for version in versions
    ]


def check_against_the_oracle(version, dtype, head_size, block_size, num_heads, use_alibi):
    require(KERNEL_BACKEND)
    kw = {} if ON_GPU else dict(num_seqs=EMU_NUM_SEQS, max_len=EMU_MAX_LEN)
    b = make_batch(num_heads=num_heads, head_size=head_size, block_size=block_size, dtype=dtype,
                   use_alibi=use_alibi, **kw)
    assert_close(run_kernel(version, b), expected_output(b),
                 msg=f"{version} vs the PyTorch oracle")


@pytest.mark.oracle
@pytest.mark.parametrize("version, dtype, head_size, block_size, num_heads, use_alibi",
                         grid_params(("naive",)))
def test_task0_naive_kernel_matches_the_pytorch_oracle(version, dtype, head_size, block_size,
                                                       num_heads, use_alibi):
    check_against_the_oracle(version, dtype, head_size, block_size, num_heads, use_alibi)


@pytest.mark.oracle
@WHERE
def test_task0_naive_kernel_up_to_its_shared_memory_limit_and_refuses_past_it():
    """The naive kernel keeps one fp32 logit per token in the 48 KB of shared memory a block
    gets without opting in: the longest context it takes must work, one token more is refused
    before anything is written."""
    from mini_vllm.csrc.ops import naive_max_seq_len

    require(KERNEL_BACKEND)
    limit = naive_max_seq_len(64)
    b = make_batch(num_heads=(2, 1), head_size=64, block_size=16, lens=[300, limit])
    assert_close(run_kernel("naive", b), expected_output(b),
                 msg=f"the naive kernel at its limit, {limit} tokens")
    b = make_batch(num_heads=(2, 1), head_size=64, block_size=16, lens=[limit + 1])
    out = torch.zeros_like(b["query"])
    with pytest.raises(ValueError, match="too long for paged_attention_naive"):
        lab.paged_attention_naive(out, b["query"], b["key_cache"], b["value_cache"],
                                  b["num_kv_heads"], b["scale"], b["block_tables"],
                                  b["seq_lens"], b["block_size"], b["max_seq_len"],
                                  backend=KERNEL_BACKEND)
    assert not out.any(), (
        f"paged_attention_naive refused {limit + 1} tokens but wrote out first "
        f"({int(out.count_nonzero())} entries)")


@pytest.mark.oracle
@pytest.mark.parametrize("version, dtype, head_size, block_size, num_heads, use_alibi",
                         grid_params())
def test_kernel_matches_the_pytorch_oracle(version, dtype, head_size, block_size, num_heads,
                                           use_alibi):
    check_against_the_oracle(version, dtype, head_size, block_size, num_heads, use_alibi)


@pytest.mark.oracle
@pytest.mark.cuda
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_the_oracle_in_every_dtype(version, dtype):
    b = make_batch(num_heads=(64, 8), head_size=128, block_size=16, dtype=dtype, use_alibi=True)
    assert_close(run_kernel(version, b), expected_output(b), msg=f"{version} {dtype}")


@pytest.mark.oracle
@pytest.mark.cuda
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
@pytest.mark.parametrize("head_size, block_size", [(96, 8), (112, 8), (80, 8), (256, 8)])
def test_other_head_and_block_sizes(version, head_size, block_size):
    b = make_batch(num_heads=(8, 2), head_size=head_size, block_size=block_size, max_len=700)
    assert_close(run_kernel(version, b), expected_output(b), msg=f"{version} d{head_size}")


@pytest.mark.oracle
@WHERE
def test_v1_and_v2_agree_on_a_context_longer_than_eight_partitions():
    require(KERNEL_BACKEND)
    heads = (16, 4) if ON_GPU else (4, 1)
    b = make_batch(num_heads=heads, head_size=128, block_size=16, max_len=4500, num_seqs=3)
    expected = expected_output(b)
    assert_close(run_kernel("v1", b), expected, msg="v1, 9 partitions")
    assert_close(run_kernel("v2", b), expected, msg="v2, 9 partitions")


def _smem_optin() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(props.shared_memory_per_block_optin)


# In the emulation, the shared memory a block may opt in to is that of the modelled device.
SMEM_DEVICES = [None] if ON_GPU else ["default", "t4", "a100", "h100"]
EMU_SMEM_OPTIN = {"default": 48 * 1024, "t4": 64 * 1024, "a100": 163 * 1024, "h100": 227 * 1024}


@pytest.mark.oracle
@WHERE
@pytest.mark.parametrize("device", SMEM_DEVICES)
def test_v1_runs_up_to_the_shared_memory_limit_and_refuses_past_it(device, monkeypatch):
    """v1 keeps one fp32 logit per token in shared memory: just under the limit it still runs
    (and is right), just past it the launcher refuses and v2 does the job."""
    require(KERNEL_BACKEND)
    if device is not None:
        monkeypatch.setenv("MINI_VLLM_EMU_DEVICE", device)
    optin = _smem_optin() if ON_GPU else EMU_SMEM_OPTIN[device]
    block_size = 16
    # Just under: leave 1 KB for the kernel's static shared memory (the query row, scratch).
    fits = (optin - 1024) // 4 // block_size * block_size
    b = make_batch(num_heads=(2, 1), head_size=128, block_size=block_size, dtype=torch.float16,
                   lens=[7, fits], use_alibi=True)
    assert_close(run_kernel("v1", b), expected_output(b), msg=f"v1 at {fits} tokens")
    # Just past: one token more than the logits that fit.
    past = optin // 4 + 1
    b = make_batch(num_heads=(2, 1), head_size=128, block_size=block_size, dtype=torch.float16,
                   lens=[3, past])
    with pytest.raises(ValueError, match="too long for paged_attention_v1"):
        run_kernel("v1", b)
    assert_close(run_kernel("v2", b), expected_output(b), msg=f"v2 at {past} tokens")


@pytest.mark.oracle
@pytest.mark.emulation
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
def test_unwritten_shared_memory_never_reaches_the_output(version, monkeypatch):
    """The emulation's fresh shared memory holds NaN, so a sum over entries no thread wrote shows
    in every test above; a max over them does not (fmaxf(x, NaN) is x). Here it holds 3.4e38
    (MINI_VLLM_EMU_SHARED_FILL=huge), which a max keeps: a kernel that takes its max over more
    of the logits than the sequence's own tokens gets every probability 0 (on a GPU that memory
    holds whatever an earlier block left there)."""
    require("emulation")
    monkeypatch.setenv("MINI_VLLM_EMU_SHARED_FILL", "huge")
    # Short sequences beside a long one: most of their logits' shared memory is never written.
    b = make_batch(num_heads=(2, 1), head_size=64, block_size=16, device="cpu", lens=[5, 40, 600])
    assert_close(run_kernel(version, b, backend="emulation"), expected_output(b),
                 msg=f"{version} with unwritten shared memory holding 3.4e38 instead of NaN")


# ------------------------------------------------------------------------------------------
# Emulation with AddressSanitizer + UBSan: every access inside its buffer, aligned, no overflow
# ------------------------------------------------------------------------------------------

ASAN = "emulation-asan"
RACE = "emulation-race"


def tight_batch(**kw) -> dict:
    """A batch with no slack: block tables exactly as wide as the longest sequence (which comes
    last, and fills its last block, so reading one entry too many reads past the table), no
    spare cache blocks, and padding columns pointing at block 0 as upstream's tables do, so a
    stray read stays silent on a GPU but not under AddressSanitizer."""
    return make_batch(device="cpu", spare_blocks=0, table_fill=0,
                      lens=[1, 17, 512, 513, 704], **kw)


@pytest.mark.asan
@pytest.mark.emulation
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
def test_no_out_of_bounds_or_misaligned_access(version):
    require(ASAN)
    b = tight_batch(num_heads=(4, 2), head_size=128, block_size=16, use_alibi=True)
    assert_close(run_kernel(version, b, backend=ASAN), expected_output(b),
                 msg=f"{version} under AddressSanitizer")


def huge_pool_batch() -> dict:
    """A decode batch whose cache holds more than 2^31 elements, its sequences in the last
    blocks. The pool's memory is mapped, not allocated: only the blocks written cost."""
    from mini_vllm.csrc.emulation import shared_empty

    head_size, block_size, nkv = 128, 16, 1
    per_block = nkv * head_size * block_size  # elements
    num_blocks = 2**31 // per_block + 64  # the last 64 blocks lie past element 2^31
    x = 8
    key_cache = shared_empty(num_blocks, nkv, head_size // x, block_size, x, dtype=torch.float16)
    value_cache = shared_empty(num_blocks, nkv, head_size, block_size, dtype=torch.float16)
    gen = torch.Generator().manual_seed(3)
    lens = [40, 300]
    top = list(range(num_blocks - 64, num_blocks))
    table = torch.zeros(2, 19, dtype=torch.int32)
    table[0, :3] = torch.tensor(top[:3])
    table[1, :19] = torch.tensor(top[3:22])
    for blk in top[:22]:
        key_cache[blk] = torch.randn(nkv, head_size // x, block_size, x, generator=gen).half()
        value_cache[blk] = torch.randn(nkv, head_size, block_size, generator=gen).half()
    return dict(query=torch.randn(2, 4, head_size, generator=gen).half(), key_cache=key_cache,
                value_cache=value_cache, poisoned_k=key_cache, poisoned_v=value_cache,
                num_kv_heads=nkv, scale=head_size**-0.5, block_tables=table,
                seq_lens=torch.tensor(lens, dtype=torch.int32), block_size=block_size,
                max_seq_len=max(lens), alibi_slopes=None)


@beside_the_student
def _run_on_a_huge_pool(version: str) -> torch.Tensor:
    """`version`'s output on huge_pool_batch(), made where the lab's code runs: a pool that
    crossed would cross as its 4 GiB of bytes."""
    return run_kernel(version, huge_pool_batch(), backend=ASAN)


@pytest.mark.asan
@pytest.mark.emulation
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_block_pool_of_more_than_two_billion_elements(version):
    """Element offsets into the cache exceed 2^31: an int32 offset overflows (UBSan reports the
    signed overflow)."""
    require(ASAN)
    b = huge_pool_batch()
    num_elements = b["key_cache"].numel()
    assert_close(_run_on_a_huge_pool(version, beside=lab), expected_output(b),
                 msg=f"{version} with a block pool of {num_elements} elements")


@pytest.mark.starter_ok
@pytest.mark.asan
@pytest.mark.emulation
def test_reference_ops_under_address_sanitizer():
    from mini_vllm.csrc.ops import paged_attention_gqa

    require(ASAN)
    # Groups of 4 take the tensor-core kernel, groups of 2 the scalar one.
    for heads in ((8, 2), (4, 2)):
        b = tight_batch(num_heads=heads, head_size=128, block_size=16, use_alibi=True)
        assert_close(run_kernel("v2", b, fn=paged_attention_gqa, backend=ASAN),
                     expected_output(b), msg=f"GQA-aware kernel {heads} under AddressSanitizer")
    check_reshape_and_cache(torch.float16, 16, ASAN)
    check_copy_and_swap_blocks(ASAN)


# ------------------------------------------------------------------------------------------
# Emulation with ThreadSanitizer: ordering only at barriers and warp collectives
# ------------------------------------------------------------------------------------------


def small_batch(**kw) -> dict:
    return make_batch(device="cpu", lens=[17, 600], **kw)


@pytest.mark.race
@pytest.mark.emulation
@pytest.mark.parametrize("version", ["naive", "v1", "v2"])
def test_no_data_race_between_threads(version):
    require(RACE)
    b = small_batch(num_heads=(2, 1), head_size=64, block_size=16, use_alibi=True)
    assert_close(run_kernel(version, b, backend=RACE), expected_output(b),
                 msg=f"{version} under ThreadSanitizer")


@pytest.mark.starter_ok
@pytest.mark.race
@pytest.mark.emulation
def test_reference_ops_have_no_data_race():
    from mini_vllm.csrc.ops import paged_attention_gqa

    require(RACE)
    for heads in ((8, 2), (4, 2)):  # the tensor-core kernel, the scalar one
        b = small_batch(num_heads=heads, head_size=64, block_size=16)
        assert_close(run_kernel("v2", b, fn=paged_attention_gqa, backend=RACE),
                     expected_output(b), msg=f"GQA-aware kernel {heads} under ThreadSanitizer")
    check_reshape_and_cache(torch.bfloat16, 8, RACE)
    check_copy_and_swap_blocks(RACE)


# ------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------


@pytest.mark.starter_ok
@pytest.mark.cuda
def test_cuda_ops_are_available_on_a_gpu():
    import mini_vllm.csrc as csrc

    assert csrc.cuda_ops_available(), "the reference extension should build on this GPU"
