"""The class-grading workflow, .github/workflows/grade.yml: its shape (what keeps grades and
tokens private), its own `run:` scripts run in a simulated GitHub workspace, and the workflow
linters (actionlint, zizmor) over .github/workflows/.

The simulation lays out the workspace as the runner does (`course/` is this checkout, the
roster names two local student repositories), then runs the plan job's and the grade job's
`run:` scripts as GitHub would (`bash -e -o pipefail`, the step's working directory, the step's
`env:` with its `${{ }}` expressions filled in here). The install step runs for real: its venv
(GRADER_VENV) sees this test's installed packages through a `.pth` file, so pip finds every pin
already satisfied and installs only the course itself. (`venv --system-site-packages` would not
do: from a venv it reaches the base interpreter's packages, not the venv's.)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from course.grading.roster import shard_of

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW = WORKFLOWS / "grade.yml"
# Made at run time: the class folders are copies of this file, so a literal would be found.
TOKEN = "github_pat_" + secrets.token_hex(20)
DEADLINE = "2099-01-01T00:00:00Z"
SHARDS = 2
GIT_ID = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
          "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}


def load() -> dict:
    return yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))


def triggers(wf: dict) -> dict:
    return wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True


def all_steps(wf: dict):
    for name, job in wf["jobs"].items():
        for step in job.get("steps", []):
            yield name, step


# --- the shape ----------------------------------------------------------------------------------


def test_three_jobs_a_matrix_from_the_plan_and_merge_after_all():
    wf = load()
    jobs = wf["jobs"]
    assert set(jobs) == {"plan", "grade", "merge"}
    assert re.fullmatch(r"\$\{\{\s*steps\.plan\.outputs\.matrix\s*\}\}",
                        jobs["plan"]["outputs"]["matrix"])
    assert jobs["grade"]["needs"] in ("plan", ["plan"])
    assert re.fullmatch(r"\$\{\{\s*fromJSON\(needs\.plan\.outputs\.matrix\)\s*\}\}",
                        jobs["grade"]["strategy"]["matrix"])
    assert jobs["grade"]["strategy"]["fail-fast"] is False  # one broken shard stops no other
    assert set(jobs["merge"]["needs"]) == {"plan", "grade"}
    assert "always()" in jobs["merge"]["if"]
    assert jobs["grade"]["env"]["GRADER_VENV"] == jobs["merge"]["env"]["GRADER_VENV"]


def test_no_credentials_kept_least_privilege_and_pinned_actions():
    wf = load()
    checkouts = [s for _, s in all_steps(wf) if s.get("uses", "").startswith("actions/checkout")]
    assert len(checkouts) == 3
    for step in checkouts:
        assert step["with"]["persist-credentials"] is False
        assert step["with"]["path"] == "course"
    for _, step in all_steps(wf):
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), step["uses"]
    assert wf["permissions"] == {"contents": "read"}
    for name, job in wf["jobs"].items():
        writes = {k for k, v in job.get("permissions", {}).items() if v == "write"}
        assert writes == ({"checks"} if name == "merge" else set()), (name, writes)


def test_inputs_private_by_default_and_no_cron():
    wf = load()
    on = triggers(wf)
    assert set(on) == {"workflow_dispatch"}  # no schedule, no push
    assert re.search(r"^\s*#\s*schedule:", WORKFLOW.read_text(), re.M)  # an example, commented
    inputs = on["workflow_dispatch"]["inputs"]
    assert inputs["roster"]["default"] == "grading/roster.csv"
    assert inputs["deadline"]["default"] == ""
    assert int(inputs["shards"]["default"]) >= 1
    for name in ("publish_summary", "publish_checks"):
        assert inputs[name]["type"] == "boolean" and inputs[name]["default"] is False
    merge = wf["jobs"]["merge"]["steps"]
    publishing = {n: [s for s in merge if f"inputs.{n}" in str(s.get("if", ""))]
                  for n in ("publish_summary", "publish_checks")}
    assert [s.get("uses", "").split("@")[0] for s in publishing["publish_checks"]] == [
        "mikepenz/action-junit-report"]
    assert ["GITHUB_STEP_SUMMARY" in s["run"] for s in publishing["publish_summary"]] == [True]
    for _, step in all_steps(wf):  # nothing else writes the summary or a check run
        if step not in publishing["publish_summary"]:
            assert "GITHUB_STEP_SUMMARY" not in step.get("run", "")


def test_run_scripts_expand_no_expression():
    """Inputs and event fields reach scripts through `env:` only (no template injection)."""
    for job, step in all_steps(load()):
        assert "${{" not in step.get("run", ""), (job, step.get("name"))


def test_the_install_steps_pin_the_same_torch_as_requirements():
    pinned = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)[1]
    installs = [s["run"] for _, s in all_steps(load()) if "pip" in s.get("run", "")]
    assert len(installs) == 2 and installs[0] == installs[1]
    assert f"torch=={pinned} --index-url https://download.pytorch.org/whl/cpu" in installs[0]


# --- the scripts, in a simulated workspace --------------------------------------------------------


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, **GIT_ID, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def copy_checkout(dest: Path) -> None:
    """This checkout's files as they are now (tracked, and new ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout
    for rel in sorted(set(filter(None, listed.decode().split("\0")))):
        src = ROOT / rel
        if src.is_symlink() or not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def class_of_two() -> tuple[str, str]:
    """Two names in the same shard of SHARDS, so the plan leaves the other shard out."""
    names = [f"student{i}" for i in range(20)]
    first = names[0]
    return first, next(n for n in names[1:] if shard_of(n, SHARDS) == shard_of(first, SHARDS))


