"""The student loop, measured (issue 33): how long a student, and CI, wait for the course's answers.

Every figure is the wall time of one command, run as a subprocess, exactly as a student types it
at the root of a fresh copy of the course: a ``git clone`` of this checkout's ``HEAD`` in a
temporary folder (uncommitted changes are not measured), with a ``.venv`` link to the Python
environment that runs this script, so that the commands are the README's own
(``.venv/bin/python -m course``, ``LAB_IMPL=starter .venv/bin/python -m pytest <lab> -q``).
Every cache the course keeps lives in the temporary folder too (``XDG_CACHE_HOME``: lab results
and the engine exam; ``MINI_VLLM_BUILD_DIR``: the CUDA lab's emulated kernels;
``MINI_VLLM_CACHE``: the engine's CPU kernels; ``TMPDIR``: pytest's and Hypothesis's caches), so
"cold" means an empty folder and nothing is left on the machine: the folder is removed at the end,
on Ctrl-C and on an error too.

What is measured (warm figures: one untimed run first, then ``--repeats`` timed runs, reported as
min / median / max; a target is judged on the median, a cold figure on its single run):

1. the dashboard (``python -m course``, the README's first command) on an untouched course,
   cold (empty caches) and warm;
2. the dashboard on a finished course, cold (it runs every lab's tests and the engine exam) and
   warm (nothing changed: every result cached). "Finished" is every lab's starter replaced the
   way the course's own checks finish one: a Python lab's ``starter.py`` by its ``solution.py``;
   an engine lab's by the stand-in student of ``course check`` (``course.integrity.shadow``: the
   reference's code in a private copy, so that ``course engine`` runs it as a student's pieces,
   not as the reference objects); the CUDA lab's ``starter.cu`` with every task's body from
   ``mini_vllm/csrc`` and marked done (``scripts/task_by_task.py``'s ``fill_cuda``);
3. the per-lab command of the README for every lab, on the untouched and on the finished course;
4. the CUDA lab's edit-to-result loop: task 0 written, an empty build cache (the cold build), then
   an edit of ``starter.cu`` (a comment in task 0's section: its content hash changes) followed by
   the README's one-task command (``-k task0``); the whole lab after an edit, every task written;
5. ``python -m course engine`` on the finished course, warm;
6. CI's phases, read from a saved ``bash .ci/run`` log (``--ci-log``; CI itself is not run here).

The issue's targets are printed beside the figures and recorded as met or not; speed is reported,
never asserted (the exit status is 1 only when a command broke, e.g. a finished lab's tests failed,
since its time would then not be what the row says).

    nice -n 10 .venv/bin/python benchmarks/student_loop.py    # roughly 40 min on 2 cores
    .venv/bin/python benchmarks/student_loop.py --quick --out /tmp/student_loop_quick.json
    .venv/bin/python benchmarks/student_loop.py --ci-log ci.log       # the CI phases too
    .venv/bin/python benchmarks/student_loop.py --ci-log ci.log --no-run   # add them to --out
    .venv/bin/python benchmarks/student_loop.py --markdown benchmarks/results/student_loop.json

``--quick`` (to check the script itself): two Python labs (01-01, and 02-01, an engine lab, so the
exam and ``course engine`` compose a piece) are finished, one timed repeat, and of the CUDA lab
only its untouched starter and the task 0 loop. ``--markdown`` prints the README's "How long
things take" tables from a results file and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "student_loop.json"

CUDA_LAB = "02-06"
QUICK_LABS = ("01-01", "02-01")
# The README's one-task command for the CUDA lab (its "Run it" section).
CUDA_ONE_TASK = ("-k", "task0")
# Variables of the caller's shell that would change what a student's command does; a student
# has none of them set, so the commands run without them.
STRIPPED_ENV = ("LAB_IMPL", "HYPOTHESIS_PROFILE", "OMP_NUM_THREADS", "PYTHONPATH",
                "PYTHONDONTWRITEBYTECODE", "CUDA_VISIBLE_DEVICES", "COURSE_PYTEST_CACHE",
                "COURSE_EXECUTED_NOTEBOOKS", "PYTEST_ADDOPTS")
STRIPPED_PREFIXES = ("MINI_VLLM_",)

# The targets, in seconds, by measurement kind.
TARGETS = {
    "dashboard-untouched-cold": 20.0,
    "dashboard-finished-warm": 10.0,
    "lab-python": 15.0,
    "cuda-one-task-after-edit": 20.0,
    "cuda-whole-lab": 60.0,
    "engine-finished-warm": 15.0,
}
TARGET_TEXT = {
    "dashboard-untouched-cold": "untouched dashboard, cold: <= 20 s",
    "dashboard-finished-warm": "finished dashboard, warm: <= 10 s",
    "lab-python": "every Python lab's per-lab command, warm: <= 15 s",
    "cuda-one-task-after-edit": "CUDA lab, one task after an edit: <= 20 s",
    "cuda-whole-lab": "whole CUDA lab, warm: <= 60 s",
    "engine-finished-warm": "`course engine` on a finished course, warm: <= 15 s",
}


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One command's timings. ``cold``: a single run with empty caches; otherwise the runs that
    followed one untimed warm-up run."""

    key: str  # unique, e.g. "lab/02-01/finished"
    what: str
    course: str  # "untouched", "finished", or the CUDA lab's state
    caches: str  # "cold" or "warm"
    command: str  # as typed at the root of the course copy
    runs_s: list[float] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    expected_exit: int = 0
    summary: str = ""  # the command's closing line (pytest's counts, the dashboard's tally)
    edit: str = ""  # what was changed before each timed run, if anything
    target: str = ""  # a key of TARGETS, or ""
    load_before: float = 0.0  # 1-minute load average when the measurement began
    warmup_s: float | None = None
    output_tail: str = ""  # only when a run exited unexpectedly

    @property
    def min_s(self) -> float:
        return min(self.runs_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def max_s(self) -> float:
        return max(self.runs_s)

    @property
    def broke(self) -> bool:
        return any(code != self.expected_exit for code in self.exit_codes)

    @property
    def target_s(self) -> float | None:
        return TARGETS.get(self.target)

    @property
    def met(self) -> bool | None:
        if self.target_s is None or not self.runs_s:
            return None
        return self.median_s <= self.target_s

    def as_json(self) -> dict:
        data = asdict(self)
        data["runs_s"] = [round(s, 2) for s in self.runs_s]
        if self.warmup_s is not None:
            data["warmup_s"] = round(self.warmup_s, 2)
        if self.runs_s:
            data.update(min_s=round(self.min_s, 2), median_s=round(self.median_s, 2),
                        max_s=round(self.max_s, 2))
        data.update(target_s=self.target_s, met=self.met, broke=self.broke)
        if not self.output_tail:
            del data["output_tail"]
        return data


# ------------------------------------------------------------------------------------------------
# The CI log
# ------------------------------------------------------------------------------------------------

_CI_PHASE = re.compile(r"^ci phase: (?P<name>.+?) took (?P<s>\d+(?:\.\d+)?) s\s*$")
_CI_TOTAL = re.compile(r"^ci: (?P<s>\d+(?:\.\d+)?) s in all\s*$")
_CI_SITE = re.compile(r"^site: install (?P<install>\d+) s, build (?P<build>\d+) s, "
                      r"browser check (?P<check>\d+) s")


def parse_ci_log(text: str) -> dict:
    """The phases of a ``bash .ci/run`` log: ``ci phase: NAME took N s`` lines in order, the
    ``ci: N s in all`` total, and the site phase's parts when its line is there. A log that
    stops early (a phase failed) gives the phases it has and ``total_s`` None."""
    phases, total, site = [], None, None
    for line in text.splitlines():
        line = line.strip()
        if m := _CI_PHASE.match(line):
            phases.append({"name": m["name"], "seconds": float(m["s"])})
        elif m := _CI_TOTAL.match(line):
            total = float(m["s"])
        elif m := _CI_SITE.match(line):
            site = {k: float(v) for k, v in m.groupdict().items()}
    return {"phases": phases, "total_s": total, "site_s": site,
            "sum_of_phases_s": sum(p["seconds"] for p in phases)}


# ------------------------------------------------------------------------------------------------
# Finishing a course copy (runs in a child process, inside the copy, with the copy's `course`)
# ------------------------------------------------------------------------------------------------


def finish_labs(root: Path, lab_ids: list[str], cuda_tasks: int | None) -> dict[str, str]:
    """Finish ``lab_ids`` in the course copy at ``root`` (this process imports that copy's
    ``course``); ``cuda_tasks``: how many of the CUDA lab's open tasks to write (None: all).
    Returns {lab id: how it was finished}."""
    import course
    from course.engine.compose import engine_labs
    from course.integrity.shadow import shadow_package, shadow_tree
    from course.labs.catalog import discover, select
    from course.labs.loader import load_script
    from course.labs.tasks import open_tasks

    if not Path(course.__file__).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"imported {course.__file__}, not the copy's course under {root}")
    labs = select(discover(), lab_ids)
    engine = {lab.id for lab in engine_labs()} - {CUDA_LAB}
    done: dict[str, str] = {}
    tree = None
    for lab in labs:
        if (lab.path / "starter.cu").is_file():
            fill_cuda = load_script("task_by_task", root / "scripts" / "task_by_task.py").fill_cuda
            cu = lab.path / "starter.cu"
            tasks = open_tasks(lab)
            tasks = tasks if cuda_tasks is None else tasks[:cuda_tasks]
            cu.write_text(fill_cuda(cu.read_text(encoding="utf-8"), tasks), encoding="utf-8")
            done[lab.id] = "starter.cu: tasks " + ", ".join(str(t.number) for t in tasks) + \
                " written from mini_vllm/csrc and marked done"
        elif lab.id in engine:
            if tree is None:  # the stand-in student of `course check`, once for every lab
                tree = shadow_tree(Path(tempfile.mkdtemp(prefix="stand-in-")) / "tree", root=root)
            shutil.copyfile(tree / lab.rel / "starter.py", lab.path / "starter.py")
            package = shadow_package(lab)
            shutil.copytree(tree / package, root / package)
            done[lab.id] = f"starter.py: the stand-in student's ({package}, a private copy)"
        else:
            shutil.copyfile(lab.path / "solution.py", lab.path / "starter.py")
            done[lab.id] = "starter.py: solution.py copied over it"
    if tree is not None:
        shutil.rmtree(tree.parent, ignore_errors=True)
    return done


