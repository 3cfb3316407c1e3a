"""`python -m course engine`: the student's finished labs composed into mini_vllm, and the exam.

The student is played by tests/fixtures/student/ (labs 02-01, 02-03, 02-04 and 03-01 written
without reading the reference) and by stand-ins (course/integrity/shadow.py: private copies of the
reference). Every engine runs in its own process, as the command runs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course.labs.catalog import REPO_ROOT, Lab, copy_ignore, discover
from course.labs.tasks import unfinished_tasks

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "student"
STUDENT_LABS = ("02-01", "02-03", "02-04", "03-01")
LABS = {lab.id: lab for lab in discover()}

# A mistake a student really makes, that lab 02-03's own tests do not see: free() keeps the
# request's "blocks already cached" count, and a re-admitted request only sets that count when it
# has none. After a preemption the request's new full blocks are never hashed.
FORGETS_CACHED_COUNT = [
    ("        self.num_cached_block.pop(request.request_id, None)\n        if table is None:",
     "        if table is None:"),
    ("        self.num_cached_block[request_id] = len(new_computed_blocks)",
     "        self.num_cached_block.setdefault(request_id, len(new_computed_blocks))"),
]


# A second mistake, in another lab: running requests ignore long_prefill_token_threshold, so only
# the case that sets one (chunked-shared-prefix) sees it.
IGNORES_THRESHOLD = [("        if threshold > 0:\n            n = min(n, threshold)\n", "")]


def _course_copy(tmp_path: Path, labs=STUDENT_LABS) -> Path:
    root = tmp_path / "course"
    shutil.copytree(REPO_ROOT, root, ignore=copy_ignore)
    for lab_id in labs:
        rel = LABS[lab_id].rel
        shutil.copyfile(FIXTURE / rel / "starter.py", root / rel / "starter.py")
    return root


def _run(root: Path, *args: str, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1")
    env.pop("LAB_IMPL", None)
    return subprocess.run([sys.executable, "-m", "course", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _plant(path: Path, edits: list[tuple[str, str]]) -> None:
    text = path.read_text(encoding="utf-8")
    for find, replace in edits:
        assert text.count(find) == 1, f"the fixture changed: {find!r} not found once"
        text = text.replace(find, replace)
    path.write_text(text, encoding="utf-8")


def test_unfinished_tasks_are_read_from_the_starter():
    """The untouched starters have tasks left, in task order; the fixture's have none."""
    todo = unfinished_tasks(LABS["03-01"])
    assert todo and todo[0].startswith("lab 03-01, task 1: ")
    numbers = [int(t.split("task ")[1].split(":")[0]) for t in todo]
    assert numbers == sorted(numbers)
    for lab_id in STUDENT_LABS:
        assert not unfinished_tasks(LABS[lab_id], root=FIXTURE)


def _remember_done(lab: Lab, cache: Path, monkeypatch) -> None:
    """Record a passing run of ``lab``'s starter in the result cache under ``cache``, under the key
    the course computes for it (course.labs.results), as if its tests had just passed."""
    from course.labs.results import record, result_key
    from course.labs.runner import LabRun

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    passed = {"nodeid": "test_lab.py::test_recorded", "outcome": "passed",
              "starter_ok": False, "points": 1, "message": ""}
    record(LabRun(lab, "starter", 0, [passed]), result_key(lab, "starter"))


