"""Lab 02-06's Colab notebook runs top to bottom on a machine without a GPU: it finds the course it
sits in, compiles the student's starter.cu for a T4 (sm_75) when nvcc is installed, runs the lab's
tests on the starter in the CPU emulation, and every GPU cell says that it skips. It writes
nothing into the repository. (On Colab, with a T4, the same cells build, test and benchmark on the
GPU; that path needs a GPU and is not run here.)"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from course.labs.catalog import REPO_ROOT

NOTEBOOK = REPO_ROOT / "phase-02-paged-attention/labs/lab-06-cuda-kernel/colab.ipynb"


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_the_colab_notebook_is_linked_and_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    readme = (NOTEBOOK.parent / "README.md").read_text(encoding="utf-8")
    link = (r"\(https://colab\.research\.google\.com/github/[^/)]+/[^/)]+/blob/[^/)]+/"
            r"phase-02-paged-attention/labs/lab-06-cuda-kernel/colab\.ipynb\)")
    assert re.search(link, readme), "the README's Open in Colab link"


@pytest.mark.slow
@pytest.mark.emulation
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the notebook's path without a GPU")
def test_the_colab_notebook_runs_without_a_gpu(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.delenv("LAB_IMPL", raising=False)
    monkeypatch.delenv("MINI_VLLM_KERNEL_BACKEND", raising=False)
    before = {p for p in REPO_ROOT.rglob("*") if ".git" not in p.parts}
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    after = {p for p in REPO_ROOT.rglob("*") if ".git" not in p.parts}
    created = sorted(str(p.relative_to(REPO_ROOT)) for p in after - before
                     if "__pycache__" not in p.parts)
    assert not created, f"the notebook wrote into the repository: {created}"

    out = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "No GPU in this runtime" in out
    if shutil.which("nvcc"):
        assert "starter.cu compiles for sm_75" in out, out[-3000:]
    # The tests ran on the untouched starter in the emulation: they name the first task.
    assert "LAB_IMPL=starter" in out and "lab 02-06, task 1" in out, out[-3000:]
    assert "Skipped: the benchmark times kernels on a GPU" in out
    assert "No benchmark results to show (no GPU)" in out
