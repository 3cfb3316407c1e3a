"""Every phase notebook executes top to bottom (figures inline, nothing written to disk)."""

from __future__ import annotations

import os

import pytest

from course.labs import REPO_ROOT

NOTEBOOKS = sorted(REPO_ROOT.glob("phase-*/notebook.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.parent.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name}: commit notebooks with outputs cleared"
    before = {p for p in path.parent.rglob("*") if ".ipynb_checkpoints" not in p.parts}
    env_backend = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"
    try:
        client = nbclient.NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    finally:
        if env_backend is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = env_backend
    after = {p for p in path.parent.rglob("*") if ".ipynb_checkpoints" not in p.parts}
    created = sorted(str(p.relative_to(REPO_ROOT)) for p in after - before)
    assert not created, f"{path.name} wrote files into the repository: {created}"
