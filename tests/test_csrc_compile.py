"""mini_vllm's CUDA kernels compile for the GPUs the course names: T4 (sm_75), A100 (sm_80) and
H100 (sm_90). Compile-only (no GPU needed), with nvcc when it is installed.

The main instantiations (every dtype at head size 128, block size 16: MINI_VLLM_COMPILE_CHECK)
go through nvcc and ptxas to a cubin, so a change that breaks one architecture's build (an
intrinsic it lacks, too much static shared memory) fails here. bf16 is built on sm_75 too: the
kernels only convert bf16 to and from fp32, which CUDA's cuda_bf16.h provides on every
architecture (in software before sm_80), so there is no bf16 arithmetic to refuse. The one
exception is the GQA-aware kernel's tensor-core path: bf16 matrix fragments need sm_80, so on
sm_75 its bf16 instantiation compiles to an empty body and the launcher runs the scalar kernel
(``use_tensor_cores`` in paged_attention_gqa.cu); the SASS check below holds the build to that.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

from mini_vllm.csrc import CSRC_DIR, KERNEL_SOURCES

ARCHS = {"sm_75": "T4", "sm_80": "A100", "sm_90": "H100"}


def _nvdisasm() -> str | None:
    """nvdisasm from the CUDA toolkit, or from the nvidia-cuda-nvdisasm wheel (requirements.txt)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    paths = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin/nvdisasm"))
    return str(paths[0]) if paths else None


def _compile(source: str, arch: str) -> tuple[str, int, str, str]:
    """(source, nvcc's exit code, its output, the cubin's SASS when nvdisasm is at hand)."""
    with tempfile.TemporaryDirectory(prefix="csrc-compile-") as tmp:
        cubin = Path(tmp) / "out.cubin"
        cmd = ["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-DMINI_VLLM_COMPILE_CHECK",
               f"-I{CSRC_DIR}", str(CSRC_DIR / source), "-o", str(cubin)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        sass = ""
        if proc.returncode == 0 and _nvdisasm():
            sass = subprocess.run([_nvdisasm(), "-c", str(cubin)], capture_output=True,
                                  text=True, timeout=300, check=True).stdout
    return source, proc.returncode, proc.stdout + proc.stderr, sass


@cache
def _compile_all(arch: str) -> dict[str, tuple[int, str, str]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _compile(s, arch), KERNEL_SOURCES))
    return {source: (code, output, sass) for source, code, output, sass in results}


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kernels_compile_for(arch):
    for source, (code, output, _) in _compile_all(arch).items():
        assert code == 0, (
            f"{source} does not compile for {arch} ({ARCHS[arch]}):\n{output[-4000:]}"
        )


def _tensor_core_instructions(sass: str) -> dict[str, int]:
    """HMMA instructions per tensor-core kernel of a cubin's SASS, by element type."""
    counts: dict[str, int] = {}
    kernel = None
    for line in sass.splitlines():
        header = re.search(r"\.text\.(\S+)", line)
        if header:
            name = header.group(1)
            kernel = None
            if "paged_attention_gqa_tc_kernel" in name:
                kernel = "bf16" if "nv_bfloat16" in name else "fp16"
                counts.setdefault(kernel, 0)
        elif kernel and re.search(r"\bHMMA\b", line):
            counts[kernel] += 1
    return counts


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gqa_tensor_core_path_is_built_for(arch):
    """The GQA-aware kernel's tensor-core instantiations are in the build: fp16 on every
    architecture, bf16 from sm_80 on; bf16 on sm_75 (a T4) is refused by an empty body, and the
    launcher runs the scalar kernel there."""
    code, output, sass = _compile_all(arch)["paged_attention_gqa.cu"]
    assert code == 0, output[-4000:]
    if not sass:
        pytest.skip("nvdisasm not found: pip install -r requirements.txt (nvidia-cuda-nvdisasm)")
    counts = _tensor_core_instructions(sass)
    assert set(counts) == {"fp16", "bf16"}, f"tensor-core kernels in the {arch} cubin: {counts}"
    assert counts["fp16"] > 0, f"no HMMA in the fp16 tensor-core kernel for {arch}"
    if arch == "sm_75":
        assert counts["bf16"] == 0, "bf16 tensor-core code on sm_75, which has no bf16 mma"
    else:
        assert counts["bf16"] > 0, f"no HMMA in the bf16 tensor-core kernel for {arch}"
