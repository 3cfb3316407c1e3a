"""Tests of what a test run prints (course/labs/feedback.py), the task list, hints and measure."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from course.labs.catalog import REPO_ROOT, discover, select
from course.labs.feedback import choose_threads, default_cache_dir, tensor_summary
from course.labs.tasks import open_tasks, readme_section, tasks_in_source
from course.student.hints import check_hints, render_hint

LAB = "phase-09-demo/labs/lab-01-feedback"

STARTER = '''
__all__ = ["double", "halve", "Box"]


def double(x):
    raise NotImplementedError("lab 09-01, task 1: implement double")


def halve(x):
    raise NotImplementedError(
        "lab 09-01, task 3: implement halve (hint: python -m course hint 09-01 3)"
    )


class Box:
    def __init__(self):
        self.items = []

    def put(self, x):
        raise NotImplementedError("lab 09-01, task 2: implement Box.put")
'''

SOLUTION = '''
__all__ = ["double", "halve", "Box"]


def double(x):
    return x * 3  # a bug every case of the grid below trips over


def halve(x):
    return x / 2


class Box:
    def __init__(self):
        self.items = []

    def put(self, x):
        self.items.append(x)
'''

TESTS = '''
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from course.labs.loader import load_lab

lab = load_lab(__file__)


@pytest.mark.parametrize("x", range(30))
def test_double(x):
    assert lab.double(x) == 2 * x


def test_tensors():
    a = torch.arange(4000.0).reshape(40, 100)
    assert torch.equal(a * lab.double(1), a * 2)


class BoxMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.box = lab.Box()

    @rule(x=st.integers())
    def put(self, x):
        self.box.put(x)


TestBoxMachine = BoxMachine.TestCase
'''

README = """# Lab 09-01: Feedback

## Tasks

1. `double`.
2. `Box.put`.
3. `halve`.
"""


@pytest.fixture
def course(course_skeleton) -> Path:
    root = course_skeleton(pytest_cache=True)
    lab = root / LAB
    lab.mkdir(parents=True)
    for name, text in {
        "starter.py": STARTER,
        "solution.py": SOLUTION,
        "test_lab.py": TESTS,
        "README.md": README,
    }.items():
        (lab / name).write_text(textwrap.dedent(text))
    return root


def pytest_run(root: Path, impl: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), LAB_IMPL=impl)
    for var in ("HYPOTHESIS_PROFILE", "OMP_NUM_THREADS"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", LAB, "-q", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_starter_run_is_one_line_per_test_then_the_task_list(course):
    proc = pytest_run(course, "starter")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "Traceback" not in out and "Falsifying" not in out
    assert re.search(r"test_double \[30 cases\] +lab 09-01, task 1: implement double", out)
    assert re.search(r"TestBoxMachine::runTest +lab 09-01, task 2: implement Box.put", out)
    closing = re.search(r"\d+ not implemented in", out)
    assert closing, out
    tail = out[closing.start() :]
    # All three tasks, in order, also task 3 that no test reached; next first.
    assert "lab 09-01: 3 tasks to do, next first" in tail
    lines = [line for line in tail.splitlines() if "(starter.py:" in line]
    assert [line.split("task ")[1].split()[0] for line in lines] == ["1", "2", "3"]
    assert lines[0].startswith("next") and "halve" in lines[2] and "README.md:7" in lines[2]
    assert "stuck? python -m course hint 09-01 1" in tail
    assert len(out.splitlines()) < 20
    # The cache is outside the repository, so --lf works.
    assert not (course / ".pytest_cache").exists()
    again = pytest_run(course, "starter", "--lf")
    assert "not implemented" in again.stdout and "passed" not in again.stdout


def test_a_failure_repeated_over_a_grid_is_rendered_once(course):
    proc = pytest_run(course, "solution")
    out = proc.stdout
    assert proc.returncode == 1
    assert out.count("def test_double") == 1  # one full report
    # x=0 passes (0 * 3 == 0): the first failing case is x=1, 28 others fail the same way.
    assert "the same failure in 28 other cases of test_double" in out
    assert "[2] [3] [4]" in out and "... and 4 more" in out  # the ids of the others (24 shown)
    assert "30 failed" in out and len(out.splitlines()) < 150
    # Tensors are summarised, not printed.
    out = pytest_run(course, "solution", "-k", "tensors").stdout
    assert "tensor(shape=(40, 100), dtype=float32" in out, out
    every = pytest_run(course, "solution", "--every-failure")
    assert every.stdout.count("def test_double") == 29


KERNEL_TOOLS = '''
class EmulationError(RuntimeError):
    pass


def run_kernel(message):
    return _driver(message)


def _driver(message):
    raise EmulationError(message + "\\n--- more detail ---")
'''

KERNEL_TESTS = '''

import mini_vllm.csrc.fake_emulator as emu

SEGFAULT = "v1: segmentation fault at starter.cu:{}, block (0,{},0), thread 32 (kernel k<{}, 128>)"


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", ["float", "__half", "__nv_bfloat16"])
def test_plain(dtype):
    emu.run_kernel(SEGFAULT.format(113, len(dtype), dtype))


@pytest.mark.emulation
def test_plain_elsewhere():
    emu.run_kernel(SEGFAULT.format(120, 0, "float"))


@pytest.mark.asan
@pytest.mark.emulation
def test_asan():
    emu.run_kernel("v1: out-of-bounds read of block_tables at starter.cu:113, block (0,4,0)")
'''


def add_kernel_tests(course: Path) -> None:
    """Tests that fail with an error of a stand-in for mini_vllm.csrc's kernel tools."""
    package = course / "mini_vllm" / "csrc"
    package.mkdir(parents=True)
    (course / "mini_vllm" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "fake_emulator.py").write_text(KERNEL_TOOLS)
    tests = course / LAB / "test_lab.py"
    tests.write_text(tests.read_text() + KERNEL_TESTS)


