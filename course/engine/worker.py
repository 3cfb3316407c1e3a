"""The worker process of ``python -m course engine``: build engines, run them, report as JSON.

Composition patches the process it runs in (:mod:`course.engine.compose`). The worker imports torch,
mini_vllm and the exam once, and, for each engine it must run (the reference's, the student's
composition, then one lab at a time while bisecting), forks a process that composes it: every
engine gets a clean process without paying for the imports again. For the exam, that process is
an engine process (:mod:`course.engine.engine_side`) that answers the exam's requests with data,
and the worker, which never composes anything nor runs an engine, runs the cases and decides
every verdict; the reference engine's statistics (from an engine process that composes nothing)
and the oracle's completions come first.

The parent passes a JSON job on the command line; the worker writes one JSON object per line to
the pipe ``job["out_fd"]`` as the work goes, so a case that hangs or kills the process leaves
every result before it. No process that runs student code holds that pipe, and the worker is
not dumpable. Job fields: ``labs`` (lab ids whose pieces are the student's), ``mode``
("generate" or "exam"), ``gpu``; for generate ``prompts``, ``max_tokens`` and optionally
``attention_backend`` (the engine's; lab 02-07's pieces run with "triton"); for the exam
``cases`` (names), ``sweep``, ``timeout`` (seconds per case), ``fail_fast``, ``bisect`` (rerun
failing cases with one lab at a time the student's: "all" of them, or True; the "first" only;
"none", or False), and optionally ``first`` (a case to run before the others), ``bisect_labs``
(bisect over these of the student's labs only) and ``reference`` (a JSON file of the reference
engine's records and the oracle's completions to reuse; written there when missing).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from course.engine.engine_side import kill_group
from course.labs.student_process import keep_only_descriptors, not_dumpable, on_its_own


def _emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def _error_record(exc: BaseException) -> dict:
    from course.engine.compose import CompositionError
    from course.engine.exam import _where

    if isinstance(exc, CompositionError):
        return {"type": "error", "message": str(exc), "composition": False}
    return {"type": "error", "message": f"{type(exc).__name__}: {exc} (at {_where(exc)})"}


def in_child(work, timeout_s: float) -> tuple[list[dict], str | None]:
    """Run ``work(out)`` in a forked child that writes records to ``out``; returns the records
    and, when the child did not finish cleanly, why. The child is killed after ``timeout_s``.
    (For ``generate``, whose records are the student's own text, not verdicts.)"""
    if not hasattr(os, "fork"):  # pragma: no cover - the course targets Linux and macOS
        raise RuntimeError("the engine exam needs os.fork (Linux or macOS)")
    with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as tmp:
        path = tmp.name
    sys.stdout.flush()
    sys.stderr.flush()
    worker = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: compose, run, report, and never return into the worker's code
        code = 0
        try:
            on_its_own(worker)
            keep_only_descriptors({0, 1, 2})
            with open(path, "a", encoding="utf-8") as out:
                try:
                    work(out)
                except BaseException as exc:  # noqa: BLE001 - everything is reported
                    _emit(out, _error_record(exc))
                    code = 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = raw
        elif time.monotonic() > deadline:
            kill_group(pid)  # the child and what it started in its group, reaped
            status = -1
        else:
            time.sleep(0.02)
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    os.unlink(path)
    why = None
    if status == -1:
        why = f"killed after {timeout_s:.0f} s"
    elif os.WIFSIGNALED(status):
        why = f"the engine process died (signal {os.WTERMSIG(status)})"
    return records, why


def run_generate(job: dict, out) -> None:
    from course.engine.compose import compose
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    composition = compose(job["labs"], gpu=job.get("gpu", False))
    _emit(out, {"type": "composition", "rows": composition.lab_rows()})
    llm = LLM(job.get("model"), attention_backend=job.get("attention_backend", "paged"))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    if job.get("chat"):
        conversations = [[{"role": "user", "content": p}] for p in job["prompts"]]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    _emit(out, {
        "type": "generate",
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "stats": llm.last_stats.summary(),
    })


def _select_cases(job: dict):
    from course.engine.exam import cases

    all_cases = cases(job["sweep"])
    wanted = job.get("cases")
    if wanted:
        unknown = sorted(set(wanted) - {c.name for c in all_cases})
        if unknown:
            raise ValueError(f"no exam case named {', '.join(unknown)}")
        all_cases = [c for c in all_cases if c.name in wanted]
    # ``first``: the case that rejected this engine last time, run before the others so that a
    # fail-fast run stops at once (course check records it in planted_bugs/exam_rejected.txt).
    first = job.get("first")
    return sorted(all_cases, key=lambda c: c.name != first)


def _run_case(process, exam, case, timeout_s: float):
    """``case`` on the engine ``process`` (started again first if the last case ended it); the
    process is stopped after a case that ran out of time (interrupted anywhere) or that asks
    for a fresh one (Case.fresh_process)."""
    from course.engine.exam import CaseResult, CaseTimeout, run_case

    if not process.alive:
        process.restart()
    try:
        result = run_case(case, exam, timeout_s)
    except CaseTimeout:  # the alarm fired as run_case was putting it away
        result = CaseResult(case.name, "timeout", "did not finish in time")
    if result.outcome == "timeout" or case.fresh_process:
        process.stop()
    return result


def _reference_data(job: dict, chosen, out=None) -> tuple[dict, dict]:
    """(statistics per case, the oracle's completions) of the reference engine, run in an
    engine process that composes nothing, or read from ``job["reference"]``. With ``out``,
    every case's result is reported (the exam of the reference itself)."""
    from course.engine.engine_side import EngineProcess
    from course.engine.exam import Exam, cases

    path = Path(job["reference"]) if job.get("reference") else None
    if path is not None and path.is_file() and out is None:
        data = json.loads(path.read_text(encoding="utf-8"))
        if all(c.name in data["stats"] for c in chosen):
            return data["stats"], data
    process = EngineProcess([], gpu=job.get("gpu", False))
    if process.composition_error is not None:
        raise RuntimeError(f"the reference engine does not compose: {process.composition_error}")
    if out is not None:
        _emit(out, {"type": "composition", "rows": process.rows})
    exam = Exam(process)
    stats = {}
    todo = cases(job["sweep"]) if path is not None else chosen  # a shared file holds them all
    try:
        for case in todo:
            result = _run_case(process, exam, case, job["timeout"])
            if out is not None:
                _emit(out, {"type": "case", **result.as_dict()})
            elif result.outcome != "passed":
                raise RuntimeError(f"the reference engine fails exam case {case.name}: "
                                   f"{result.message}")
            stats[case.name] = exam.recorded
    finally:
        process.stop()
    data = {"stats": stats, **exam.export()}
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(path)
    return stats, data


def run_exam(job: dict, out) -> None:
    chosen = _select_cases(job)
    labs = job["labs"]
    if not labs and job.get("reference"):
        # The reference engine itself (nothing is composed), saving its data.
        _reference_data(job, chosen, out)
        return
    stats, oracle = _reference_data(job, chosen) if labs else (None, {})

    def exam_of(student: list[str], names: set[str], fail_fast: bool, emit) -> None:
        """The cases ``names`` on an engine of ``student``'s pieces, judged here."""
        from course.engine.engine_side import EngineProcess
        from course.engine.exam import EngineDied, Exam

        try:
            process = EngineProcess(student, gpu=job.get("gpu", False))
        except EngineDied as exc:
            emit({"type": "error", "message": str(exc)})
            return
        try:
            if process.composition_error is not None:
                emit({"type": "error", "message": process.composition_error,
                      "composition": False})
                return
            emit({"type": "composition", "rows": process.rows})
            exam = Exam(process, stats)
            exam.preload(oracle)
            for case in chosen:
                if case.name not in names:
                    continue
                if not process.alive:  # the last case crashed it or ran out of time
                    try:
                        process.restart()
                    except EngineDied as exc:
                        emit({"type": "error", "message": str(exc)})
                        return
                    if process.composition_error is not None:
                        emit({"type": "error", "message": process.composition_error,
                              "composition": False})
                        return
                result = _run_case(process, exam, case, job["timeout"])
                emit({"type": "case", **result.as_dict()})
                if fail_fast and result.outcome != "passed":
                    break
        finally:
            process.stop()

    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        _emit(out, record)

    exam_of(labs, {c.name for c in chosen}, job.get("fail_fast", False), emit)
    # Every failing case is bisected (one failure can hide a second mistake in another lab),
    # except those that name an unwritten task: their message already says where to look.
    failed = [r["case"] for r in records if r.get("type") == "case"
              and r["outcome"] != "passed" and not r["message"].startswith("not implemented")]
    mode = {True: "all", False: "none", None: "none"}.get(job.get("bisect"), job.get("bisect"))
    if mode == "first":
        failed = failed[:1]
    if not (failed and mode != "none" and labs):
        return
    _emit(out, {"type": "bisect-start", "case": failed[0], "cases": failed})
    for lab_id in job.get("bisect_labs") or labs:  # one engine per lab, every failing case
        sub: list[dict] = []
        exam_of([lab_id], set(failed), False, sub.append)
        ran = {r["case"]: r for r in sub if r.get("type") == "case"}
        errors = [r["message"] for r in sub if r.get("type") == "error"]
        for name in failed:
            r = ran.get(name)
            _emit(out, {"type": "bisect", "lab": lab_id, "case": name,
                        "outcome": r["outcome"] if r else "error",
                        "message": r["message"] if r else ("; ".join(errors) or "no result")})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(argv[0])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # One thread: forked children must not inherit a pool of OpenMP workers.
    torch.set_num_threads(1)
    not_dumpable()  # before anything that runs student code is forked
    keep_only_descriptors({0, 1, 2, job["out_fd"]})  # none of the command's (the grader's pipe)
    with os.fdopen(job["out_fd"], "w", encoding="utf-8") as out:
        try:
            if job["mode"] == "exam":
                run_exam(job, out)
            else:
                records, why = in_child(lambda o: run_generate(job, o), job.get("budget", 600))
                for record in records:
                    _emit(out, record)
                if why:
                    _emit(out, {"type": "error", "message": why})
        except KeyboardInterrupt:
            _emit(out, {"type": "error", "message": "interrupted"})
            return 2
        except Exception as exc:
            _emit(out, _error_record(exc))
            return 2
        _emit(out, {"type": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
