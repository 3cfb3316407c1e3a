"""``python -m course engine``: your finished labs as one engine, and the engine exam.

python -m course engine                        the finale prompts through your mini_vllm
python -m course engine --labs 02-01,03-01     these labs' pieces yours, the rest the reference
python -m course engine --impl solution        the reference engine
python -m course engine --exam                 the engine exam on your mini_vllm
python -m course engine --exam --case NAME     one case (see --list)

By default the pieces of every *finished* engine lab are yours: every task of its starter written
and every graded test passing (results are cached outside the repository, keyed by the files, so
an unchanged lab is not run again). Exit status: 0 when the engine's output is identical to the
reference engine's (every exam case passes), 1 when it is not, 2 when it could not run.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.engine.compose import GPU_ONLY_LABS, engine_labs
from course.labs.catalog import METADATA_PATH, REPO_ROOT
from course.labs.console import table
from course.labs.published import is_untouched, lab_given_note, load_published
from course.labs.results import (
    cache_dir,
    course_digest,
    environment,
    finished_labs,
    result_key,
)
from course.labs.student_process import not_dumpable

FINALE_PROMPTS = ["HAMLET.\n", "KING.\n"]
CASE_TIMEOUT_S = 60.0


def exam_rows(runs, jobs: int | None = None) -> list[list[str]]:
    """The dashboard's rows for the engine exam; [] when it shows no engine lab.

    Two compositions, each labelled: the exam as `course grade` will run it (every engine lab as
    your files hold it, so an unwritten one is its published starter: the grader's `--labs
    all`), and your done labs with the reference for the unfinished ones (what passes so far).
    Each run is cached by the files it composes. When every engine lab is done the two are one
    run; when none is written, the graded exam is 0 without a run, as the grader skips it."""
    title = "Your mini_vllm: the engine exam"
    graded_title = "Engine exam, as graded"
    reference_title = "Engine exam, reference for unfinished labs"
    not_started = ["-", "exam", title, "-", "not started",
                   "finish an engine lab (02-01 is the first), then `python -m course engine`", "-"]
    engine = [r for r in runs if r.lab.engine_parts]
    if not engine:
        return []
    # The graded exam composes every engine lab, shown here or not, and follows those a CPU
    # runs: with none of them written the grader skips it.
    every = engine_labs()
    published = load_published()
    written = [lab for lab in every
               if lab.id not in GPU_ONLY_LABS and not is_untouched(lab, published)]
    if not written and not any(r.status == "done" for r in engine) and not all(
            r.lab.id in GPU_ONLY_LABS for r in engine):
        return [not_started]  # known without importing torch to ask for a GPU
    gpu = _cuda_available()
    engine_runs = [r for r in engine if gpu or r.lab.id not in GPU_ONLY_LABS]
    if not engine_runs:
        return []
    done = [r.lab for r in engine_runs if r.status == "done"]
    if not written and not done:
        return [not_started]
    graded = [lab for lab in every if gpu or lab.id not in GPU_ONLY_LABS]
    from course.engine.exam import GRADED_SWEEP, cases

    names = [c.name for c in cases(GRADED_SWEEP)]
    cache_file = cache_dir() / "exam-status.json"
    try:
        cached = json.loads(cache_file.read_text(encoding="utf-8")).get("runs", {})
    except (OSError, ValueError, AttributeError):
        cached = {}
    kept: dict[str, dict] = {}

    def exam(labs) -> tuple[dict, str]:
        """The exam with ``labs`` yours ({"passed", "total", "error"}: the error of a
        composition that could not be built), and "cached" or "ran"."""
        digest = hashlib.sha256()
        for lab in labs:
            digest.update(lab.id.encode() + result_key(lab, "starter").encode())
        for path in (Path(__file__).parent / "exam.py", Path(__file__).parent / "compose.py",
                     METADATA_PATH):
            digest.update(path.read_bytes())
        key = digest.hexdigest()
        origin = "cached"
        if key not in cached:
            origin = "ran"
            student = [lab.id for lab in labs]
            job = {"mode": "exam", "labs": student, "cases": names, "sweep": GRADED_SWEEP,
                   "timeout": CASE_TIMEOUT_S, "gpu": gpu, "reference": str(_reference_file(gpu))}
            print(f"Running the engine exam on your labs {', '.join(student)} ...",
                  file=sys.stderr)
            report = run_exam_job(job, 300 + 2 * CASE_TIMEOUT_S * len(names))
            error = report["error"] if report["composition_error"] else None
            cached[key] = {"passed": report["passed"], "total": report["total"], "error": error}
        kept[key] = cached[key]
        return cached[key], origin

    rows = []
    same = {lab.id for lab in done} == {lab.id for lab in graded}  # one composition
    if not written:  # (only a GPU-only lab is done) the grader skips the exam
        rows.append(["-", "exam", graded_title, f"0/{len(names)}", "not started",
                     "the grader skips the exam: no engine lab it follows is written", "-"])
    else:
        got, origin = exam(graded)
        unwritten = [lab.id for lab in graded if is_untouched(lab, published)]
        if got["error"]:
            status, step = "failing", f"does not compose: {got['error'].splitlines()[0]}"
        elif got["passed"] == got["total"]:
            status = "done"
            step = "`python -m course engine`: your engine generates" if same else (
                "every case passes with your labs as they are")
        elif unwritten:
            status = "in progress"
            step = f"unwritten labs run as published: {', '.join(unwritten)}"
        else:
            status = "failing"
            step = "`python -m course engine --exam --labs all`: which case fails, which lab"
        rows.append(["-", "exam", graded_title if not same else f"{graded_title} (all yours)",
                     f"{got['passed']}/{got['total']}", status, step, origin])
    if not same:
        if not done:
            rows.append([*not_started[:2], reference_title, *not_started[3:]])
        else:
            got, origin = exam(done)
            mine = ", ".join(lab.id for lab in done)
            if got["passed"] == got["total"]:
                status, step = "in progress", (f"passes with {mine} yours; finish the other "
                                               "engine labs")
            else:
                status = "failing"
                step = "`python -m course engine --exam`: which case fails, and which lab"
            rows.append(["-", "exam", reference_title, f"{got['passed']}/{got['total']}",
                         status, step, origin])
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"runs": kept}), encoding="utf-8")
    except OSError:
        pass
    return rows


def _reference_file(gpu: bool) -> Path:
    """Where the reference engine's exam data (its statistics and the oracle's completions) is
    kept between runs, named by the course's code: computed once, not once per exam run."""
    key = hashlib.sha256(f"{course_digest(REPO_ROOT)}\0{gpu}\0{environment()}".encode())
    key = key.hexdigest()[:16]
    path = cache_dir() / f"exam-reference-{key}.json"
    for old in cache_dir().glob("exam-reference-*.json"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


# ----------------------------------------------------------------------------------------------
# Running one engine in a child process
# ----------------------------------------------------------------------------------------------


@dataclass
class WorkerResult:
    records: list[dict] = field(default_factory=list)
    exit_code: int = 0
    seconds: float = 0.0
    timed_out: bool = False

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("type") == kind]

    @property
    def error(self) -> str | None:
        errors = self.of("error")
        if errors:
            return errors[0]["message"]
        if self.timed_out:
            return "the engine did not finish in time (killed)"
        if not self.of("done"):
            return f"the engine process ended without finishing (exit {self.exit_code})"
        return None


def run_worker(job: dict, timeout_s: float, root: Path = REPO_ROOT) -> WorkerResult:
    """Run one engine job in a fresh process (its own process group, killed on timeout or
    Ctrl-C) and collect the records it wrote."""
    return run_workers([job], timeout_s, root)[0]


def run_workers(jobs: list[dict], timeout_s: float, root: Path = REPO_ROOT) -> list[WorkerResult]:
    """Run engine jobs side by side, each in a fresh process of its own process group.

    For this checkout the processes are forks of this one (no new interpreter is executed: a
    grading sandbox may forbid that); for another tree (a stand-in student's copy of the course),
    a new interpreter started there. Each writes its records to a pipe of its own, which no
    process that runs student code holds (a file could be written by anyone who knows its
    name). A job is killed after ``timeout_s``; Ctrl-C kills them all.
    """
    with tempfile.TemporaryDirectory(prefix="course-engine-") as tmp:
        procs, reads = [], []
        try:
            for i, job in enumerate(jobs):
                log = Path(tmp) / f"log-{i}.txt"
                r, w = os.pipe()
                reads.append(r)
                os.set_blocking(r, False)
                spec = json.dumps({**job, "out_fd": w})
                try:
                    child = (_fork_worker(spec, log, close=reads) if _same_tree(root)
                             else _exec_worker(spec, log, root, w))
                finally:
                    os.close(w)
                procs.append((child, log, time.perf_counter()))
            results = [WorkerResult() for _ in jobs]
            buffers = [bytearray() for _ in jobs]
            waiting = set(range(len(jobs)))
            deadline = time.monotonic() + timeout_s
            try:
                while waiting:
                    select.select(reads, [], [], 0.05)
                    for i in range(len(jobs)):
                        _drain(reads[i], buffers[i])
                    for i in sorted(waiting):
                        child, _, begun = procs[i]
                        code = _poll(child)
                        if code is not None:
                            waiting.discard(i)
                            results[i].exit_code = code
                            results[i].seconds = time.perf_counter() - begun
                    if waiting and time.monotonic() > deadline:
                        for i in waiting:
                            _kill_group(procs[i][0])
                            _poll(procs[i][0], block=True)
                            results[i].timed_out, results[i].exit_code = True, -1
                            results[i].seconds = time.perf_counter() - procs[i][2]
                        waiting.clear()
            except BaseException:
                for i in waiting:
                    _kill_group(procs[i][0])
                raise
            for i in range(len(jobs)):
                _drain(reads[i], buffers[i])
        finally:
            for r in reads:
                os.close(r)
        for result, buffer, (_, log, _) in zip(results, buffers, procs):
            for line in bytes(buffer).decode("utf-8", errors="replace").splitlines():
                try:
                    result.records.append(json.loads(line))
                except ValueError:
                    pass
            output = log.read_text(encoding="utf-8", errors="replace").strip()
            if result.error and output and not result.of("error"):
                tail = "\n".join(output.splitlines()[-8:])
                result.records.append({"type": "error", "message": f"{result.error}:\n{tail}"})
    return results


def _drain(fd: int, buffer: bytearray) -> None:
    """Whatever the pipe holds now (it is non-blocking)."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            return
        buffer += chunk


def _same_tree(root: Path) -> bool:
    return Path(root).resolve() == REPO_ROOT.resolve() and hasattr(os, "fork")


def _fork_worker(spec: str, log: Path, close: list[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 2
    try:  # the child: a process group of its own, output to the log, then the worker
        for fd in close:  # the read ends of the workers' pipes
            os.close(fd)
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from course.engine.worker import main

        code = main([spec])
    except BaseException:  # noqa: BLE001 - reported through the log and the exit status
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exec_worker(spec: str, log: Path, root: Path, out_fd: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "course.engine.worker", spec], cwd=root,
                                env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT, pass_fds=(out_fd,))
    return proc


# A worker is a forked pid or, for another tree, a Popen. A Popen is waited for through its own
# object, never by pid: the subprocess module reaps dropped Popen children (of any thread) the
# next time anyone starts a process, and a waitpid on a reaped pid fails (ECHILD).
def _poll(child: int | subprocess.Popen, block: bool = False) -> int | None:
    """The child's exit code (negative: the signal that killed it), or None while it runs."""
    if isinstance(child, subprocess.Popen):
        return child.wait() if block else child.poll()
    done, status = os.waitpid(child, 0 if block else os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def _kill_group(child: int | subprocess.Popen) -> None:
    pid = child.pid if isinstance(child, subprocess.Popen) else child
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


class UsageError(Exception):
    """A request the command cannot run (exit 2, nothing runs)."""


def _parse_labs(text: str, known: list[str]) -> list[str]:
    if text.strip() == "all":
        return list(known)
    labs = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in labs if t not in known]
    if unknown:
        raise UsageError(
            f"--labs: {', '.join(unknown)} builds no engine piece; engine labs: "
            f"{', '.join(known)} (or 'all')"
        )
    return labs


def _composition_table(rows: list[list[str]], reasons: dict[str, str]) -> str:

    lines = []
    for lab_id, origin, names in rows:
        if origin == "reference" and reasons.get(lab_id):
            origin = f"reference ({reasons[lab_id]})"
        if len(names) > 60:
            names = names[:57] + "..."
        lines.append([lab_id, origin, names])
    return table(["Lab", "Pieces from", "Pieces"], lines)


def _show_token(token_id: int) -> str:
    if 0 <= token_id < 256:
        return repr(chr(token_id))
    return str(token_id)


def _reproduce(labs: list[str], case: str | None = None) -> str:
    cmd = "python -m course engine --exam"
    if case:
        cmd += f" --case {case}"
    return cmd + (f" --labs {','.join(labs)}" if labs else " --impl solution")


def cmd_engine(args) -> int:
    try:
        return _cmd_engine(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_engine(args) -> int:
    labs = engine_labs()
    known = [lab.id for lab in labs]
    gpu = _cuda_available()
    if args.list:
        from course.engine.exam import cases

        for case in cases(args.sweep):
            print(f"{case.name:28} {case.what}")
        return 0
    reasons: dict[str, str] = {}
    if args.impl == "solution":
        student = []
        reasons = {i: "--impl solution" for i in known}
    elif args.labs:
        student = _parse_labs(args.labs, known)
        if not gpu:
            student = [i for i in student if i not in GPU_ONLY_LABS]
        reasons = {i: "not in --labs" for i in known if i not in student}
    else:
        status = finished_labs([lab for lab in labs if gpu or lab.id not in GPU_ONLY_LABS],
                               args.jobs)
        student = [i for i, why in status.items() if not why]
        reasons = {i: why for i, why in status.items() if why}
    if not gpu:
        for i in GPU_ONLY_LABS:
            reasons.setdefault(i, "used only on a CUDA GPU")
    for note in filter(None, (lab_given_note(lab) for lab in labs if lab.id in student)):
        print(note)  # old given code: the composed engine may never call a newer piece of yours
    try:
        if args.exam:
            return _exam(args, student, reasons, gpu)
        if args.serve:
            return _serve(args, student, reasons, gpu)
        return _generate(args, student, reasons, gpu)
    except KeyboardInterrupt:
        print("\ninterrupted; every engine process was stopped.", file=sys.stderr)
        return 2


def _generate(args, student: list[str], reasons: dict[str, str], gpu: bool) -> int:
    prompts = [p.encode().decode("unicode_escape") for p in args.prompt]
    if not prompts and (args.chat or args.model):
        raise UsageError("give the prompt(s) for this model with --prompt")
    prompts = prompts or FINALE_PROMPTS
    # Both engines attend with the same backend: a difference is then the pieces', not the
    # kernels' rounding.
    job = {"mode": "generate", "prompts": prompts, "max_tokens": args.max_tokens, "gpu": gpu,
           "budget": args.timeout, "model": args.model, "chat": args.chat,
           "attention_backend": args.attention_backend}
    yours_job = {**job, "labs": student}
    jobs = [yours_job] + ([{**job, "labs": []}] if student else [])
    results = run_workers(jobs, args.timeout)
    mine, ref = results[0], results[-1]
    rows = (mine.of("composition") or [{"rows": []}])[0]["rows"]
    title = "Your mini_vllm" if student else "The reference mini_vllm"
    print(f"{title}: pieces of {len(student)} lab(s) yours"
          f"{' (' + ', '.join(student) + ')' if student else ''}\n")
    if rows:
        print(_composition_table(rows, reasons) + "\n")
    if mine.error:
        print(f"Your engine could not run: {mine.error}")
        if not mine.of("composition"):
            return 2
        print(f"\nThe engine exam finds which lab: {_reproduce(student)}")
        return 1
    out = mine.of("generate")[0]
    for prompt, text in zip(prompts, out["texts"]):
        print(f"--- {prompt!r}")
        print(text if args.chat else prompt + text)
    print(out["stats"])
    if not student:
        return 0
    if ref.error:
        print(f"\nThe reference engine could not run: {ref.error}")
        return 2
    want = ref.of("generate")[0]["token_ids"]
    for i, (a_ids, b_ids) in enumerate(zip(out["token_ids"], want)):
        for k, (a, b) in enumerate(zip(a_ids, b_ids)):
            if a != b:
                print(f"\nDIFFERENT from the reference engine: prompt {i + 1}, token {k}: yours "
                      f"{_show_token(a)}, reference {_show_token(b)}; parts yours: "
                      f"{', '.join(student)}.\nThe engine exam finds which lab: "
                      f"{_reproduce(student)}")
                return 1
        if len(a_ids) != len(b_ids):
            print(f"\nDIFFERENT from the reference engine: prompt {i + 1} has {len(a_ids)} "
                  f"tokens, the reference {len(b_ids)}.\nThe engine exam finds which lab: "
                  f"{_reproduce(student)}")
            return 1
    total = sum(len(t) for t in want)
    print(f"\nIdentical to the reference engine, token for token ({total} tokens); parts yours: "
          f"{', '.join(student)}.")
    return 0


def _serve(args, student: list[str], reasons: dict[str, str], gpu: bool) -> int:
    """Your engine behind mini_vllm's real server, its engine core in a process of its own as
    ``mini_vllm serve`` runs it. Composition patches the process it runs in: this one (the
    server's side: the detokenizer, the streams) and the core's, which composes the same labs
    before it builds the engine."""
    import functools

    from course.engine.compose import compose
    from mini_vllm.__main__ import DEFAULT_SERVED_NAME
    from mini_vllm.engine.async_llm import AsyncLLM
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.entrypoints.openai.api_server import run_server

    composition = compose(student, gpu=gpu)
    yours = f" ({', '.join(student)})" if student else " (the reference engine)"
    print(f"Your mini_vllm, served: pieces of {len(student)} lab(s) yours{yours}\n")
    print(_composition_table(composition.lab_rows(), reasons) + "\n", flush=True)
    name = args.model or DEFAULT_SERVED_NAME
    engine = AsyncLLM(LLM(args.model, attention_backend=args.attention_backend),
                      model_name=name, multiprocessing=True,
                      core_setup=functools.partial(compose, tuple(student), gpu=gpu))
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    run_server(engine, host=args.host, port=args.port, model_name=name)
    return 0


def _exam(args, student: list[str], reasons: dict[str, str], gpu: bool) -> int:
    from course.engine.exam import cases

    names = [c.name for c in cases(args.sweep)]
    if args.case:
        unknown = [c for c in args.case if c not in names]
        if unknown:
            raise UsageError(f"no exam case named {', '.join(unknown)}; see "
                             "`python -m course engine --list`")
        names = [n for n in names if n in args.case]
    if args.channel is not None:
        # The grader reads the results from this process: nothing that runs student code may
        # ptrace it or read its descriptors (the engine processes are its grandchildren).
        not_dumpable()
    job = {"mode": "exam", "labs": student, "cases": names, "sweep": args.sweep,
           "timeout": args.case_timeout, "gpu": gpu, "bisect": args.bisect}
    who = f"yours: {', '.join(student)}" if student else "all reference"
    print(f"Engine exam: {len(names)} case(s) on your mini_vllm ({who}) ...", file=sys.stderr)
    report = run_exam_job(job, args.timeout + 3 * args.case_timeout * (len(names) + 2))
    if args.channel is not None:  # first: nothing printed below can keep it from the grader
        with os.fdopen(args.channel, "w", encoding="utf-8") as channel:
            channel.write(json.dumps({"type": "exam", **report}) + "\n")
    if report["composition"]:
        print(_composition_table(report["composition"], reasons) + "\n")
    for r in report["cases"]:
        mark = "PASS" if r["outcome"] == "passed" else r["outcome"].upper()
        secs = f"{r['seconds']:.1f} s" if "seconds" in r else ""
        print(f"  {mark:8} {r['case']:28} {secs:>7}  {r['message']}")
    # An unfinished lab runs as the reference: cases it passes say nothing of the student's code.
    as_reference = sorted(i for i, why in reasons.items() if why.startswith("not finished"))
    summary = f"{report['passed']}/{report['total']} exam cases passed ({report['seconds']:.0f} s)"
    if as_reference:
        print(f"\n{summary}: not your engine yet. Labs {', '.join(as_reference)} ran as the "
              "reference (not finished), so these cases did not test them.")
    else:
        print(f"\n{summary}.")
    if report["error"]:
        print(f"The exam could not finish: {report['error']}")
    failing = [r for r in report["cases"] if r["outcome"] != "passed"]
    if failing and student:
        first = failing[0]
        print(f"\nFirst failure: {first['case']}: {first['message']}")
        for line in first.get("detail", []):
            print(f"    {line}")
        print(f"Parts yours: {', '.join(student)}. Reproduce it: "
              f"{_reproduce(student, first['case'])}")
        _print_bisection(report.get("bisections"), student)
    elif failing:
        print("\nThe reference engine fails the exam: that is a bug of the course, not yours.")
    unfinished = sorted(i for i, why in reasons.items() if why.startswith("not finished"))
    if unfinished and not args.labs:
        print(f"\nNot the exam as graded: here labs {', '.join(unfinished)} are the reference; "
              "`course grade` runs every engine lab as your files hold it (an unwritten one as "
              "its published starter). That exam: python -m course engine --exam --labs all")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    if report["composition_error"]:
        return 2
    return 0 if not failing else 1


def run_exam_job(job: dict, timeout_s: float, root: Path = REPO_ROOT) -> dict:
    """Run an exam job in a worker and turn its records into a report: the composition, one
    entry per case (cases that never ran say why), the bisection, the totals."""
    result = run_worker(job, timeout_s, root)
    rows = (result.of("composition") or [{"rows": []}])[0]["rows"]
    outcomes = {r["case"]: r for r in result.of("case")}
    error = result.error
    cases = []
    for name in job["cases"]:
        r = outcomes.get(name)
        if r is None:
            r = {"case": name, "outcome": "not run",
                 "message": error or "the exam stopped at an earlier failure"}
        cases.append(r)
    alone: dict[str, dict[str, dict]] = {}  # case -> lab -> its outcome with only that lab yours
    for r in result.of("bisect"):
        alone.setdefault(r["case"], {})[r["lab"]] = {"outcome": r["outcome"],
                                                     "message": r["message"]}
    bisections = [{"case": case, "alone": labs,
                   "blamed": [lab for lab, r in labs.items() if r["outcome"] != "passed"]}
                  for case, labs in alone.items()]
    composition_error = any(r.get("composition") is False for r in result.of("error"))
    return {"student_labs": job["labs"], "composition": rows, "cases": cases,
            "passed": sum(c["outcome"] == "passed" for c in cases), "total": len(cases),
            "bisection": bisections[0] if bisections else None, "bisections": bisections,
            "error": error, "composition_error": composition_error,
            "seconds": round(result.seconds, 1)}


def _print_bisection(bisections: list[dict] | None, student: list[str]) -> None:
    """Which lab each failing case comes from: cases blamed on the same labs are one line."""
    if not bisections:
        return
    if len(student) == 1:
        print(f"Only lab {student[0]} is yours here: the failures come from its pieces.")
        return
    groups: dict[tuple[str, ...], list[dict]] = {}
    for b in bisections:
        groups.setdefault(tuple(b["blamed"]), []).append(b)
    print(f"Bisecting {len(bisections)} failing case(s), one of your labs at a time:")
    for blamed, group in groups.items():
        names = ", ".join(b["case"] for b in group)
        if blamed:
            message = group[0]["alone"][blamed[0]]["message"].split("; fix that first")[0]
            print(f"  {names}: fails with only lab {' or only lab '.join(blamed)} yours "
                  f"({message})")
        else:
            print(f"  {names}: passes with each lab alone")
    culprits = [b for b in groups if b]
    if len(culprits) == 1:
        blamed = culprits[0]
        print(f"\nThe failure comes from lab {', '.join(blamed)}: "
              f"{'it fails' if len(blamed) == 1 else 'each fails'} with the reference's "
              "pieces around it. When a lab's own tests pass, the mistake is in what the other "
              "pieces expect of it: reread the lab's README on how the engine uses it.")
    elif culprits:
        print(f"\n{len(culprits)} separate mistakes: the cases above fail in labs "
              f"{', '.join(', '.join(b) for b in culprits)}, each with the reference's pieces "
              "around it. Fix one lab at a time (`--case` reruns one case).")
    if () in groups:
        print("\nA case that passes with each lab alone needs several of your pieces together "
              "(one lab relies on another doing something the reference does).")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False
