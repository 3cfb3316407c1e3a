"""The end every benchmark shares: its results, with the command and environment that made them.

A committed result must say how to make it again, so each JSON file starts with the exact
command line (``python benchmarks/<script> <arguments>``) and the machine's environment
(device, versions, git revision, as the benchmark measures it), then the benchmark's own fields.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line that reruns ``benchmarks/<script>`` with ``argv`` (default: this
    process's arguments), quoted for a shell."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"benchmarks/{script}", *args])


def write_result(path: Path | None, script: str, environment: dict[str, Any],
                 fields: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """``{"command", "environment", **fields}``; written as indented JSON to ``path`` (its
    folder made) when ``path`` is given, and returned either way."""
    result = {"command": command(script, argv), "environment": environment, **fields}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result