def test_finished_labs_become_the_engine_and_match_the_reference(tmp_path, monkeypatch):
    """Default composition: the labs whose starter is complete and passes its tests. Lab 02-04's
    slow tests are recorded as passed in the result cache (under its key) to keep this short."""
    root = _course_copy(tmp_path)
    cache = tmp_path / "cache"
    _remember_done(Lab(root / LABS["02-04"].rel), cache, monkeypatch)
    proc = _run(root, "engine", "--max-tokens", "24", cache=cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Identical to the reference engine, token for token" in out
    for lab_id in STUDENT_LABS:
        assert f"\n{lab_id}  yours" in out, out
    assert "03-02  reference (not finished: task 1 unwritten)" in out
    # The student's 02-01 starter predates the course's last change to its given code (its
    # __all__ still exports a hasher lab 02-03 now writes): said, once, before the engine runs.
    notes = [line for line in out.splitlines() if "given code changed" in line]
    assert notes == ["lab 02-01: given code changed: __all__ -- run `python -m course upgrade "
                     "02-01`"], out
    # The tests that ran were remembered: a second run runs none.
    recorded = cache / "mini_vllm-course" / "lab-results"
    assert all(list(recorded.glob(f"{lab_id}-starter-*.json")) for lab_id in STUDENT_LABS)
    again = _run(root, "engine", "--max-tokens", "4", cache=cache)
    assert "Running the tests" not in again.stderr and again.returncode == 0
    # The exam on that composition passes its case, yet the unfinished labs ran as the
    # reference: the verdict says the engine is not theirs yet, and which labs it did not test.
    exam = _run(root, "engine", "--exam", "--case", "prefix-odd-lengths", "--bisect", "none",
                cache=cache)
    summary = next(line for line in exam.stdout.splitlines() if "exam cases passed" in line)
    assert summary.startswith("1/1 exam cases passed") and "not your engine yet" in summary, (
        exam.stdout + exam.stderr)
    assert ("Labs 02-07, 03-02, 03-03, 03-04, 03-05, 03-06, 04-01, 04-02, 04-03, 04-04, 04-05, "
            "04-06, 04-07 ran as the reference"
            in summary), summary


def test_every_failing_case_is_bisected_and_the_diagnosis_is_computed(tmp_path):
    """Two mistakes in two labs, each failing its own case: each case is bisected and blamed on
    its lab (bisecting only the first failure hid the second mistake), and the first failure
    shows every counter that differs with both values and the first step that differs, never
    a stock guess."""
    root = _course_copy(tmp_path)
    _plant(root / LABS["02-03"].rel / "starter.py", FORGETS_CACHED_COUNT)
    _plant(root / LABS["03-01"].rel / "starter.py", IGNORES_THRESHOLD)
    report = tmp_path / "exam.json"
    proc = _run(root, "engine", "--exam", "--labs", ",".join(STUDENT_LABS), "--case",
                "preempt-recompute", "--case", "prefix-odd-lengths", "--case",
                "chunked-shared-prefix", "--json", str(report), cache=tmp_path / "cache")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    outcomes = {c["case"]: c["outcome"] for c in data["cases"]}
    assert outcomes == {"prefix-odd-lengths": "passed", "chunked-shared-prefix": "failed",
                        "preempt-recompute": "failed"}
    blamed = {b["case"]: b["blamed"] for b in data["bisections"]}
    assert blamed == {"chunked-shared-prefix": ["03-01"], "preempt-recompute": ["02-03"]}
    out = proc.stdout
    assert "2 separate mistakes" in out and "labs 03-01, 02-03" in out, out
    first = next(c for c in data["cases"] if c["outcome"] == "failed")
    assert first["case"] == "chunked-shared-prefix"
    # The headline says where the steps part; the detail gives both values of each difference.
    assert "first differ from the reference's at step" in first["message"], first
    assert any(line.startswith("step ") for line in first["detail"]), first["detail"]
    assert any("yours" in line and "reference" in line for line in first["detail"])
    assert "hashed too early" not in out and "unhashed" not in out
    assert ("Reproduce it: python -m course engine --exam --case chunked-shared-prefix --labs "
            "02-01,02-03,02-04,03-01") in out
    recompute = next(c for c in data["cases"] if c["case"] == "preempt-recompute")
    # The mistake (new full blocks never hashed after a preemption) recomputes prompt tokens.
    counts = [re.fullmatch(r"  prompt tokens computed: yours (\d+), reference (\d+)", line)
              for line in recompute["detail"]]
    yours, ref = next(m for m in counts if m).groups()
    assert int(yours) > int(ref), recompute["detail"]


def _record(steps: list[dict], **counters) -> dict:
    from course.engine.exam import COUNTERS, STEP_FIELDS

    full = [{key: [] for key in STEP_FIELDS} | {"swap_out": 0, "swap_in": 0, "nan": 0} | step
            for step in steps]
    return {"counters": {key: 0 for key in COUNTERS} | counters, "steps": full}


def test_the_diagnosis_lists_each_differing_counter_and_the_first_differing_step():
    from course.engine.exam import diagnosis

    reference = _record(
        [{"scheduled": [["0-0", 4], ["1-0", 4]]},
         {"scheduled": [["0-0", 1]], "preempted": [["1-0", 2]], "swap_out": 2,
          "swapped": ["1-0"]}],
        num_preemptions=1, num_blocks_swapped_out=2, num_blocks_swapped_in=2)
    mine = _record(
        [{"scheduled": [["0-0", 4], ["1-0", 4]]},
         {"scheduled": [["0-0", 1]], "preempted": [["1-0", 2]], "waiting": ["1-0"]}],
        num_preemptions=1, prefix_cache_hits=8)
    summary, detail = diagnosis(1, mine, reference)
    assert summary == ("your engine's steps first differ from the reference's at step 2 "
                       "(blocks swapped out, waiting queue, swapped queue)")
    assert detail == [
        "counters that differ:",
        "  blocks swapped out: yours 0, reference 2",
        "  blocks swapped in: yours 0, reference 2",
        "  prefix-cache hit tokens: yours 8, reference 0",
        "step 2 of generate call 1 is the first that differs:",
        "  blocks swapped out: yours 0, reference 2",
        "  waiting queue: yours 1-0, reference none",
        "  swapped queue: yours none, reference 1-0",
        "  the same in both: scheduled (request:tokens) 0-0:1; preempted (request:blocks it "
        "held) 1-0:2",
    ]
    assert diagnosis(1, reference, reference) == ("", [])
    # A run that raised: only the steps it made are compared.
    summary, detail = diagnosis(1, _record(reference["steps"][:1]), reference, finished=False)
    assert summary == "your engine's 1 step(s) before the error were the reference's"


def test_a_scheduler_method_that_breaks_the_budget_is_named_with_the_numbers():
    from mini_vllm.config import SchedulerConfig
    from mini_vllm.core.sched.scheduler import Scheduler
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    class Overspends(Scheduler):
        def _schedule_waiting(self, step):
            super()._schedule_waiting(step)
            step.token_budget += 3  # forgets to take one request's tokens off the budget

    config = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_gpu_blocks=16,
                             max_model_len=64, enable_prefix_caching=False)
    scheduler = Overspends(config)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2), None))
    with pytest.raises(AssertionError) as info:
        scheduler.schedule()
    assert str(info.value).startswith(
        "Scheduler._schedule_waiting (lab 03-01) left step.token_budget=8, but 3 of the 8 tokens "
        "are scheduled (a: 3), which leaves 5")