class Runner:
    """Runs a job's steps as the GitHub runner would, in ``workspace``."""

    def __init__(self, workspace: Path, env: dict[str, str]):
        self.workspace = workspace
        self.env = env
        self.context: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def expand(self, value) -> str:
        def one(match: re.Match) -> str:
            expr = match[1].strip()
            if expr not in self.context:
                pytest.fail(f"grade.yml uses ${{{{ {expr} }}}}, which this test does not know: "
                            "add it to the context in tests/test_grade_workflow.py")
            return self.context[expr]

        return re.sub(r"\$\{\{(.*?)\}\}", one, str(value))

    def run(self, job: dict, step: dict) -> subprocess.CompletedProcess:
        env = dict(self.env)
        env.update({k: self.expand(v) for k, v in job.get("env", {}).items()})
        env.update({k: self.expand(v) for k, v in step.get("env", {}).items()})
        script = self.workspace.parent / "step.sh"
        script.write_text(step["run"])
        started = time.monotonic()
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
                              cwd=self.workspace / step.get("working-directory", "."), env=env,
                              capture_output=True, text=True, timeout=600)
        self.seconds[step.get("name", step["run"][:30])] = time.monotonic() - started
        assert proc.returncode == 0, (step.get("name"), proc.stdout[-3000:], proc.stderr[-3000:])
        return proc

    def outputs(self) -> dict[str, str]:
        path = Path(self.env["GITHUB_OUTPUT"])
        lines = path.read_text().splitlines() if path.exists() else []
        path.write_text("")
        return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Plan, then one shard's install and clone steps, run for real. Yields what they made."""
    tmp = tmp_path_factory.mktemp("gh")
    ws = tmp / "workspace"
    course = ws / "course"
    course.mkdir(parents=True)
    copy_checkout(course)
    git(course, "init", "-q", "-b", "main")
    git(course, "add", "-A")
    git(course, "commit", "-q", "-m", "the course")

    # Two students: clones of the course with one starter edited (one of them on a branch).
    starter = sorted(course.glob("phase-*/labs/lab-*/starter.py"))[0].relative_to(course)
    first, second = class_of_two()
    commits = {}
    for name, ref in ((first, ""), (second, "submitted")):
        repo = tmp / "forks" / name
        git(tmp, "clone", "-q", str(course), str(repo))
        if ref:
            git(repo, "checkout", "-q", "-b", ref)
        with open(repo / starter, "a") as f:
            f.write(f"\n# {name} was here\n")
        git(repo, "commit", "-q", "-am", "my work")
        commits[name] = git(repo, "rev-parse", "HEAD")
    (course / "grading" / "roster.csv").write_text(
        "# the test's class\nstudent,repository,ref,login\n"
        f"{first},{tmp / 'forks' / first},,\n{second},{tmp / 'forks' / second},submitted,\n")

    # The runner: its variables, `sudo` as a pass-through, the grader's venv over this one's
    # packages (pip must find them all installed).
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
                                  'exec "$@"\n')
    # Outside pytest's private temporary folders, as /opt/grader/venv is on a runner: the
    # sandbox runs student code as nobody, who must be able to run this interpreter.
    venv_root = Path(tempfile.mkdtemp(prefix="course-grader-venv-"))
    venv_root.chmod(0o755)
    venv = venv_root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    ours = [str(Path(p).resolve()) for p in site.getsitepackages()]
    (purelib / "_test_parent_packages.pth").write_text("\n".join(ours) + "\n")
    (venv / "bin" / "pip").write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    for path in (bin_dir / "sudo", venv / "bin" / "pip"):
        path.chmod(0o755)
    before = {p: sorted(os.listdir(p)) for p in ours}

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GITHUB_", "PYTHON", "VIRTUAL_ENV", "LAB_IMPL", "CLASS_TOKEN"))}
    env.update(GIT_ID, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", CI="true",
               GITHUB_WORKSPACE=str(ws), GITHUB_OUTPUT=str(tmp / "output"),
               GITHUB_STEP_SUMMARY=str(tmp / "summary.md"), RUNNER_TEMP=str(tmp),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    runner = Runner(ws, env)
    wf = load()
    runner.context.update({
        "inputs.roster || 'grading/roster.csv'": "grading/roster.csv",
        "inputs.shards || 4": str(SHARDS),
        "inputs.deadline": DEADLINE,
        "secrets.CLASS_TOKEN": TOKEN,
    })
    for step in wf["jobs"]["plan"]["steps"]:
        if "run" in step:
            runner.run(wf["jobs"]["plan"], step)
    plan = runner.outputs()
    matrix = json.loads(plan["matrix"])
    assert matrix == {"shard": [shard_of(first, SHARDS) + 1]}, plan  # the empty shard left out
    assert plan["shards"] == str(SHARDS)

    shard = matrix["shard"][0]
    runner.context.update({"matrix.shard": str(shard),
                           "needs.plan.outputs.shards": plan["shards"]})
    job = wf["jobs"]["grade"]
    job = dict(job, env=dict(job["env"], GRADER_VENV=str(venv)))
    steps = [s for s in job["steps"] if "run" in s]
    grading = next(i for i, s in enumerate(steps) if "-m course grade" in s["run"])
    for step in steps[:grading]:
        runner.run(job, step)
    after = {p: sorted(os.listdir(p)) for p in ours}
    yield {"tmp": tmp, "ws": ws, "runner": runner, "job": job, "rest": steps[grading:],
           "shard": shard, "commits": commits, "starter": starter, "wf": wf,
           "venv": venv, "parent_unchanged": before == after}
    shutil.rmtree(venv_root, ignore_errors=True)


def test_install_and_clone_steps_run_as_on_github(workspace):
    ws, commits = workspace["ws"], workspace["commits"]
    runner = workspace["runner"]
    print("step seconds:", {k: round(v, 1) for k, v in runner.seconds.items()})
    assert workspace["parent_unchanged"], "the install step changed this test's own venv"
    # The install step put the course (this checkout's copy) into the grader's venv.
    proc = subprocess.run([str(workspace["venv"] / "bin" / "python"), "-c",
                           "import course, mini_vllm; print(course.__file__)"],
                          cwd=workspace["tmp"], capture_output=True, text=True)
    assert proc.returncode == 0 and str(ws / "course") in proc.stdout, proc.stderr
    # The clone step: one folder per student at its commit, and the record beside the shard.
    klass = ws / "class"
    assert sorted(p.name for p in klass.iterdir()) == sorted([".roster.json", *commits])
    for name, commit in commits.items():
        assert git(klass / name, "rev-parse", "HEAD") == commit
        assert f"# {name} was here" in (klass / name / workspace["starter"]).read_text()
    record = json.loads((ws / "shards" / f"clone-shard-{workspace['shard']}.json").read_text())
    assert record["deadline"] == "2099-01-01T00:00:00+00:00"
    assert {n: s["commit"] for n, s in record["students"].items()} == commits
    for path in klass.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def grade_help(course: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "course", "grade", "--help"], cwd=course,
                          env=dict(os.environ, PYTHONPATH=str(course)), capture_output=True,
                          text=True, timeout=120)
    return proc.stdout


