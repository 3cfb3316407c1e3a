"""The pinned vLLM releases' source, fetched from the package index and kept in a cache, so that
`course refs --fetch` (and CI) checks the references against the real releases.

A release's source is its sdist: ``vllm/``, ``csrc/``, ``tests/``, ``benchmarks/``. pip fetches
and unpacks it, then fails to build its metadata (that needs CUDA and much else); with
``--no-clean`` the unpacked tree stays in pip's temporary folder, and that tree is all the course
reads. It goes to ``$VLLM_SRC_CACHE/vVERSION`` (default ``~/.cache/vllm-src``), where
``../shared/tools/get-vllm-src.sh`` puts it too. Nothing fetched is ever copied into the course.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tomllib

PIP_TIMEOUT_S = 900


class FetchError(Exception):
    """A release's source could not be fetched (the message says why, pip's last lines)."""


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_SRC_CACHE", Path.home() / ".cache" / "vllm-src"))


def release_tree(version: str) -> Path | None:
    """The unpacked source of ``version`` in the cache, or None."""
    tree = cache_root() / f"v{version}"
    return tree if (tree / "vllm" / "__init__.py").is_file() else None


def pinned_versions(repo: Path) -> list[str]:
    """Every release upstream_refs/pins.toml names (the pins first, today's last)."""
    pins = tomllib.loads((repo / "upstream_refs" / "pins.toml").read_text(encoding="utf-8"))
    return [pins[key]["version"] for key in ("primary", "secondary", "today") if key in pins]


def fetch(version: str) -> Path:
    """The unpacked source of ``version``, fetched into the cache unless it is there."""
    tree = release_tree(version)
    if tree is not None:
        return tree
    with tempfile.TemporaryDirectory(prefix="vllm-src-") as tmp:
        work = Path(tmp)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--no-build-isolation", "--no-clean", "-d", str(work / "dl"),
                 f"vllm=={version}"],
                env=dict(os.environ, TMPDIR=str(work)), capture_output=True, text=True,
                timeout=PIP_TIMEOUT_S)
            said = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            said = f"pip ran past {PIP_TIMEOUT_S} s"
        unpacked = _unpacked(work, version)
        if unpacked is None:
            tail = "\n".join(said.strip().splitlines()[-6:])
            raise FetchError(f"could not fetch the vLLM {version} source from the package "
                             f"index; pip said:\n{tail}")
        dest = cache_root() / f"v{version}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(unpacked), dest)
    return dest


def _unpacked(work: Path, version: str) -> Path | None:
    """The root of the release's tree under ``work``: pip's unpacked copy, else the sdist's
    archive unpacked here."""
    for init in sorted(work.glob("*/*/vllm/__init__.py")):
        return init.parent.parent
    for archive in work.rglob(f"vllm-{version}.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(work / "x", filter="data")
        for init in sorted((work / "x").glob("*/vllm/__init__.py")):
            return init.parent.parent
    return None