# ------------------------------------------------------------------------------------------------
# Running commands
# ------------------------------------------------------------------------------------------------


_SUMMARY = re.compile(r"\b\d+ (passed|failed|not implemented|errors?|skipped)\b.* in [\d.]+s|"
                      r"\d+ of \d+ labs done|Identical to the reference engine|"
                      r"DIFFERENT from the reference|could not run")


def _summary(output: str) -> str:
    lines = [ln.strip(" =") for ln in output.splitlines() if _SUMMARY.search(ln)]
    return lines[-1][:160] if lines else ""


class Bench:
    """The temporary folder, its course copies and caches, and the command runner."""

    def __init__(self, work: Path, venv: Path, timeout: float, repeats: int) -> None:
        self.work = work
        self.venv = venv
        self.timeout = timeout
        self.repeats = repeats
        self.tmp = work / "tmp"
        self.tmp.mkdir()
        self.measurements: list[Measurement] = []
        self.finishes = 0
        self.revision = _git(REPO_ROOT, "rev-parse", "HEAD")

    # -- course copies and caches ---------------------------------------------------------------

    def clone(self, name: str) -> Path:
        """A fresh copy of the course, as a student gets it, with the `.venv` link."""
        dest = self.work / name
        subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(REPO_ROOT), str(dest)],
                       check=True)
        subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", "--detach",
                        self.revision], check=True)
        (dest / ".venv").symlink_to(self.venv, target_is_directory=True)
        return dest

    def cache(self, name: str) -> Path:
        """An empty cache home (with its own TMPDIR: pytest's and Hypothesis's caches)."""
        path = self.work / "caches" / name
        (path / "tmp").mkdir(parents=True)
        return path

    def env(self, cache: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in STRIPPED_ENV and not k.startswith(STRIPPED_PREFIXES)}
        env.update(XDG_CACHE_HOME=str(cache / "xdg"),
                   MINI_VLLM_BUILD_DIR=str(cache / "build"),
                   MINI_VLLM_CACHE=str(cache / "mini_vllm"),
                   TMPDIR=str(cache / "tmp"))
        return env

    def finish(self, root: Path, labs: list[str], cuda_tasks: int | None = None) -> dict:
        """Finish ``labs`` in the copy at ``root`` (a child process that imports its course)."""
        cmd = [str(root / ".venv" / "bin" / "python"), str(Path(__file__).resolve()),
               "--finish-copy", str(root), "--labs", ",".join(labs)]
        if cuda_tasks is not None:
            cmd += ["--cuda-tasks", str(cuda_tasks)]
        self.finishes += 1
        env = dict(self.env(self.cache(f"finishing-{self.finishes}")), PYTHONPATH=str(root))
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"finishing labs {labs} failed:\n{proc.stdout}{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # -- one command ----------------------------------------------------------------------------

    def _run_once(self, root: Path, argv: list[str], env_extra: dict[str, str],
                  cache: Path) -> tuple[float, int, str]:
        env = dict(self.env(cache), **env_extra)
        log = self.tmp / "last-output.txt"
        with open(log, "w+b") as out:
            start = time.perf_counter()
            # Its own process group, so that a timeout or Ctrl-C stops everything it started.
            proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=self.timeout)
            except BaseException:
                _kill_group(proc)
                if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                    raise
                code = -1
            seconds = time.perf_counter() - start
            out.seek(0)
            output = out.read().decode("utf-8", errors="replace")
        if code == -1:
            output += f"\n(killed after {self.timeout:.0f} s)"
        return seconds, code, output

    def measure(self, m: Measurement, root: Path, argv: list[str], cache: Path,
                env_extra: dict[str, str] | None = None, *, cold: bool = False,
                warm_up: bool = True, before_each=None) -> Measurement:
        """Time ``argv`` in the copy at ``root``: once when ``cold``; else an untimed run first
        (unless ``warm_up`` is false: the caches are warm already) and ``repeats`` timed runs.
        ``before_each(i)`` is called before each timed run (an edit)."""
        env_extra = env_extra or {}
        m.load_before = round(os.getloadavg()[0], 2)
        print(f"  {m.what} ({m.course}, {m.caches}) ...", end="", flush=True)
        if not cold and warm_up:
            m.warmup_s, code, output = self._run_once(root, argv, env_extra, cache)
            if code != m.expected_exit:
                m.output_tail = output[-3000:]
        for i in range(1 if cold else self.repeats):
            if before_each is not None:
                before_each(i)
            seconds, code, output = self._run_once(root, argv, env_extra, cache)
            m.runs_s.append(seconds)
            m.exit_codes.append(code)
            m.summary = _summary(output) or m.summary
            if code != m.expected_exit:
                m.output_tail = output[-3000:]
        print(" " + ", ".join(f"{s:.1f}" for s in m.runs_s) + " s"
              + (f"  [exit {m.exit_codes}, expected {m.expected_exit}]" if m.broke else ""),
              flush=True)
        self.measurements.append(m)
        return m


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _typed(env: dict[str, str], argv: list[str]) -> str:
    """The command as a student types it: variables, then the command."""
    return " ".join([f"{k}={v}" for k, v in env.items()] + [shlex.join(argv)])