def test_a_crash_in_the_lab_code_reached_from_several_tests_is_rendered_once(course):
    """Also (one run for both): a kernel error (raised by mini_vllm.csrc) is reported with its
    first line first and the tools' frames hidden; its cases fold only within one tier and with
    messages that differ by values alone, so the sanitizer's precise read is never listed under
    the plain emulation's segfault, nor a segfault at another line."""
    tests = course / LAB / "test_lab.py"
    tests.write_text(
        tests.read_text()
        + textwrap.dedent(
            """

            @pytest.mark.parametrize("x", ["a", "b"])
            def test_halve_text(x):
                assert lab.halve(x) == x


            def test_halve_text_again():
                assert lab.halve("c") == "c"
            """
        )
    )
    add_kernel_tests(course)
    out = pytest_run(course, "solution", "-k", "halve or plain or asan").stdout
    # One TypeError at the same line of solution.py, reached from two tests: one report.
    assert out.count("def test_halve_text") == 1, out
    assert "the same failure in 2 other cases (2 tests)" in out
    assert "test_halve_text[b]" in out and "test_halve_text_again" in out
    assert "8 failed" in out
    reports = re.split(r"(?m)^_{3,} (test_\S+) _{3,}$", out)[1:]
    firsts = {name: body.strip().splitlines()[0] for name, body in zip(reports[::2], reports[1::2])
              if not name.startswith("test_halve")}
    assert firsts == {
        "test_plain[float]": "EmulationError: v1: segmentation fault at starter.cu:113, "
        "block (0,5,0), thread 32 (kernel k<float, 128>)",
        "test_plain_elsewhere": "EmulationError: v1: segmentation fault at starter.cu:120, "
        "block (0,0,0), thread 32 (kernel k<float, 128>)",
        "test_asan": "EmulationError: v1: out-of-bounds read of block_tables at starter.cu:113, "
        "block (0,4,0)",
    }, out
    assert "the same failure in every other case of test_plain (2)" in out, out
    assert "_driver" not in out, out
    # Rendered in full (the run's first failure), the kernel error hides the tools' frames.
    out = pytest_run(course, "solution", "-k", "asan").stdout
    assert "_driver" not in out and "--emulator-traceback shows them" in out, out


def test_emulator_traceback_shows_the_kernel_tools_frames(course):
    add_kernel_tests(course)
    full = pytest_run(course, "solution", "-k", "asan", "--emulator-traceback").stdout
    assert "def _driver" in full and "--emulator-traceback shows them" not in full, full


def test_a_measurement_may_return_several_named_values():
    from course.student.measure import Series, _split_named

    mine = Series("yours", {1: {"v1": 1.0, "v2": None}, 2: {"v1": 2.0, "v2": None}})
    plain = Series("deque", {1: 5.0, 2: 6.0})
    out = _split_named([mine, plain])
    assert [s.name for s in out] == ["yours: v1", "yours: v2", "deque"]
    assert out[0].values == {1: 1.0, 2: 2.0} and out[0].note == ""
    assert out[1].values == {1: None, 2: None} and out[1].note == "not written yet"
    assert out[2] is plain


