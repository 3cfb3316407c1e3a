"""The excluded upstream test items and why (``upstream_refs/left_out/upstream_tests.toml``).

upstream: none (course-only: the bridge to the newest release's tests)
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXCLUSIONS = Path(__file__).resolve().parents[1] / "left_out" / "upstream_tests.toml"


def load_document() -> dict:
    return tomllib.loads(EXCLUSIONS.read_text(encoding="utf-8"))


def load_exclusions() -> dict[str, str]:
    """``{item: reason}``. An item is ``file.py`` (every test in it), ``file.py::test`` (every
    parameter of it) or ``file.py::test[param]``; files are relative to ``tests/v1/``."""
    out: dict[str, str] = {}
    for group in load_document().get("excluded", []):
        for item in group["items"]:
            if item in out:
                raise ValueError(f"{EXCLUSIONS.name}: {item} is listed twice")
            out[item] = group["reason"]
    return out