# ------------------------------------------------------------------------------------------------
# The measurements
# ------------------------------------------------------------------------------------------------

PY = ".venv/bin/python"


def run_all(bench: Bench, quick: bool) -> dict:
    """Every measurement of the module docstring; returns notes on how the copies were made."""
    notes: dict = {}
    untouched = bench.clone("untouched")
    labs = _lab_list(untouched)
    chosen = [lab for lab in labs if lab["id"] in QUICK_LABS] if quick else labs
    python_labs = [lab for lab in chosen if lab["id"] != CUDA_LAB]
    cuda = next(lab for lab in labs if lab["id"] == CUDA_LAB)

    finished = bench.clone("finished")
    to_finish = [lab["id"] for lab in python_labs] + ([] if quick else [CUDA_LAB])
    notes["finished_course"] = bench.finish(finished, to_finish)

    dashboard = [PY, "-m", "course"]
    print("the dashboard, untouched course")
    cache_a = bench.cache("untouched")
    bench.measure(Measurement("dashboard/untouched/cold", "dashboard", "untouched", "cold",
                              _typed({}, dashboard), target="dashboard-untouched-cold"),
                  untouched, dashboard, cache_a, cold=True)
    bench.measure(Measurement("dashboard/untouched/warm", "dashboard", "untouched", "warm",
                              _typed({}, dashboard)), untouched, dashboard, cache_a, warm_up=False)

    print("the dashboard, finished course" + (" (quick: only " + ", ".join(to_finish)
                                                  + " finished)" if quick else ""))
    cache_b = bench.cache("finished")
    bench.measure(Measurement("dashboard/finished/cold", "dashboard", "finished", "cold",
                              _typed({}, dashboard)), finished, dashboard, cache_b, cold=True)
    bench.measure(Measurement("dashboard/finished/warm", "dashboard", "finished", "warm",
                              _typed({}, dashboard), target="dashboard-finished-warm"),
                  finished, dashboard, cache_b, warm_up=False)

    print("`course engine`, finished course")
    engine = [PY, "-m", "course", "engine"]
    bench.measure(Measurement("engine/finished/warm", "course engine", "finished", "warm",
                              _typed({}, engine), target="engine-finished-warm"),
                  finished, engine, cache_b)

    print("the per-lab command" + (f" (quick: {', '.join(QUICK_LABS)}, and the untouched "
                                     "CUDA lab)" if quick else ", every lab"))
    starter = {"LAB_IMPL": "starter"}
    for course, root, cache in (("untouched", untouched, cache_a), ("finished", finished, cache_b)):
        # --quick: the CUDA lab's untouched starter only (its finished run is the slow one).
        per_lab = chosen if not quick else python_labs + ([cuda] if course == "untouched" else [])
        for lab in per_lab:
            argv = [PY, "-m", "pytest", lab["rel"], "-q"]
            is_cuda = lab["id"] == CUDA_LAB
            target = "cuda-whole-lab" if is_cuda and course == "finished" else (
                "" if is_cuda else "lab-python")
            bench.measure(Measurement(f"lab/{lab['id']}/{course}", f"lab {lab['id']}", course,
                                      "warm", _typed(starter, argv),
                                      expected_exit=0 if course == "finished" else 1,
                                      target=target), root, argv, cache, starter)

    print("the CUDA lab's edit-to-result loop")
    cuda_root = bench.clone("cuda")
    notes["cuda_task0"] = bench.finish(cuda_root, [CUDA_LAB], cuda_tasks=1)[CUDA_LAB]
    cu = cuda_root / cuda["rel"] / "starter.cu"
    edit = ("a comment line inserted before task 0's kernel in starter.cu (its content hash "
            "changes, so the next run rebuilds what starter.cu compiles into)")
    one_task = [PY, "-m", "pytest", cuda["rel"], "-q", *CUDA_ONE_TASK]
    cache_c = bench.cache("cuda-task0")
    bench.measure(Measurement("cuda/task0/cold", "CUDA lab, task 0's tests", "task 0 written",
                              "cold", _typed(starter, one_task)), cuda_root, one_task, cache_c,
                  starter, cold=True)
    bench.measure(Measurement("cuda/task0/after-edit", "CUDA lab, task 0's tests, after an edit",
                              "task 0 written", "warm", _typed(starter, one_task), edit=edit,
                              target="cuda-one-task-after-edit"),
                  cuda_root, one_task, cache_c, starter, warm_up=False,
                  before_each=lambda i: _edit_task0(cu, i))
    if not quick:
        notes["cuda_all_tasks"] = bench.finish(cuda_root, [CUDA_LAB])[CUDA_LAB]
        whole = [PY, "-m", "pytest", cuda["rel"], "-q"]
        cache_d = bench.cache("cuda-whole")
        bench.measure(Measurement("cuda/whole/cold", "CUDA lab, whole", "every task written",
                                  "cold", _typed(starter, whole)), cuda_root, whole, cache_d,
                      starter, cold=True)
        bench.measure(Measurement("cuda/whole/after-edit", "CUDA lab, whole, after an edit",
                                  "every task written", "warm", _typed(starter, whole), edit=edit,
                                  target="cuda-whole-lab"),
                      cuda_root, whole, cache_d, starter, warm_up=False,
                      before_each=lambda i: _edit_task0(cu, 100 + i))
    return notes