def test_grade_and_merge_steps_run_as_on_github(workspace):
    ws, runner = workspace["ws"], workspace["runner"]
    if os.geteuid() != 0:
        pytest.skip("the grade step runs the grader as root (sudo on a runner), for its sandbox; "
                    "this test is not root (the install and clone steps ran)")
    usage = grade_help(ws / "course")
    assert "--shard" in usage and "--merge" in usage
    for step in workspace["rest"]:
        runner.run(workspace["job"], step)
    shard_out = ws / "shards" / f"grades-shard-{workspace['shard']}"
    assert (shard_out / "grades.csv").is_file()
    merge = workspace["wf"]["jobs"]["merge"]
    merge = dict(merge, env=dict(merge["env"], GRADER_VENV=str(workspace["venv"])))
    for step in merge["steps"]:  # the artifacts are already where the download would put them
        condition = str(step.get("if", ""))
        if "run" not in step or "pip" in step["run"] or "inputs.publish" in condition:
            continue
        runner.run(merge, step)
    for name in ("grades.csv", "summary.md", "gradebook.csv", "class.json"):
        assert (ws / "grades" / name).is_file(), name
    assert (ws / "grades" / "shards" / f"clone-shard-{workspace['shard']}.json").is_file()


# --- the linters --------------------------------------------------------------------------------


def linter(name: str) -> str:
    found = Path(sys.executable).parent / name
    path = str(found) if found.exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (requirements.txt installs it on Linux x86-64)")
    return path


def test_actionlint_finds_nothing():
    proc = subprocess.run([linter("actionlint"), "-no-color"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_finds_nothing():
    proc = subprocess.run([linter("zizmor"), "--offline", "--no-progress", "--color", "never",
                           str(WORKFLOWS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
