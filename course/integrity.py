"""`python -m course check`: the course integrity checks of DESIGN.md, for every lab.

1. the solution passes every test;
2. the untouched starter fails every graded test (tests marked `starter_ok` are exempt);
3. starter.py and solution.py expose the same API;
4. every planted bug is rejected: with the bug applied to a copy of the repository, at least one
   of the lab's tests fails.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from course.api import compare
from course.bugs import BUGS_DIR, PlantedBug, bugs_path, load_bugs
from course.hints import check_hints, hints_required
from course.labs import REPO_ROOT, Lab, lab_metadata
from course.loader import load_module
from course.refs import check_consistency
from course.runner import LabRun, run_lab

copy_ignore = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "*.egg-info",
    "grades",
    ".ipynb_checkpoints",
    "results",
    ".whl",
    ".gl",
)
_RAISE_RE = re.compile(r"raise NotImplementedError\((?P<arg>[^)]*)\)")


@dataclass
class BugResult:
    bug: PlantedBug
    status: str  # "rejected", "NOT REJECTED", "not checked", "invalid"
    detail: str = ""


@dataclass
class LabCheck:
    lab: Lab
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bugs: list[BugResult] = field(default_factory=list)
    solution: LabRun | None = None
    starter: LabRun | None = None


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check_starter_messages(lab: Lab) -> list[str]:
    """Each `raise NotImplementedError(...)` in the starter names this lab and a task number
    (and, in a lab with hints, the hint command for that task)."""
    problems = []
    text = (lab.path / "starter.py").read_text(encoding="utf-8")
    expected = re.compile(rf"lab {re.escape(lab.id)}, task (\d+): \S")
    for m in _RAISE_RE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found = expected.search(m["arg"])
        if not found:
            problems.append(
                f'starter.py:{line}: NotImplementedError should say "lab {lab.id}, task N: ..."'
            )
        elif hints_required(lab):
            hint = f"python -m course hint {lab.id} {found[1]}"
            if hint not in " ".join(m["arg"].replace('"', " ").split()):
                problems.append(f"starter.py:{line}: the message should end with ({hint})")
    if not _RAISE_RE.search(text) and not (lab.path / "starter.cu").is_file():
        problems.append("starter.py leaves nothing to implement (no NotImplementedError)")
    return problems


def check_runs(check: LabCheck, root: Path) -> None:
    lab = check.lab
    sol = check.solution = run_lab(lab, "solution", root=root)
    if sol.broken:
        check.violations.append(
            f"solution: the test run broke (pytest exit {sol.exit_code}):\n" + _tail(sol.output)
        )
    else:
        for t in sol.by_outcome("failed", "not_implemented", graded=False):
            check.violations.append(f"solution fails {t['nodeid']}: {t['message']}")
        skipped = sol.by_outcome("skipped", graded=False)
        if skipped:
            check.notes.append(f"{len(skipped)} tests skipped here ({skipped[0]['message']})")
        if not sol.graded:
            check.notes.append("no graded test ran on this machine")
    st = check.starter = run_lab(lab, "starter", root=root)
    if st.broken:
        check.violations.append(
            f"starter: the test run broke (pytest exit {st.exit_code}):\n" + _tail(st.output)
        )
    else:
        for t in st.by_outcome("passed"):
            check.violations.append(
                f"passes on the untouched starter, so it proves nothing: {t['nodeid']} "
                f"(mark it starter_ok if that is intended)"
            )


def check_api(check: LabCheck) -> None:
    lab = check.lab
    try:
        starter = load_module(lab.path, "starter", lab.id)
        solution = load_module(lab.path, "solution", lab.id)
    except Exception as exc:
        check.violations.append(f"cannot import for the API check: {exc}")
        return
    check.violations.extend(f"API: {p}" for p in compare(starter, solution))


def check_bug(lab: Lab, bug: PlantedBug, has_cuda: bool, root: Path = REPO_ROOT) -> BugResult:
    problems = bug.problems(root)
    if problems:
        return BugResult(bug, "invalid", "; ".join(problems))
    if bug.requires == "cuda" and not has_cuda:
        return BugResult(bug, "not checked", "needs a CUDA GPU")
    # A tier runs only its own tests: the bug must be seen by the kind of test meant to see it.
    tier = ("-m", bug.requires) if bug.requires else ()
    with tempfile.TemporaryDirectory(prefix="course-bug-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(root, copy, ignore=copy_ignore)
        bug.apply(copy)
        run = run_lab(lab, "solution", root=copy, extra_args=("-x", *tier))
    failed = run.by_outcome("failed", "not_implemented", graded=False)
    by = f" ({bug.requires} tier)" if bug.requires else ""
    if run.exit_code == 1 and failed:
        return BugResult(bug, "rejected", f"by {failed[0]['nodeid'].split('::', 1)[-1]}{by}")
    skipped = run.by_outcome("skipped", graded=False)
    if run.exit_code == 0 and run.tests and len(skipped) == len(run.tests):
        return BugResult(bug, "not checked", f"the {bug.requires} tests were all skipped here "
                         f"({skipped[0]['message']})")
    if run.exit_code == 5 and bug.requires:
        return BugResult(bug, "invalid", f"no test of lab {lab.id} is marked {bug.requires}")
    if run.exit_code == 0:
        return BugResult(bug, "NOT REJECTED", "every test passed with the bug in place")
    return BugResult(
        bug,
        "NOT REJECTED",
        f"the test run broke instead (exit {run.exit_code}):\n" + _tail(run.output),
    )


def check_lab(lab: Lab, *, bugs_required: bool = True, root: Path = REPO_ROOT) -> LabCheck:
    """The checks of one lab but its planted-bug runs, which the caller runs with check_bug."""
    check = LabCheck(lab)
    missing = lab.missing_files()
    if missing:
        check.violations.append(f"missing {', '.join(missing)}")
        return check
    check.violations.extend(check_starter_messages(lab))
    check.violations.extend(f"hints: {p}" for p in check_hints(lab))
    if (lab.path / "planted_bugs.py").exists():
        check.violations.append(
            f"planted_bugs.py belongs in {bugs_path(lab).relative_to(lab.phase_dir.parent)}, "
            f"not in the student's lab folder (it quotes the reference)"
        )
    check_api(check)
    check_runs(check, root)
    if bugs_required:
        try:
            listed = load_bugs(lab)
        except Exception as exc:
            check.violations.append(f"{BUGS_DIR}/{lab.id}.py: {exc}")
        else:
            if not listed:
                check.violations.append(
                    f"no planted bugs ({BUGS_DIR}/{lab.id}.py with BUGS = [...])"
                )
            if len({b.name for b in listed}) != len(listed):
                check.violations.append("planted bug names are not unique")
    return check


def check_metadata(labs: list[Lab]) -> list[str]:
    """course/labs.toml has a table for every lab and none for a lab that does not exist; every
    engine part is a name that both the starter and the solution export."""
    try:
        meta = lab_metadata()
    except ValueError as exc:
        return [str(exc)]
    ids = {lab.id for lab in labs}
    problems = [f"course/labs.toml: no table for lab {i}" for i in sorted(ids - set(meta))]
    problems += [f"course/labs.toml: lab {i} does not exist" for i in sorted(set(meta) - ids)]
    for lab in labs:
        for name in (*lab.engine_parts, *lab.meta.get("notebook", ())):
            for impl in ("starter", "solution"):
                if name not in _exported_names(lab, impl):
                    problems.append(
                        f"course/labs.toml: lab {lab.id}: engine part {name!r} is not in "
                        f"{impl}.py's __all__"
                    )
    return problems


def _exported_names(lab: Lab, impl: str) -> set[str]:
    """Names in a lab file's `__all__`, read from its source (nothing is imported)."""
    import ast

    tree = ast.parse((lab.path / f"{impl}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


def check_course() -> list[str]:
    """Checks that concern the course as a whole rather than one lab."""
    from course.labs import discover

    problems = [f"upstream refs: {p}" for p in check_consistency(REPO_ROOT)]
    return problems + check_metadata(discover())


def _tail(text: str, n: int = 15) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[-n:])
