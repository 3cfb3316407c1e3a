"""Run one lab's tests in a subprocess and read back every test's outcome."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from course.labs import warm
from course.labs.catalog import REPO_ROOT, Lab
from course.labs.console import Progress, workers

# pytest exit codes that mean "the tests ran" (0: all passed, 1: some failed). Anything else
# (interrupted, internal error, usage error, no tests collected) means the run itself broke.
RAN_OK = (0, 1)


@dataclass
class LabRun:
    lab: Lab
    impl: str
    exit_code: int
    tests: list[dict] = field(default_factory=list)
    output: str = ""
    seconds: float = 0.0
    # "ran" (now), "cached" (recorded earlier under the same key, course.labs.results) or
    # "untouched" (the published starter: nothing ran, and `tests` is empty).
    origin: str = "ran"
    first_task: str = ""  # for an untouched lab: its first task, read from the starter

    @property
    def broken(self) -> bool:
        """The run did not produce results (a problem of the run, not of the code under test)."""
        return self.exit_code not in RAN_OK or (not self.tests and self.exit_code != 0)

    def by_outcome(self, *outcomes: str, graded: bool = True) -> list[dict]:
        return [
            t
            for t in self.tests
            if t["outcome"] in outcomes and (not graded or not t["starter_ok"])
        ]

    @property
    def graded(self) -> list[dict]:
        return [t for t in self.tests if not t["starter_ok"] and t["outcome"] != "skipped"]

    @property
    def passed(self) -> int:
        return len(self.by_outcome("passed"))

    @property
    def total(self) -> int:
        return len(self.graded)

    @property
    def points(self) -> tuple[float, float]:
        graded = self.graded
        got = sum(t["points"] for t in graded if t["outcome"] == "passed")
        return got, sum(t["points"] for t in graded)

    @property
    def status(self) -> str:
        if self.origin == "untouched":
            return "not started"
        if self.broken:
            return "error"
        if self.total == 0:
            return "skipped"
        if self.passed == self.total:
            return "done"
        return "in progress" if self.passed else "not started"

    @property
    def next_step(self) -> str:
        """The lowest-numbered task still unwritten, else the first failing graded test."""
        if self.origin == "untouched":
            return self.first_task
        todo = [
            t["message"].replace("NOT IMPLEMENTED  ", "").split("  (")[0]
            for t in self.tests
            if t["outcome"] == "not_implemented"
        ]
        if todo:
            return min(
                todo,
                key=lambda m: (
                    int(m.split("task ")[1].split(":")[0])
                    if re.search(r"task \d+:", m)
                    else 1 << 30
                ),
            )
        for t in self.tests:
            if t["outcome"] == "failed" and not t["starter_ok"]:
                return f"fix {t['nodeid'].split('::', 1)[-1]}"
        return ""


def run_lab(
    lab: Lab,
    impl: str,
    *,
    root: Path = REPO_ROOT,
    junit: Path | None = None,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    timeout: float = 1800,
    test_timeout: float = 300,
    only: tuple[str, ...] = (),
) -> LabRun:
    """Run `lab`'s test file against `impl` with `root` as the working directory (only the
    tests `only` names, ids within test_lab.py such as ``test_x[case]``, when given)."""
    with tempfile.TemporaryDirectory(prefix="course-") as tmp:
        results = Path(tmp) / "results.json"
        test_file = root / lab.path.relative_to(lab.path.parents[2]).as_posix() / "test_lab.py"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *([f"{test_file}::{t}" for t in only] if only else [str(test_file)]),
            "-q",
            "-rN",
            "--no-header",
            f"--course-results={results}",
            # pytest-timeout: a hung test (a planted bug, a student's loop) fails alone instead
            # of holding the whole run until `timeout`.
            f"--timeout={test_timeout:g}",
            *extra_args,
        ]
        if junit is not None:
            cmd.append(f"--junitxml={junit}")
        # Labs run two at a time; one thread each keeps torch from oversubscribing the cores.
        env = dict(os.environ, LAB_IMPL=impl, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra_env or {})
        start = time.perf_counter()
        server = warm.active()
        if server is not None:  # `course check`: a fork of a process that imported torch once
            log = Path(tmp) / "output.txt"
            code = server.run(cmd[3:], root, env, log, timeout)
            output = log.read_text(errors="replace") if log.is_file() else ""
            if code is None:
                code, output = -1, f"timed out after {timeout:.0f} s\n{output}"
        else:
            try:
                proc = subprocess.run(
                    cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
                )
                code, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                code, output = -1, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
        seconds = time.perf_counter() - start
        data = json.loads(results.read_text()) if results.is_file() else {}
    return LabRun(lab, impl, code, data.get("tests", []), output, seconds)


def run_labs(
    labs: list[Lab],
    impl: str,
    jobs: int,
    junit_dir: Path | None = None,
    root: Path = REPO_ROOT,
    env_for: dict[str, dict[str, str]] | None = None,
) -> list[LabRun]:
    progress = Progress(len(labs), f"running ({impl})")
    runs: dict[str, LabRun] = {}
    with ThreadPoolExecutor(workers(jobs)) as pool:
        futures = {}
        for lab in labs:
            junit = junit_dir / f"lab-{lab.id}.xml" if junit_dir else None
            env = (env_for or {}).get(lab.id)
            futures[pool.submit(run_lab, lab, impl, junit=junit, root=root, extra_env=env)] = lab
            progress.started(lab.id)
        for fut in as_completed(futures):
            run = fut.result()
            runs[run.lab.id] = run
            progress.finished(
                f"lab {run.lab.id} {run.lab.title}: {run.passed}/{run.total} passed "
                f"({run.seconds:.0f} s)"
            )
    progress.close()
    return [runs[lab.id] for lab in labs]
