"""course.labs.warm: a forked child runs pytest as a fresh `python -m pytest` would, in its own
folder, environment and import path, and a run past its timeout is killed with its children."""

from __future__ import annotations

import os
import time

import pytest

from course.labs import warm

PROBE = """
import os, sys
import probe_mod

def test_sees_its_own_world():
    assert os.getcwd() == {cwd!r}
    assert os.environ["PROBE_VALUE"] == "42" and "LEAK" not in os.environ
    assert probe_mod.ORIGIN == "copy"
    print("probe ran")

def test_fails():
    assert os.environ["PROBE_VALUE"] == "not this"
"""


@pytest.fixture(scope="module")
def server():
    with warm.session() as s:
        yield s


def test_a_child_runs_in_its_folder_with_its_env_and_path(server, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "probe_mod.py").write_text("ORIGIN = 'copy'\n")
    (tmp_path / "test_probe.py").write_text(PROBE.format(cwd=str(tmp_path)))
    env = {"PATH": os.environ.get("PATH", ""), "PROBE_VALUE": "42", "PYTHONPATH": str(lib)}
    os.environ["LEAK"] = "1"  # the client's environment must not reach the child
    try:
        out = tmp_path / "out.txt"
        code = server.run(["test_probe.py", "-q", "-s", "-p", "no:cacheprovider", "-k",
                           "own_world"], tmp_path, env, out, timeout=120)
        assert code == 0, out.read_text()
        assert "probe ran" in out.read_text() and "1 passed" in out.read_text()
        code = server.run(["test_probe.py", "-q", "-p", "no:cacheprovider", "-k", "fails"],
                          tmp_path, env, out, timeout=120)
        assert code == 1 and "1 failed" in out.read_text()
    finally:
        del os.environ["LEAK"]


def test_a_run_past_its_timeout_is_killed_with_its_children(server, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, time\n"
        "def test_hang():\n"
        f"    p = subprocess.Popen(['sleep', '300'])\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "    time.sleep(300)\n")
    code = server.run(["test_hang.py", "-q", "-p", "no:cacheprovider"], tmp_path,
                      {"PATH": os.environ.get("PATH", "")}, tmp_path / "out.txt", timeout=5)
    assert code is None
    grandchild = int(pidfile.read_text())
    for _ in range(50):  # killed with the group; reaped by init shortly after
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                break
        time.sleep(0.1)
    else:
        pytest.fail("the hung run's child outlived the timeout")