def test_a_hung_piece_is_a_timeout_not_a_hang(tmp_path):
    root = _course_copy(tmp_path, labs=("03-01",))
    starter = root / LABS["03-01"].rel / "starter.py"
    text = starter.read_text()
    head = "    def _num_new_tokens(self, request: Request, token_budget: int) -> int:\n"
    assert text.count(head) == 1
    starter.write_text(text.replace(head, head + "        while True:\n            pass\n"))
    report = tmp_path / "exam.json"
    proc = _run(root, "engine", "--exam", "--labs", "03-01", "--case", "prefix-odd-lengths",
                "--case", "prompt-plus-output", "--case-timeout", "3", "--bisect", "first",
                "--json", str(report), cache=tmp_path / "cache", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "TIMEOUT" in proc.stdout and "did not finish within 3 s" in proc.stdout
    # --bisect first (what the grader asks for): only the first of the two failing cases is
    # rerun, so a hung piece costs one more case timeout, not one per failing case.
    bisections = json.loads(report.read_text())["bisections"]
    assert [b["case"] for b in bisections] == ["prefix-odd-lengths"], bisections


def _composed_in(root, code):
    """``code`` run in a fresh process of the stand-in tree ``root``; it must exit 0."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_stand_ins_compose_and_an_extended_class_keeps_the_reference_members(tmp_path):
    """Lab 03-01 a stand-in's, labs 03-03, 04-02 and 04-04 the reference: the engine runs the
    stand-in's scheduler with the reference's swap members and draft members on top, and the
    reference's async scheduler rebuilt on it."""
    from course.integrity.shadow import shadow_tree

    root = shadow_tree(tmp_path / "tree")
    code = (
        "from course.engine.compose import compose\n"
        "c = compose(['03-01'])\n"
        "import mini_vllm.engine.core as core, mini_vllm.core.sched.scheduler as ref\n"
        "from mini_vllm_shadow_03_01.core.sched.scheduler import Scheduler as Theirs\n"
        "cls = core.Scheduler\n"
        "assert cls is ref.Scheduler and issubclass(cls, Theirs) and cls is not Theirs\n"
        "def owner(m):\n"
        "    return next(k.__dict__[m] for k in cls.__mro__ if m in k.__dict__).__module__\n"
        "assert owner('_preempt_by_swap') == 'mini_vllm.core.sched.scheduler'\n"
        "assert owner('_take_spec_tokens') == 'mini_vllm.core.sched.scheduler'\n"
        "assert owner('_schedule_running') == 'mini_vllm_shadow_03_01.core.sched.scheduler'\n"
        "a = core.AsyncScheduler\n"  # lab 04-02's reference, rebuilt on the stand-in's scheduler
        "assert issubclass(a, Theirs) and a.__module__ == 'mini_vllm.core.sched.async_scheduler'\n"
        "print(dict((r[0], r[1]) for r in c.lab_rows()))\n"
    )
    proc = _composed_in(root, code)
    assert "'03-01': 'yours'" in proc.stdout and "'03-03': 'reference'" in proc.stdout
    assert "'04-04': 'reference'" in proc.stdout
    for case in ("preempt-swap", "async-scheduling"):
        exam = _run(root, "engine", "--exam", "--labs", "03-01", "--case", case,
                    cache=tmp_path / "cache")
        assert exam.returncode == 0, exam.stdout + exam.stderr


def test_the_reference_persistent_runner_is_rebuilt_on_a_stand_in_s_runner(tmp_path):
    """Lab 03-04 a stand-in's, lab 04-03 the reference: the persistent batch's runner is the
    reference's rebuilt on the stand-in's ModelRunner (its step, its records, its sampling), and
    the exam's persistent-batch case passes with it."""
    from course.integrity.shadow import shadow_tree

    root = shadow_tree(tmp_path / "tree")
    code = (
        "from course.engine.compose import compose\n"
        "compose(['03-04'])\n"
        "import mini_vllm.engine.core as core\n"
        "from mini_vllm_shadow_03_04.worker.model_runner import ModelRunner as Theirs\n"
        "p = core.PersistentBatchRunner\n"
        "assert issubclass(p, Theirs) and p.__module__ == 'mini_vllm.worker.persistent_runner'\n"
        "assert p.__mro__[1] is Theirs\n"
    )
    _composed_in(root, code)
    exam = _run(root, "engine", "--exam", "--labs", "03-04", "--case", "persistent-batch",
                cache=tmp_path / "cache")
    assert exam.returncode == 0, exam.stdout + exam.stderr


def test_bad_requests_exit_2_and_change_nothing(tmp_path):
    before = sorted(p.name for p in REPO_ROOT.iterdir())
    proc = _run(REPO_ROOT, "engine", "--labs", "02-02", cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "02-02 builds no engine piece" in proc.stderr
    proc = _run(REPO_ROOT, "engine", "--exam", "--case", "no-such-case", "--impl", "solution",
                cache=tmp_path / "cache")
    assert proc.returncode == 2 and "no exam case named no-such-case" in proc.stderr
    assert sorted(p.name for p in REPO_ROOT.iterdir()) == before


def test_compose_twice_in_one_process_is_refused(tmp_path):
    code = ("from course.engine.compose import compose, CompositionError\n"
            "compose([])\n"
            "try:\n    compose([])\nexcept CompositionError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert "refused: compose() already ran in this process" in proc.stdout, proc.stderr


@pytest.mark.parametrize("phase", ["02", "03"])
def test_the_notebook_switch_draws_the_students_pieces(tmp_path, phase, monkeypatch):
    root = _course_copy(tmp_path)
    cache = tmp_path / "cache"
    for lab_id in STUDENT_LABS:
        _remember_done(Lab(root / LABS[lab_id].rel), cache, monkeypatch)
    code = ("from course.engine.compose import use_pieces\n"
            f"pieces = use_pieces(True, phase={phase!r})\n"
            "import mini_vllm.core.kv_cache_manager as m, mini_vllm.core.sched.scheduler as s\n"
            "print(m.KVCacheManager.__module__, s.Scheduler.__module__)\n")
    env = dict(os.environ, PYTHONPATH=str(root), XDG_CACHE_HOME=str(cache))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "lab 02-03: yours" in proc.stdout and "lab 03-02: reference" in proc.stdout
    assert "course_labs.lab_02_03.starter course_labs.lab_03_01.starter" in proc.stdout


def test_the_exam_is_a_graded_unit_when_every_engine_lab_is_graded():
    from types import SimpleNamespace

    from course.engine.compose import engine_labs
    from course.engine.exam import GRADED_SWEEP, cases
    from course.grading.grader import CommandUnit, graded_units
    from course.labs.catalog import exam_metadata

    every = SimpleNamespace(labs=discover(), manifest={})
    exam = [u for u in graded_units(every) if isinstance(u, CommandUnit)]
    assert len(exam) == 1
    unit = exam[0]
    assert unit.max_points == {"cpu": float(exam_metadata()["points"])}
    assert unit.cases == [c.name for c in cases(GRADED_SWEEP)]
    assert unit.argv[unit.argv.index("--labs") + 1] == "all"
    some = SimpleNamespace(labs=[lab for lab in discover() if lab.id != engine_labs()[0].id],
                           manifest={})
    assert not [u for u in graded_units(some) if isinstance(u, CommandUnit)]


def test_the_dashboard_shows_the_exam_as_graded_beside_the_reference_for_unfinished_labs(
        tmp_path, monkeypatch):
    """As graded: every engine lab as the files hold it (an unwritten one is its published
    starter, the grader's `--labs all`); beside it, the done labs with the reference for the
    rest. What is checked is which compositions run, when, and how each row is labelled: the
    exam is a stand-in that passes when every lab it composes is done, and a lab's files are
    played by what the dashboard is told of it (written, done)."""
    from course.engine import command
    from course.engine.compose import GPU_ONLY_LABS, engine_labs
    from course.engine.exam import GRADED_SWEEP, cases
    from course.labs.runner import LabRun

    n = len(cases(GRADED_SWEEP))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(command, "_cuda_available", lambda: False)
    ran: list[list[str]] = []
    finished: set[str] = set()

    def exam(job, timeout_s):
        ran.append(job["labs"])
        assert Path(job["reference"]).parent == tmp_path / "cache" / "mini_vllm-course"
        total = len(job["cases"])
        passed = total if set(job["labs"]) <= finished else 0
        return {"passed": passed, "total": total, "error": None, "composition_error": False}

    monkeypatch.setattr(command, "run_exam_job", exam)
    cpu_labs = [lab.id for lab in engine_labs() if lab.id not in GPU_ONLY_LABS]
    passed = {"nodeid": "t", "outcome": "passed", "starter_ok": False, "points": 1, "message": ""}
    failed = {**passed, "outcome": "failed"}

    def dashboard(done=(), started=()):
        """The exam rows of a dashboard where `done` labs pass, `started` ones are written and
        fail a test, and every other lab is as published."""
        written = {*done, *started}
        finished.clear()
        finished.update(done)
        monkeypatch.setattr(command, "is_untouched", lambda lab, published: lab.id not in written)
        monkeypatch.setattr(command, "result_key",
                            lambda lab, impl: f"{lab.id} {lab.id in written} {lab.id in done}")
        runs = [LabRun(lab, "starter", 0, [passed]) if lab.id in done else
                LabRun(lab, "starter", 1, [passed, failed]) if lab.id in started else
                LabRun(lab, "starter", 0, [], origin="untouched") for lab in discover()]
        return [row[2:6] for row in command.exam_rows(runs)]

    # Nothing written: the grader skips the exam, so nothing runs.
    first = "finish an engine lab (02-01 is the first), then `python -m course engine`"
    assert dashboard() == [["Your mini_vllm: the engine exam", "-", "not started", first]]
    assert ran == []
    # 02-01 done, 02-03 begun: two compositions, each labelled, each run once, then cached.
    rest = ", ".join(i for i in cpu_labs if i not in ("02-01", "02-03"))
    rows = [["Engine exam, as graded", f"0/{n}", "in progress",
             f"unwritten labs run as published: {rest}"],
            ["Engine exam, reference for unfinished labs", f"{n}/{n}", "in progress",
             "passes with 02-01 yours; finish the other engine labs"]]
    assert dashboard(done=["02-01"], started=["02-03"]) == rows
    assert ran == [cpu_labs, ["02-01"]]
    assert dashboard(done=["02-01"], started=["02-03"]) == rows and len(ran) == 2
    # Begun but none done: the graded exam still runs (the grader runs it on written labs).
    assert dashboard(started=["02-03"]) == [
        ["Engine exam, as graded", f"0/{n}", "in progress",
         f"unwritten labs run as published: 02-01, {rest}"],
        ["Engine exam, reference for unfinished labs", "-", "not started", first]]
    assert ran[-1] == cpu_labs and len(ran) == 3
    # Every engine lab done: the two are one composition, one run, one row.
    assert dashboard(done=cpu_labs) == [["Engine exam, as graded (all yours)", f"{n}/{n}", "done",
                                         "`python -m course engine`: your engine generates"]]
    assert ran[-1] == cpu_labs and len(ran) == 4


def test_workers_of_another_tree_run_side_by_side_in_threads(tmp_path):
    """`course check` runs exam jobs of several trees (planted bugs, stand-ins) in threads. A
    worker started in another tree is a Popen; the subprocess module reaps dropped Popen
    children whenever any thread starts a process, so such a worker must be waited for through
    its object (a waitpid on its pid failed with ECHILD in CI)."""
    import threading

    from course.engine.command import run_workers

    worker = tmp_path / "tree" / "course" / "engine" / "worker.py"
    worker.parent.mkdir(parents=True)
    for package in (worker.parent, worker.parent.parent):
        (package / "__init__.py").write_text("")
    worker.write_text(
        "import json, os, sys, time\n"
        "spec = json.loads(sys.argv[1])\n"
        "time.sleep(spec['sleep'])\n"
        "os.fdopen(spec['out_fd'], 'w').write(json.dumps({'type': 'done'}) + '\\n')\n"
    )
    stop = threading.Event()

    def another_thread_starting_processes():
        while not stop.is_set():
            subprocess.run(["true"], check=True)

    spawner = threading.Thread(target=another_thread_starting_processes)
    spawner.start()
    try:
        results = [run_workers([{"sleep": 0.2}], 60, tmp_path / "tree")[0] for _ in range(3)]
    finally:
        stop.set()
        spawner.join()
    assert [(r.exit_code, r.error) for r in results] == [(0, None)] * 3


def test_the_bugs_the_exam_rejects_are_pinned_and_one_it_stops_rejecting_fails_the_check(
        tmp_path, monkeypatch):
    """`course check` compares the exam's verdicts with the two lists in planted_bugs/: a bug
    exam_rejected.txt lists that the exam lets through is a violation (an engine change bypassing
    a student's piece did that once); a bug in neither list, or rejected by another case than
    the one recorded, is a note; bugs exam_not_rejected.txt lists are not run again."""
    from course.integrity import exam_check
    from course.integrity.bugs import PlantedBug
    from course.integrity.exam_check import (
        EXAM_NOT_REJECTED,
        EXAM_REJECTED,
        ExamBugResult,
        bugs_to_run,
        compare_with_expected,
        engine_bugs,
        load_bug_list,
        write_exam_lists,
    )

    rejected, let_through = load_bug_list(EXAM_REJECTED), load_bug_list(EXAM_NOT_REJECTED)
    every = {(lab, bug.name) for lab, bug in engine_bugs()}
    assert rejected and set(rejected) <= every and set(let_through) <= every
    assert not set(rejected) & set(let_through)
    assert all(rejected.values()), "every rejected bug records the case that rejected it"
    run = {(lab, bug.name) for lab, bug in bugs_to_run()}
    assert run == every - set(let_through)
    assert {(lab, bug.name) for lab, bug in bugs_to_run(every_bug=True)} == every

    def result(lab: str, name: str, status: str, case: str = "") -> ExamBugResult:
        return ExamBugResult(lab, PlantedBug(name, "", "x.py", "a", "b"), status, case=case)

    results = [result("02-04", "kept", "rejected", "block-size-1"),
               result("02-04", "lost", "not rejected"),
               result("03-01", "new", "rejected", "sweep-001"),
               result("03-01", "moved", "rejected", "sweep-002"),
               result("03-02", "new-pass", "not rejected")]
    listed = {("02-04", "kept"): "block-size-1", ("02-04", "lost"): "beam-search",
              ("03-01", "moved"): "sweep-001", ("03-02", "not-run"): "sweep-003"}
    problems, notes = compare_with_expected(results, listed, {})
    assert len(problems) == 1 and "'lost' of lab 02-04 is no longer rejected" in problems[0]
    assert sorted(n.split("'")[1] for n in notes if "'" in n) == ["new", "new-pass"]
    assert any("1 planted bug(s) were rejected by another case" in n for n in notes)
    assert all("--write-exam-lists" in n for n in notes)

    # Writing keeps the header and the bugs that did not run, and moves a bug across.
    monkeypatch.setattr(exam_check, "EXAM_REJECTED", tmp_path / EXAM_REJECTED.name)
    monkeypatch.setattr(exam_check, "EXAM_NOT_REJECTED", tmp_path / EXAM_NOT_REJECTED.name)
    (tmp_path / EXAM_REJECTED.name).write_text("# head\n02-04 kept block-size-1\n03-02 other c\n")
    (tmp_path / EXAM_NOT_REJECTED.name).write_text("# head 2\n03-01 new\n")
    write_exam_lists([result("03-01", "new", "rejected", "sweep-001")])
    assert (tmp_path / EXAM_REJECTED.name).read_text().startswith("# head\n")
    assert load_bug_list(tmp_path / EXAM_REJECTED.name) == {
        ("02-04", "kept"): "block-size-1", ("03-02", "other"): "c", ("03-01", "new"): "sweep-001"}
    assert load_bug_list(tmp_path / EXAM_NOT_REJECTED.name) == {}
    malformed = tmp_path / "list.txt"
    malformed.write_text("# a comment\n02-04\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list.txt:2"):
        load_bug_list(malformed)


def test_the_case_that_rejected_a_bug_last_time_runs_first_and_the_rest_keep_their_order():
    """`course check` passes a bug's recorded case as the job's `first`: it must lead, and the
    other cases keep the exam's order (a later failure is still found)."""
    from course.engine.exam import GRADED_SWEEP, cases
    from course.engine.worker import _select_cases

    names = [c.name for c in cases(GRADED_SWEEP)]
    job = {"sweep": GRADED_SWEEP, "cases": names, "first": names[5]}
    assert [c.name for c in _select_cases(job)] == [names[5], *names[:5], *names[6:]]
    assert [c.name for c in _select_cases({**job, "first": ""})] == names


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(root: Path, labs: str, cache: Path) -> tuple[subprocess.Popen, str, str]:
    """`course engine --serve --labs LABS` started as a student starts it; returns the process,
    its base URL and what it printed up to the moment it listens."""
    import httpx

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(root), XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1")
    env.pop("LAB_IMPL", None)
    proc = subprocess.Popen([sys.executable, "-m", "course", "engine", "--serve", "--labs", labs,
                             "--port", str(port)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base, seen = f"http://127.0.0.1:{port}", []
    for line in proc.stdout:  # the banner, then uvicorn's start-up lines
        seen.append(line)
        if "Uvicorn running" in line or "Application startup complete" in line:
            break
    else:
        pytest.fail("the server never started:\n" + "".join(seen))
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
    return proc, base, "".join(seen)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGINT)  # Ctrl-C, as a student stops it
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_your_engine_served_answers_the_official_client_as_the_reference_does(tmp_path):
    """`course engine --serve`: the student's pieces behind the real server, named at start-up;
    the official client gets the reference engine's greedy tokens. Then the same server with a
    mistake planted in the student's allocator fails the request: the pieces really are theirs."""
    import openai

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    root = _course_copy(tmp_path, labs=("02-01", "02-03"))
    prompt = "ROMEO.\nBut soft, what light"
    want = LLM().generate(prompt, SamplingParams(temperature=0.0, max_tokens=12),
                          use_tqdm=False)[0].outputs[0].text
    proc, base, banner = _serve(root, "02-01,02-03", tmp_path / "cache")
    try:
        assert "pieces of 2 lab(s) yours (02-01, 02-03)" in banner, banner
        assert "02-01  yours" in banner and "03-01  reference (not in --labs)" in banner, banner
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                        temperature=0.0)
        assert got.choices[0].text == want
    finally:
        _stop(proc)

    docstring_end = "ValueError naming both numbers, no change.\"\"\"\n"
    _plant(root / LABS["02-01"].rel / "starter.py", [(
        docstring_end, docstring_end + "        raise RuntimeError('planted in the allocator')\n")])
    proc, base, _ = _serve(root, "02-01,02-03", tmp_path / "cache")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError):
            client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                      max_tokens=4, temperature=0.0)
    finally:
        _stop(proc)


# Appended to the honest student's 03-01 starter: an engine process that forges. On import it
# writes counterfeit results ("passed" records of every case, and a whole passing report) to
# every descriptor it holds but its socket and to every descriptor of the worker that judges it
# (through /proc), from a thread and from a daemon that outlives it; then its answers lie: every
# generate and beam search "finishes" at once, with "passed" in every field it can reach, and
# the finish reason carries what it saw of the descriptors, for the test to read.
FORGER = r'''

import json as _json
import os as _os
import stat as _stat
import threading as _threading
import time as _time


def _counterfeit():
    from course.engine.exam import cases

    names = [c.name for c in cases()]
    records = "".join(_json.dumps({"type": "case", "case": n, "outcome": "passed", "message": "",
                                   "seconds": 0.0, "detail": []}) + "\n" for n in names)
    report = {"type": "exam", "cases": [{"case": n, "outcome": "passed"} for n in names]}
    return (records + _json.dumps(report) + "\n").encode()


def _write_everywhere(data):
    seen = []
    for pid in ("self", str(_os.getppid())):
        try:
            fds = sorted(_os.listdir(f"/proc/{pid}/fd"), key=int)
        except OSError as exc:
            seen.append(f"{pid}={type(exc).__name__}")
            continue
        held = []
        for fd in fds:
            try:
                held.append(f"{fd}:{_os.readlink(f'/proc/{pid}/fd/{fd}').split('[')[0]}")
            except OSError:  # the descriptor listdir read the folder with
                pass
        seen.append(f"{pid}=" + ",".join(held))
        for fd in fds:
            try:
                if pid != "self":
                    with open(f"/proc/{pid}/fd/{fd}", "wb") as f:
                        f.write(data)
                elif not _stat.S_ISSOCK(_os.fstat(int(fd)).st_mode):
                    _os.write(int(fd), data)
            except OSError:
                pass
    return " ".join(seen)


_DATA = _counterfeit()
_SEEN = _write_everywhere(_DATA)


def _keep_writing():
    for _ in range(3000):
        _write_everywhere(_DATA)
        _time.sleep(0.01)


_threading.Thread(target=_keep_writing, daemon=True).start()
if _os.fork() == 0:  # a daemon in a session of its own, that outlives the engine process
    _os.setsid()
    try:
        _keep_writing()
    finally:
        _os._exit(0)

import course.engine.engine_side as _side  # noqa: E402


def _lying_generate(self, engine, prompts, params):
    import dataclasses

    from mini_vllm.metrics.stats import EngineStats

    stats = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    stats.update(prefix_cache_hits=10 ** 6, num_steps=10 ** 6, num_prompt_tokens=1)
    return {"outputs": [{"completions": [{"token_ids": [], "finish_reason": "passed " + _SEEN}]
                         * p["n"], "num_cached_tokens": 10 ** 6, "outcome": "passed"}
                        for p in params],
            "stats": stats, "steps": [], "cpu_blocks_held": 0, "outcome": "passed"}


def _lying_beams(self, engine, prompts, beam_width, max_tokens):
    return {"sequences": [[[list(p), 0.0]] * beam_width for p in prompts], "blocks_in_use": 0,
            "prefix_cache_hits": 1, "outcome": "passed"}


_side.Engines.generate = _lying_generate
_side.Engines.beam_search = _lying_beams
'''

FORGED_CASES = ("prefix-odd-lengths", "beam-search")


def _exam_in_the_sandbox(starter: bytes) -> tuple:
    """The engine exam of FORGED_CASES as the grader runs it (CommandUnit, in the sandbox, the
    results read from its channel), with ``starter`` as lab 03-01's starter and every other lab
    the reference."""
    import tempfile
    import types

    from course.grading import sandbox
    from course.grading.grader import CommandUnit, RunContext, Submission

    staging = Path(tempfile.mkdtemp(prefix="course-exam-forgery-"))
    try:
        staging.chmod(0o711)
        (staging / "work").mkdir(mode=0o711)
        snapshot = staging / "course"
        shutil.copytree(REPO_ROOT, snapshot, ignore=copy_ignore)
        ctx = RunContext(types.SimpleNamespace(snapshot=snapshot), sandbox.probe(),
                         staging / "work", [], lab_timeout=300)
        argv = ["{python}", "-m", "course", "engine", "--exam", "--impl", "{impl}", "--labs",
                "03-01", "--bisect", "none", "--channel", "{channel}"]
        for case in FORGED_CASES:
            argv += ["--case", case]
        unit = CommandUnit("engine-exam", "The engine exam", 2, argv, list(FORGED_CASES))
        rel = f"{LABS['03-01'].rel}/starter.py"
        return unit.run(ctx, Submission("s", staging, files={rel: starter})), ctx.iso
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def test_an_engine_process_that_forges_its_results_earns_nothing():
    """The exam's verdicts are decided in the worker, from data: counterfeit records and reports
    written to every descriptor the engine process holds or can find (its own, the worker's
    through /proc), from a thread and an outliving daemon, and answers that claim "passed"
    everywhere but compute nothing, earn 0 as the grader runs the exam. The honest starter
    passes the same cases there (so the forger's zero is its own doing)."""
    honest = (FIXTURE / LABS["03-01"].rel / "starter.py").read_bytes()
    result, iso = _exam_in_the_sandbox(honest)
    assert [(t.id, t.outcome) for t in result.tests] == [(c, "passed") for c in FORGED_CASES], (
        [(t.id, t.outcome, t.message) for t in result.tests], result.log)

    result, iso = _exam_in_the_sandbox(honest + FORGER.encode())
    assert result.points("cpu") == 0.0
    outcomes = {t.id: (t.outcome, t.message) for t in result.tests}
    assert set(outcomes) == set(FORGED_CASES)
    assert all(outcome == "failed" and message for outcome, message in outcomes.values()), (
        outcomes, result.log)
    # What the forger saw: its own descriptors are 0, 1, 2 and its socket; the worker's are out
    # of reach where the sandbox runs student code as another user with no capabilities.
    seen = outcomes["prefix-odd-lengths"][1]
    own = re.search(r"self=(\S+)", seen)
    assert own, seen
    held = dict(pair.split(":", 1) for pair in own.group(1).split(","))
    assert sorted(int(fd) for fd in held if held[fd] != "socket:") == [0, 1, 2], seen
    assert list(held.values()).count("socket:") == 1, seen
    if iso.level == "namespaces+nobody":
        assert re.search(r"\d+=PermissionError", seen), seen


def test_the_exam_judges_only_answers_it_can_read_and_that_hold():
    """The exam's side of the channel, with the reference engine's answers changed on the way as
    a hostile engine process could change them: ids that are not ints (true, 3.0), a missing
    output, no steps against the reference's, an error named "timeout": each fails or errs
    with a reason, never passes; only the answer that says so is a timeout."""
    from course.engine.engine_side import EngineProcess
    from course.engine.exam import Exam, cases, run_case

    case = next(c for c in cases() if c.name == "prefix-odd-lengths")
    engine = EngineProcess([])  # the reference engine's
    request = engine.call
    exam = Exam(engine)
    try:
        assert run_case(case, exam, 60).outcome == "passed"
    except BaseException:
        engine.stop()
        raise
    reference = {case.name: exam.recorded}

    class Changed:
        """The reference engine, its generate answers passed through ``change``."""

        def __init__(self, change):
            self.change = change

        def call(self, op, args, seconds):
            answer = request(op, args, seconds)
            return self.change(answer) if op == "generate" else answer

    def ids(value):
        def change(answer):
            for out in answer["ok"]["outputs"]:
                for c in out["completions"]:
                    c["token_ids"] = [value(t) for t in c["token_ids"]]
            return answer
        return change

    def fewer(answer):
        answer["ok"]["outputs"].pop()
        return answer

    def no_steps(answer):
        answer["ok"]["steps"] = []
        return answer

    changes = [("bools", ids(lambda t: True)), ("floats", ids(float)),
               ("fewer", fewer), ("no steps", no_steps),
               ("timeout", lambda a: {"timeout": True, "steps": []}),
               ("named timeout", lambda a: {"error": {"type": "timeout",
                                                      "message": "", "where": ""}})]
    outcomes = {}
    try:
        for name, change in changes:
            result = run_case(case, Exam(Changed(change), reference), 60)
            outcomes[name] = (result.outcome, result.message)
    finally:
        engine.stop()
    assert {k: v[0] for k, v in outcomes.items()} == {
        "bools": "failed", "floats": "failed", "fewer": "failed", "no steps": "failed",
        "timeout": "timeout", "named timeout": "error"}, outcomes
    assert "could not be read" in outcomes["bools"][1] and "could not" in outcomes["floats"][1]
    assert "0 outputs for 1 prompts" in outcomes["fewer"][1], outcomes["fewer"]
    assert "differ" in outcomes["no steps"][1], outcomes["no steps"]