def test_a_shrink_cut_short_by_the_student_limit_says_so_instead_of_please_report(monkeypatch):
    """The student profile bounds shrinking; Hypothesis's warning for its own five minutes
    ("PLEASE REPORT THIS") becomes one true line, and every other message passes unchanged."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis.internal.conjecture import engine
    from hypothesis.reporting import with_reporter

    from course.labs import feedback

    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", engine.MAX_SHRINKING_SECONDS)
    monkeypatch.setattr(engine, "report", engine.report)  # both restored after the test
    feedback._bound_shrinking(0)  # any shrink is over the limit at once

    @settings(database=None, derandomize=True, max_examples=50,
              phases=[Phase.generate, Phase.shrink])
    @given(st.lists(st.integers(), min_size=8))
    def big_lists_fail(xs):
        assert sum(abs(x) for x in xs) < 10

    printed: list[str] = []
    with with_reporter(printed.append), pytest.raises(AssertionError):
        big_lists_fail()
    text = "\n".join(map(str, printed))
    assert "PLEASE REPORT" not in text and "five minutes" not in text, text
    assert "stopped simplifying the failing example after 0 s" in text, text
    with with_reporter(printed.append):
        engine.report("Falsifying example: big_lists_fail(xs=[...])")
    assert printed[-1] == "Falsifying example: big_lists_fail(xs=[...])"


def test_threads_are_half_the_cores_between_1_and_4():
    assert [choose_threads(n) for n in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4, 4]


def test_the_cache_is_in_the_temporary_folder_one_per_checkout(tmp_path):
    assert REPO_ROOT not in default_cache_dir().parents
    assert default_cache_dir(tmp_path / "a") != default_cache_dir(tmp_path / "b")


def test_tensor_summary_is_one_line():
    torch = pytest.importorskip("torch")
    text = tensor_summary(torch.arange(10_000, dtype=torch.float16).reshape(100, 100))
    assert text.startswith("tensor(shape=(100, 100), dtype=float16, first=[0, 1, 2")
    assert "\n" not in text and text.endswith(", ...])")


def test_tasks_are_read_from_the_source_including_unreached_ones():
    tasks = tasks_in_source(textwrap.dedent(STARTER), "09-01")
    assert [(t.number, t.names) for t in tasks] == [(1, "double"), (2, "Box.put"), (3, "halve")]
    assert tasks[2].what == "implement halve"  # the hint suffix is not part of the task


def test_every_task_of_lab_02_01_has_all_four_hint_levels():
    (lab,) = select(discover(), ["02-01"])
    assert check_hints(lab) == []
    assert [t.number for t in open_tasks(lab)] == list(range(1, 12))
    assert readme_section(lab, 8) is not None
    example = render_hint(lab, 3, 2)  # the second rung is a case to trace, not the steps
    assert "hint 2 of 4: a worked example" in example and "Before:" in example
    assert "head <-> 1 <-> 3 <-> tail" in example  # a trace table keeps its layout
    assert "--level 3 (the idea, and the tests that check it)" in example
    text = render_hint(lab, 3, 4)
    assert "vllm/v1/core/kv_cache_utils.py:334 @ v0.11.0" in text
    assert "def remove(self, block: KVCacheBlock)" in text
    with pytest.raises(ValueError, match="no task 12"):
        render_hint(lab, 12, 1)


def test_the_hint_check_requires_a_worked_example_with_its_state_before_and_after(
        tmp_path, monkeypatch):
    import course.student.hints as hints

    (lab,) = select(discover(), ["02-02"])
    text = hints.hints_path(lab).read_text(encoding="utf-8")
    start = text.index('example = """', text.index("[task.2]"))
    text = text[:start] + text[text.index('"""', start + 13) + 3:]  # task 2: no example
    text = text.replace("After: (300, 200, 200)", "Then: (300, 200, 200)")  # task 3: no after
    (tmp_path / "hints.toml").write_text(text, encoding="utf-8")
    monkeypatch.setattr(hints, "hints_path", lambda _lab: tmp_path / "hints.toml")
    assert hints.check_hints(lab) == [
        "hints.toml: task 2 has no level 2 (a worked example to trace by hand)",
        "hints.toml: task 3: the example (level 2) must show the state before and after "
        "(say both words)",
    ]


