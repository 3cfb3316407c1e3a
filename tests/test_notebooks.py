"""Every phase notebook executes top to bottom, draws its figures, and writes nothing to disk.

With ``COURSE_EXECUTED_NOTEBOOKS=DIR`` set (a folder outside the repository), each executed
notebook is also saved there as ``<phase folder>.ipynb``, so that CI's site build
(``python -m course.site build --executed DIR``) publishes these runs instead of running the
notebooks a second time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT

NOTEBOOKS = sorted(REPO_ROOT.glob("phase-*/notebook.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.parent.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name}: commit notebooks with outputs cleared"
    # The kernel's own inline backend renders figures as PNG outputs, as in Jupyter; a backend
    # forced from outside (MPLBACKEND=Agg) would silently swallow them.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    before = {p for p in path.parent.rglob("*") if ".ipynb_checkpoints" not in p.parts}
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    after = {p for p in path.parent.rglob("*") if ".ipynb_checkpoints" not in p.parts}
    created = sorted(str(p.relative_to(REPO_ROOT)) for p in after - before)
    assert not created, f"{path.name} wrote files into the repository: {created}"
    figures = sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert figures >= 3, f"{path.name} drew {figures} figures; each phase notebook draws its own"
    keep = os.environ.get("COURSE_EXECUTED_NOTEBOOKS")
    if keep:
        nbformat.write(nb, Path(keep) / f"{path.parent.name}.ipynb")
