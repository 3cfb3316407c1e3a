"""mini_vllm's CUDA kernels compile for the GPUs the course names: T4 (sm_75), A100 (sm_80) and
H100 (sm_90). Compile-only (no GPU needed), with nvcc when it is installed.

The main instantiations (every dtype at head size 128, block size 16: MINI_VLLM_COMPILE_CHECK)
go through nvcc and ptxas to a cubin, so a change that breaks one architecture's build (an
intrinsic it lacks, too much static shared memory) fails here. bf16 is built on sm_75 too: the
kernels only convert bf16 to and from fp32, which CUDA's cuda_bf16.h provides on every
architecture (in software before sm_80), so there is no bf16 arithmetic to refuse.
"""

from __future__ import annotations

import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mini_vllm.csrc import CSRC_DIR, KERNEL_SOURCES

ARCHS = {"sm_75": "T4", "sm_80": "A100", "sm_90": "H100"}


def _compile(source: str, arch: str) -> tuple[str, int, str]:
    with tempfile.TemporaryDirectory(prefix="csrc-compile-") as tmp:
        cmd = ["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-DMINI_VLLM_COMPILE_CHECK",
               f"-I{CSRC_DIR}", str(CSRC_DIR / source), "-o", str(Path(tmp) / "out.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return source, proc.returncode, proc.stdout + proc.stderr


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kernels_compile_for(arch):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _compile(s, arch), KERNEL_SOURCES))
    for source, code, output in results:
        assert code == 0, (
            f"{source} does not compile for {arch} ({ARCHS[arch]}):\n{output[-4000:]}"
        )