def test_the_hint_check_flags_a_rung_that_gives_the_answer(tmp_path, monkeypatch):
    """The last rung is the idea and a command, never the body: an idea that restates the
    reference's body (here, lab 03-05's old steps, the body nearly line for line), an idea
    written as numbered steps and a test the lab does not have are each flagged; the rung as
    written renders a pytest command that runs just its tests."""
    import course.student.hints as hints

    (lab,) = select(discover(), ["03-05"])
    assert hints.check_hints(lab) == []
    level3 = hints.render_hint(lab, 2, 3)
    assert "hint 3 of 4: the idea, and the tests that check it" in level3
    assert ("LAB_IMPL=starter python -m pytest phase-03-scheduler/labs/lab-05-server -q -k "
            "'test_stream_equals_generate_token_for_token or ") in level3
    text = hints.hints_path(lab).read_text(encoding="utf-8")
    start = text.index('idea = """', text.index("[task.2]"))
    end = text.index('"""', start + 10) + 3
    old_steps = """idea = \"\"\"
1. request_id = request_id or a fresh id; self._run_output_handler().
2. collector = self.add_request(request_id, prompt, sampling_params) (bad input raises here).
3. finished = False; try: while not finished: out = collector.get_nowait() or
   await collector.get(); finished = out.finished; yield out.
4. finally: if not finished: self.abort(request_id).
\"\"\""""
    text = text[:start] + old_steps + text[end:]
    text = text.replace('"test_choices_usage_and_token_ids"', '"test_usage_is_right"')
    (tmp_path / "hints.toml").write_text(text, encoding="utf-8")
    monkeypatch.setattr(hints, "hints_path", lambda _lab: tmp_path / "hints.toml")
    problems = hints.check_hints(lab)
    assert problems[0] == ("hints.toml: task 2: the idea (level 3) is numbered steps; say the "
                           "idea and let the tests show the way")
    assert problems[1].startswith("hints.toml: task 2: its idea restates ")
    assert problems[1].endswith("% of the reference's body; give the idea, not the code")
    assert problems[2:] == ["hints.toml: task 3: test_lab.py has no test test_usage_is_right"]