def _lab_list(root: Path) -> list[dict]:
    """The copy's labs, in order, as {id, rel} (asked of the copy's own catalog)."""
    code = ("import json; from course.labs.catalog import discover; "
            "print(json.dumps([{'id': l.id, 'rel': l.rel} for l in discover()]))")
    proc = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", code], cwd=root,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def _edit_task0(cu: Path, i: int) -> None:
    text = cu.read_text(encoding="utf-8")
    marker = "// Task 0."
    if text.count(marker) != 1:
        raise RuntimeError(f"{cu}: expected one {marker!r} line to edit next to")
    cu.write_text(text.replace(marker, f"// (edit {i} by benchmarks/student_loop.py)\n{marker}"),
                  encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# The environment, the table, the README's table
# ------------------------------------------------------------------------------------------------


def environment() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    try:
        cxx = subprocess.run(["c++", "--version"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        cxx = "-"
    return {
        "nproc": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu or platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "pytest": version("pytest"),
        "c++": cxx,
        # nvcc on PATH runs the CUDA lab's nvcc-marked tests; a GPU moves its kernels onto it.
        "nvcc": shutil.which("nvcc"),
        "gpu_device_nodes": sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*")),
        "niceness": os.nice(0),
        "git_revision": _git(REPO_ROOT, "rev-parse", "HEAD"),
        "uncommitted_changes": bool(_git(REPO_ROOT, "status", "--porcelain",
                                         "--untracked-files=no")),
    }


def _fmt(m: dict) -> str:
    if "median_s" not in m:
        return "-"
    if len(m["runs_s"]) == 1:
        return f"{m['median_s']:.1f} s"
    return f"{m['median_s']:.1f} s ({m['min_s']:.1f}-{m['max_s']:.1f})"


def _mark(m: dict) -> str:
    if m.get("broke"):
        return "BROKE"
    if m["met"] is None:
        return ""
    return ("met" if m["met"] else "NOT met") + f" (<= {m['target_s']:g} s)"


def print_table(result: dict) -> None:
    rows = [("measurement", "course", "caches", "time: median (min-max)", "target")]
    for m in result["measurements"]:
        rows.append((m["what"], m["course"], m["caches"], _fmt(m), _mark(m)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    ci = result.get("ci")
    if ci:
        print("\nCI phases (from " + ci["log"] + "):")
        for p in ci["phases"]:
            print(f"  {p['name']:<14} {p['seconds']:>6.0f} s")
        print(f"  {'total':<14} {ci['total_s'] or ci['sum_of_phases_s']:>6.0f} s")
    print("\nTargets, judged on the median of the warm runs (a cold figure: its one run):")
    for key, text in TARGET_TEXT.items():
        ms = [m for m in result["measurements"] if m["target"] == key and m["met"] is not None]
        if not ms:
            print(f"  {text}: not measured")
            continue
        worst = max(ms, key=lambda m: m["median_s"])
        ok = all(m["met"] for m in ms)
        print(f"  {text}: {'met' if ok else 'NOT met'}"
              + (f" (slowest: {worst['what']}, {worst['course']}, {worst['median_s']:.1f} s)"
                 if len(ms) > 1 or not ok else f" ({worst['median_s']:.1f} s)"))


def markdown(result: dict) -> str:
    """The README's "How long things take" tables, from a results file."""
    env = result["environment"]
    by_key = {m["key"]: m for m in result["measurements"]}

    def cell(key: str) -> str:
        m = by_key.get(key)
        if not m:
            return "-"
        return _fmt(m) + (" (over its target)" if m["met"] is False else "") + (
            " (broke)" if m["broke"] else "")

    def target(key: str) -> str:
        m = by_key.get(key)
        if not m or m["met"] is None:
            return ""
        return f"{m['target_s']:g} s, {'met' if m['met'] else 'not met'}"

    runs = result["repeats"]
    lines = [
        *(["**A `--quick` run: a subset, one repeat; not the README's figures.**", ""]
          if result.get("quick") else []),
        f"Measured by `{result['command']}` on {env['nproc']} cores ({env['cpu']}), "
        f"{result['date'][:10]}, revision {env['git_revision'][:7]}, load average "
        f"{result['load_average_before'][0]:.2f} before and {result['load_average_after'][0]:.2f}"
        " after. Each command at the root of a fresh clone; caches empty (\"cold\": one run) "
        "or as the runs before left them (\"warm\": "
        + (f"the median of {runs} runs, min-max in brackets)." if runs > 1 else "one run)."),
        "",
        "| what you run | when | time | target |",
        "| --- | --- | ---: | --- |",
    ]
    rows = [
        ("`python -m course` (the dashboard)", "untouched course, cold",
         "dashboard/untouched/cold"),
        ("", "untouched course, warm", "dashboard/untouched/warm"),
        ("", "finished course, cold: runs every lab's tests and the engine exam",
         "dashboard/finished/cold"),
        ("", "finished course, warm: every result cached", "dashboard/finished/warm"),
        ("`python -m course engine`", "finished course, warm", "engine/finished/warm"),
        ("`LAB_IMPL=starter python -m pytest <lab 02-06> -q -k task0`",
         "task 0 written, empty build cache", "cuda/task0/cold"),
        ("", "after an edit of `starter.cu`", "cuda/task0/after-edit"),
        ("`LAB_IMPL=starter python -m pytest <lab 02-06> -q`", "every task written, empty build "
         "cache", "cuda/whole/cold"),
        ("", "after an edit of `starter.cu`", "cuda/whole/after-edit"),
    ]
    for what, when, key in rows:
        if key in by_key:
            lines.append(f"| {what} | {when} | {cell(key)} | {target(key)} |")
    lab_ids = sorted({m["key"].split("/")[1] for m in result["measurements"]
                      if m["key"].startswith("lab/")})
    if lab_ids:
        lines += ["", "The per-lab command, `LAB_IMPL=starter python -m pytest <lab> -q`, warm "
                  "(target: 15 s for a Python lab, 60 s for the CUDA lab):", "",
                  "| lab | untouched starter | finished |", "| --- | ---: | ---: |"]
        for lab_id in lab_ids:
            lines.append(f"| {lab_id} | {cell(f'lab/{lab_id}/untouched')} | "
                         f"{cell(f'lab/{lab_id}/finished')} |")
    ci = result.get("ci")
    if ci and ci["phases"]:
        lines += ["", "CI (`bash .ci/run`), phase by phase:", "", "| phase | time |",
                  "| --- | ---: |"]
        lines += [f"| {p['name']} | {p['seconds']:.0f} s |" for p in ci["phases"]]
        lines.append(f"| total | {ci['total_s'] or ci['sum_of_phases_s']:.0f} s |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"labs {', '.join(QUICK_LABS)} and the CUDA task 0 loop, one repeat")
    p.add_argument("--out", "--json", type=Path, default=DEFAULT_OUT,
                   help="the results file (default: benchmarks/results/student_loop.json)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each warm command (default 3; --quick: 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    p.add_argument("--ci-log", type=Path, help="a saved `bash .ci/run` log: record its phases")
    p.add_argument("--no-run", action="store_true",
                   help="with --ci-log: add the CI phases to the existing --out file, run nothing")
    p.add_argument("--markdown", type=Path, metavar="JSON",
                   help="print the README's tables from a results file and exit")
    p.add_argument("--finish-copy", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--labs", default="", help=argparse.SUPPRESS)
    p.add_argument("--cuda-tasks", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.finish_copy:  # the child process that finishes labs in a course copy
        done = finish_labs(args.finish_copy, [x for x in args.labs.split(",") if x],
                           args.cuda_tasks)
        print(json.dumps(done))
        return 0
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text(encoding="utf-8"))))
        return 0
    ci = None
    if args.ci_log:
        ci = {"log": str(args.ci_log), **parse_ci_log(args.ci_log.read_text(errors="replace"))}
        if not ci["phases"]:
            print(f"warning: {args.ci_log} has no `ci phase: NAME took N s` line", file=sys.stderr)
    command = "python benchmarks/student_loop.py " + shlex.join(argv)
    if args.no_run:
        if ci is None:
            p.error("--no-run needs --ci-log")
        result = json.loads(args.out.read_text(encoding="utf-8"))
        result["ci"] = ci
        result.setdefault("ci_added_by", command.strip())
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print_table(result)
        print(f"\nwrote {args.out}")
        return 0

    if sys.prefix == sys.base_prefix:
        p.error("run it with the course's virtual environment (.venv/bin/python): the course "
                "copies use this interpreter's environment as their .venv")
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = [round(x, 2) for x in os.getloadavg()]
    env = environment()
    if env["uncommitted_changes"]:
        print("note: this checkout has uncommitted changes; the copies are of HEAD "
              f"({env['git_revision'][:10]}), without them", file=sys.stderr)
    signal.signal(signal.SIGTERM, _on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="student-loop-"))
    t0 = time.perf_counter()
    try:
        bench = Bench(work, Path(sys.prefix), args.timeout, repeats)
        print(f"course copies and caches in {work} (removed at the end); {repeats} timed "
              f"run(s) of each warm command; load average {load_before}")
        notes = run_all(bench, args.quick)
    except KeyboardInterrupt:
        print(f"\ninterrupted; removing {work}", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if work.exists():  # a process it started still wrote there: try once more
            time.sleep(2)
            shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - t0
    result = {
        "benchmark": "student_loop",
        "command": command.strip(),
        "date": started,
        "quick": args.quick,
        "repeats": repeats,
        "wall_s": round(wall, 1),
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "environment": env,
        "how": {
            "copies": "git clone of the checkout's HEAD, a .venv link to this interpreter's "
                      "environment; commands run at the copy's root",
            "caches": "XDG_CACHE_HOME, MINI_VLLM_BUILD_DIR, MINI_VLLM_CACHE and TMPDIR point "
                      "into a temporary folder; cold = an empty one",
            "unset": list(STRIPPED_ENV) + [p + "*" for p in STRIPPED_PREFIXES],
            "warm": "one untimed run, then the timed runs",
            "judged_on": "the median of the timed runs (a cold figure: its one run)",
            "finished_course": notes.get("finished_course", {}),
            "cuda_loop": {k: v for k, v in notes.items() if k.startswith("cuda")},
        },
        "targets_s": TARGETS,
        "measurements": [m.as_json() for m in bench.measurements],
        "ci": ci,
    }
    print_table(result)
    print(f"\nwall time of the whole benchmark: {wall:.0f} s; load average before "
          f"{load_before}, after {result['load_average_after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    broke = [m for m in bench.measurements if m.broke]
    for m in broke:
        print(f"\nBROKE: {m.what} ({m.course}): exit {m.exit_codes}, expected {m.expected_exit}; "
              f"its output's end:\n{m.output_tail[-1500:]}", file=sys.stderr)
    return 1 if broke else 0


if __name__ == "__main__":
    raise SystemExit(main())
