"""Fixtures shared by the tests of the course tooling."""
from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def course_skeleton(tmp_path: Path) -> Callable[..., Path]:
    """Makes ``tmp_path/course-repo``: a course with the real tooling (``course/`` and the root
    conftest.py) and no lab yet, as a student's checkout lays it out.

    ``pytest_cache=True`` keeps pytest's cache in ``$COURSE_PYTEST_CACHE`` (as the course's own
    pyproject does); otherwise the cache plugin is off, so runs leave nothing behind.
    """

    def make(*, pytest_cache: bool = False) -> Path:
        root = tmp_path / "course-repo"
        shutil.copytree(REPO_ROOT / "course", root / "course",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO_ROOT / "conftest.py", root)
        options = ('addopts = "--import-mode=importlib"\ncache_dir = "$COURSE_PYTEST_CACHE"\n'
                   if pytest_cache else
                   'addopts = "--import-mode=importlib -p no:cacheprovider"\n')
        (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n" + options)
        return root

    return make


@pytest.fixture
def upstream_release():
    """``(run, src)``: ``upstream_refs/upstream_tests/run.py`` loaded, and the source of the
    release it bridges to (vLLM's own tests are read from it). Skips when the source is not
    here; CI fetches it first (``python -m course refs --fetch``)."""
    spec = importlib.util.spec_from_file_location(
        "upstream_tests_run", REPO_ROOT / "upstream_refs" / "upstream_tests" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    src = run.find_source()
    if src is None:
        pytest.skip(f"the vLLM {run.release()} source is not here: fetch it with `python -m "
                    "course refs --fetch` (CI does) to run vLLM's own tests against mini_vllm")
    return run, src