def test_hint_and_measure_commands():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    hint = subprocess.run(
        [sys.executable, "-m", "course", "hint", "02-01", "8", "--level", "2"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert hint.returncode == 0 and "hint 2 of 4: a worked example" in hint.stdout
    assert "--level 3" in hint.stdout
    measure = subprocess.run(
        [sys.executable, "-m", "course", "measure", "02-01", "--quick"],
        cwd=REPO_ROOT,
        env=dict(env, LAB_IMPL="starter"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert measure.returncode == 0, measure.stderr
    out = measure.stdout
    assert "Predict, then measure" in out and "reference" in out and "deque.remove" in out
    assert "not written yet: lab 02-01, task 3" in out  # the untouched starter


@pytest.mark.nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the machine without a GPU")
def test_measuring_the_cuda_lab_without_a_gpu_gives_the_static_report(capsys):
    """Without a GPU, `course measure 02-06` answers from the compiled SASS: the questions
    first, then the reference's kernels with their numbers and the untouched starter's as not
    written; exit 0; nothing of the README's FP8 subsection. (In this process: the command
    itself is cmd_measure -> measure.command; the compiles are the cost.)"""
    from course.student.measure import command

    (lab,) = select(discover(), ["02-06"])
    code = command(lab, arch="T4")
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.index("4. Your naive kernel") < out.index("STATIC report for T4 (sm_75)")
    rows = {tuple(line.split()[:2]): line for line in out.splitlines()
            if line.split()[:1] in (["naive"], ["v1"], ["v2"])}
    assert "not written yet (LAB_TASK_0_DONE is 0)" in rows["naive", "yours"]
    assert "16-bit" in rows["naive", "reference"] and "128-bit" not in rows["naive", "reference"]
    assert "128-bit" in rows["v1", "reference"]
    assert "What these predict" in out and "FP8" not in out and "```" not in out


def test_the_static_report_predicts_from_load_width_spills_and_instructions():
    """A student's v1 with 32-bit loads, spills and twice the instructions per KV block gets
    one sentence for each, against the reference's 128-bit loads (no compiler needed)."""
    from course.labs.loader import load_script

    m = load_script("lab0206_measure", REPO_ROOT / "phase-02-paged-attention" / "labs"
                    / "lab-06-cuda-kernel" / "measure.py")
    ref = {"loads": {128: 8, 32: 3}, "spill_stores": 0, "spill_loads": 0, "per_kv_block": 400}
    mine = {"loads": {32: 40}, "spill_stores": 8, "spill_loads": 8, "per_kv_block": 900}
    rows = {(k, who): "not written yet" for k, *_ in m.KERNELS for who in ("yours", "reference")}
    rows["v1", "yours"], rows["v1", "reference"] = mine, ref
    text = "\n".join(m._predictions(rows, sms=132))
    assert "v1: your widest global load is 32 bits, the reference's 128: 4x" in text
    assert "v1: yours spills registers" in text
    assert "v1: 900 instructions per KV block against 400" in text
    assert "64 of the 132 SMs" in text and "from 1,536 tokens on" in text


def test_the_predict_section_prints_no_answer_before_the_run():
    """01-03's README gives the reference's 11.7% after its command block: the questions stop
    at the block, and that text comes after the table."""
    from course.student.measure import predict_questions

    (lab,) = select(discover(), ["01-03"])
    predict = predict_questions(lab)
    assert "1. With `max_seq_len = 4096`" in predict.questions
    assert "11.7%" not in predict.questions and "11.7%" in predict.after
    assert "python -m course measure" not in predict.questions


def test_course_check_wants_questions_then_the_measure_command_in_a_block(tmp_path):
    from course.labs.catalog import Lab
    from course.student.measure import check_predict

    folder = tmp_path / "phase-09-demo" / "labs" / "lab-01-demo"
    folder.mkdir(parents=True)
    (folder / "measure.py").write_text("")
    lab = Lab(folder)
    good = ("# Lab 09-01: Demo\n\n## Predict, then measure\n\n1. How fast?\n\n"
            "```\npython -m course measure 09-01 --plot x.png\n```\n\nThe answer: 3.\n")
    (folder / "README.md").write_text(good)
    assert check_predict(lab) == []
    (folder / "README.md").write_text(good.replace("```\npython -m course measure 09-01 "
                                                   "--plot x.png\n```\n\n", ""))
    assert ["the Predict section must give `python -m course measure 09-01`" in p
            for p in check_predict(lab)] == [True]


def test_a_log_log_measurement_prints_each_series_fitted_slope():
    import types

    from course.student.measure import Series, fitted_slope, format_table

    noisy = {128: 1.0, 256: 4.4, 512: 15.0, 1024: 66.0}  # about n^2, one point disturbed
    assert 1.9 < fitted_slope(noisy) < 2.1
    assert fitted_slope({128: 1.0, 256: None}) is None
    module = types.SimpleNamespace(TITLE="t", X_LABEL="n", Y_LABEL="ms", LOG_X=True,
                                   LOG_Y=True)
    table = format_table(module, [Series("reference", noisy), Series("yours", {128: None})])
    assert "reference: slope 1.99 (doubling x multiplies y by 4.0)" in table
    assert "yours: slope" not in table


def test_measure_with_several_metrics_gets_a_table_and_a_panel_each(tmp_path):
    """A measurement with METRICS: `run` returns one value per metric (None: nothing to show);
    each metric gets its own table and plot panel, and an unwritten starter shows "-"."""
    import types

    from course.student.measure import Series, format_table, panels, plot

    module = types.SimpleNamespace(
        TITLE="t", X_LABEL="batch", Y_LABEL="y", METRICS={"a": "alpha (ms)", "b": "beta"}
    )
    series = [
        Series("yours (starter.py)", {1: None, 2: None}, "not written yet: lab 99-01, task 1"),
        Series("reference", {1: {"a": 1.5, "b": None}, 2: {"a": 3.0, "b": 7.0}}),
    ]
    groups = panels(module, series)
    assert [label for label, _ in groups] == ["alpha (ms)", "beta"]
    assert groups[1][1][1].values == {1: None, 2: 7.0}
    table = format_table(module, series)
    assert table.index("alpha (ms)") < table.index("beta")
    assert table.count("reference") == 2 and "not written yet: lab 99-01" in table
    path = plot(module, series, tmp_path / "m.png", show=False)
    assert path is not None and path.stat().st_size > 0


def test_a_long_measurement_says_how_long_it_takes_and_shows_the_spread_of_its_rounds(
        tmp_path, capsys):
    """A measurement that defines `seconds(x)` gets its duration printed before it starts
    (and --quick's), a progress line per finished point; with SPREAD each cell is the median of
    the rounds with their range, on the table and as bars on the plot."""
    from course.labs.catalog import Lab
    from course.student.measure import command

    folder = tmp_path / "phase-09-demo" / "labs" / "lab-07-demo"
    folder.mkdir(parents=True)
    (folder / "starter.py").write_text(
        "def f(x):\n    raise NotImplementedError('lab 09-07, task 1: implement f')\n")
    (folder / "solution.py").write_text("calls = []\n\ndef f(x):\n    calls.append(x)\n"
                                        "    return {'a': x * len(calls), 'b': 1.0}\n")
    (folder / "measure.py").write_text(textwrap.dedent("""
        TITLE, X_LABEL, Y_LABEL = "demo", "x", "y"
        ROUNDS, SPREAD = 3, True

        def sizes(quick):
            return [2] if quick else [1, 2]

        def seconds(x):
            return 30 * x

        def run(impl, x):
            return impl.f(x)
    """))
    lab = Lab(folder)
    assert command(lab, plot_path=tmp_path / "demo.png") == 0
    out, err = capsys.readouterr()
    # 3 rounds x 2 implementations x (30 + 60) s; --quick: 3 x 2 x 60 s
    assert out.startswith("This run takes about 9 min on a quiet 2-core machine (longer on a "
                          "busy one); --quick takes about 6 min.\n")
    assert "[12/12] round 3, reference at 2:" in err and "finished in" in err
    # the reference's calls: round 1 gives x*1, x*2; round 2 x*3, x*4; round 3 x*5, x*6
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["1"],
                                                                                       ["2"])}
    assert "3 (1-5)" in rows["1"] and "8 (4-12)" in rows["2"]
    assert "yours (starter.py): not written yet: lab 09-07, task 1" in out
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_lab_03_06_readme_says_what_its_measurement_runs_and_how_long():
    """The README of lab 03-06 gives the measurement's request count, rates, rounds and
    duration as measure.py has them (a student once read 40 requests and rates up to 24 for a
    run that sent 24 requests up to 8 per second, and sat through it with no duration)."""
    from course.student.measure import load_measurement, planned_seconds, predict_questions

    (lab,) = select(discover(), ["03-06"])
    module = load_measurement(lab)
    predict = predict_questions(lab)
    readme = " ".join((lab.path / "README.md").read_text(encoding="utf-8").split())
    section = readme[readme.index("## Predict, then measure"):]
    section = section[:section.index("python -m course measure 03-06")]
    *most, last = module.sizes(False)
    assert f"the measurement's {module.NUM_REQUESTS} requests" in predict.questions
    assert f"sends the {module.NUM_REQUESTS} requests at {', '.join(map(str, most))} and " \
           f"{last} requests per second, twice at each rate" in section
    assert module.ROUNDS == 2 and module.SPREAD
    assert f"about {planned_seconds(module, False) / 60:.0f} minutes" in section
    quick = module.sizes(True)
    assert (f"`--quick` runs {quick[0]} and {quick[1]} only, about "
            f"{planned_seconds(module, True) / 60:.0f} minutes") in section


def test_one_mistake_that_fails_many_tests_is_one_report_and_two_lines_per_other(course):
    """The run's first failure is rendered in full; the next eight in two lines each (the message,
    then the test's rule and the function to open); the rest counted in one line after the
    summary, which lists only the failures shown. Captured output keeps its tail. With
    --every-failure every failure is rendered in full, with all its output."""
    tests = course / LAB / "test_lab.py"
    many = "".join(f"\n\ndef test_many_{i:02d}():\n"
                   f"    assert lab.double({i}) == {2 * i}, f'double({i}) gave {{lab.double({i})}}"
                   "\\nsecond line'\n" for i in range(1, 14))
    tests.write_text(tests.read_text() + textwrap.dedent('''

        def test_many_00():
            import sys
            for i in range(50):
                print(f"server log line {i}", file=sys.stderr)
            assert lab.double(0.5) == 1, "double(0.5) is not 1: double must multiply by two"
        ''') + many)
    out = pytest_run(course, "solution", "-k", "many").stdout
    assert out.count("def test_many_") == 1, out  # only the first is rendered in full
    assert "(the first 35 lines are left out: --every-failure shows them)" in out, out
    assert "server log line 49" in out and "server log line 20" not in out
    assert re.search(r"\nAssertionError: double\(3\) gave 9\n  \(the test: many 03; look at "
                     r"your double \(starter\.py:5\)\)  \[test_lab\.py:\d+\]\n", out), out
    assert "second line" not in out.split("short test summary")[0].split("test_many_01")[-1]
    assert "test_many_08" in out and "test_many_09" not in out  # 1 in full + 8 in two lines
    assert ("... and 5 more failing tests not shown: fix the first failure above, then run "
            "again (--lf reruns only the failures).") in out
    assert "14 failed" in out and len(out.splitlines()) < 80, out
    full = pytest_run(course, "solution", "-k", "many", "--every-failure").stdout
    assert full.count("def test_many_") == 14 and "server log line 20" in full, full


def test_a_first_failure_whose_report_runs_long_is_rendered_again_in_short_style(course):
    """A first failure whose full report runs past MAX_FULL_LINES (a long test function, then
    calls deep into helpers) is rendered again in pytest's short style, a line of source a
    frame; --every-failure keeps the long one."""
    filler = "".join(f"    step_{i} = {i}  # filler of the long test\n" for i in range(40))
    tests = course / LAB / "test_lab.py"
    tests.write_text(
        tests.read_text() + "\n\ndef deep(depth):\n"
        + "    return deep(depth - 1) if depth else bottom()\n\n\ndef bottom():\n"
        + "    assert lab.double(0.5) == 3, 'double(0.5) is not 3, deep in the calls'\n\n\n"
        + "def test_long_failure():\n" + filler + "    deep(6)\n"
    )
    out = pytest_run(course, "solution", "-k", "long_failure").stdout
    assert "1 failed" in out and "double(0.5) is not 3, deep in the calls" in out, out
    assert "filler of the long test" not in out and len(out.splitlines()) < 50, out
    assert out.count("in deep") == 7, out  # every frame still named
    full = pytest_run(course, "solution", "-k", "long_failure", "--every-failure").stdout
    assert full.count("filler of the long test") == 40, full


def test_one_planted_mistake_prints_at_most_120_lines_in_every_lab():
    """benchmarks/results/report_lengths.json (scripts/report_lengths.py, minutes a lab; the
    CUDA lab's, run by name, 40 to 50) holds the lines a student's test command prints for each
    planted bug of every lab; every bug is there and none passes the limit."""
    import json

    from course.integrity.bugs import load_bugs

    spec = importlib.util.spec_from_file_location("report_lengths",
                                                  REPO_ROOT / "scripts" / "report_lengths.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = json.loads((REPO_ROOT / "benchmarks" / "results" / "report_lengths.json").read_text())
    assert record["limit"] == script.LIMIT == 120
    for lab in discover():
        counts = record["labs"].get(lab.id, {}).get("lines", {})
        assert sorted(counts) == sorted(b.name for b in load_bugs(lab)), (
            f"lab {lab.id}: measure it again: python scripts/report_lengths.py {lab.id} --json "
            "benchmarks/results/report_lengths.json")
        over = {name: n for name, n in counts.items() if n > script.LIMIT}
        assert not over, f"lab {lab.id}: reports longer than {script.LIMIT} lines: {over}"


def test_every_assert_a_student_can_fail_says_what_went_wrong(tmp_path):
    """Past a run's first failure a report shows only the message's first line, and a bare
    assert has none: `course check` flags every assert without a message in a lab's tests, and
    no lab has one."""
    from course.integrity.checks import check_test_messages
    from course.labs.catalog import Lab

    lab_dir = tmp_path / "phase-09-demo" / "labs" / "lab-01-demo"
    lab_dir.mkdir(parents=True)
    (lab_dir / "test_lab.py").write_text(
        "def test_a():\n    assert 1 == 1, 'says why'\n    assert 2 == 2\n\n"
        "def test_b():\n    assert True\n")
    assert check_test_messages(Lab(lab_dir)) == [
        "test_lab.py: 2 assert(s) without a message (lines 3, 6); add one that says what was "
        "expected, what came and the likely cause"]
    flagged = {lab.id: check_test_messages(lab) for lab in discover()}
    assert not any(flagged.values()), {k: v for k, v in flagged.items() if v}
