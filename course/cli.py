"""`python -m course`: the student's dashboard, the instructor's grader, the course's own checks.

python -m course                 status of every lab against your starter.py files
python -m course status --impl solution
python -m course grade --submission DIR --out OUT    grade one student (exit 0 whatever the score)
python -m course grade --class DIR --out OUT -j 4    grade a class: one CSV row per student
python -m course clone --roster CSV --into DIR [--deadline T] [--shard i/N]   clone a class
python -m course clone --roster CSV --plan N   the shards of N that hold students, as JSON
python -m course check           integrity: solution passes, starter fails, same API, bugs caught
                                 (null starters: every task body emptied earns no points)
python -m course list            the labs, in order
python -m course refs [--fetch] [--vllm-src DIR ...] [--changes [LAB]]   upstream references
python -m course engine [--exam]  your finished labs as one engine; the engine exam
python -m course hint 02-03 4 [--level 2|3]  a hint for task 4 of lab 02-03, one rung at a time
python -m course measure 02-01 [--plot F]    predict, then measure: your code beside the reference
python -m course upgrade 03-01    carry your work onto the course's current starter.py
python -m course figures [--check]  draw the README figures (phase-*/figures/*.svg)
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from course.labs.catalog import REPO_ROOT, Lab, discover, select
from course.labs.console import Progress, table, workers


def cmd_list(args) -> int:
    labs = discover()
    rows = [[f"phase {lab.phase}", lab.id, lab.title, lab.rel] for lab in labs]
    print(table(["Phase", "Lab", "Title", "Folder"], rows))
    return 0


def cmd_status(args) -> int:
    from course.student.dashboard import show_status

    return show_status(select(discover(), args.labs), args.impl, args.jobs, args.no_exam,
                       use_cache=not args.no_cache)


def cmd_grade(args) -> int:
    from course.grading import GradingError, Options, class_folders, grade, parse_shard

    labs = select(discover(), args.labs)
    out = Path(args.out).resolve()
    if args.merge:
        from course.grading import merge

        if args.class_dir or args.submission or args.shard:
            raise SystemExit("error: --merge takes grading outputs only, not --class, "
                             "--submission or --shard")
        try:
            code = merge([Path(d).resolve() for d in args.merge], out, labs,
                         log=lambda m: print(m, file=sys.stderr),
                         similarity=not args.no_similarity, zero=args.reference_zero)
        except GradingError as exc:
            print(f"GRADING ERROR: {exc}", file=sys.stderr)
            return 2
        print((out / "summary.md").read_text(encoding="utf-8"))
        names = ["grades.csv", "gradebook.csv", "similarity.csv", "summary.md"]
        files = [str(out / n) for n in names if (out / n).is_file()]
        print(f"Wrote {', '.join(files[:-1])} and {files[-1]}")
        return code
    class_mode = bool(args.class_dir)
    if args.class_dir and args.submission:
        raise SystemExit("error: give --class or --submission, not both")
    shard = None
    if args.shard:
        if not class_mode:
            raise SystemExit("error: --shard splits a class: give --class DIR")
        try:
            shard = parse_shard(args.shard)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    missing: dict[str, str] = {}
    logins: dict[str, str] = {}
    if class_mode:
        paths = class_folders(Path(args.class_dir).resolve())
        missing, logins = roster_record(Path(args.class_dir))
        paths = [(name, path) for name, path in paths if name not in missing]
    elif args.submission:
        sub = Path(args.submission).resolve()
        if not sub.is_dir():
            raise SystemExit(f"error: --submission {sub} is not a folder")
        paths = [(args.name, sub)]
    else:
        paths = [(args.name or "this-checkout", REPO_ROOT)]
        print(
            "Grading in place: your own starter files, with this checkout's tests. Instructors "
            "grade from a clean copy of the course with --submission DIR or --class DIR.",
            file=sys.stderr,
        )
    opts = Options(
        out=out,
        jobs=workers(args.jobs),
        impl=args.impl,
        test_timeout=args.test_timeout,
        lab_timeout=args.lab_timeout,
        reference_zero=args.reference_zero,
        similarity=not args.no_similarity,
        shard=shard,
        regrade=args.regrade,
        only_tests=tuple(args.only_tests or ()),
        memory_limit=int(args.memory_limit * 2**30),
        # Grading your own checkout in place is a student's check, not a class's grade: it runs
        # with whatever sandbox this machine allows.
        allow_weak_isolation=args.allow_weak_isolation or not (class_mode or args.submission),
    )
    print(f"Grading {len(paths)} submission(s) x {len(labs)} lab(s), {opts.jobs} at a time.",
          file=sys.stderr)
    try:
        code = grade(paths, labs, opts, class_mode, log=lambda m: print(m, file=sys.stderr),
                     missing=missing, logins=logins)
    except GradingError as exc:
        print(f"GRADING ERROR: {exc}", file=sys.stderr)
        return 2
    if class_mode:
        print((out / "summary.md").read_text(encoding="utf-8"))
        similarity = f"{out / 'similarity.csv'}, " if (out / "similarity.csv").is_file() else ""
        print(f"Wrote {out / 'grades.csv'}, {similarity}{out / 'summary.md'} and one folder per "
              f"student under {out / 'students'}/")
    else:
        print((out / "grades.txt").read_text(encoding="utf-8"))
        print(f"Wrote {out / 'grades.json'}, {out / 'grades.txt'}, {out / 'grades.csv'} and "
              f"{out / 'junit'}/*.xml")
    # Only a broken grader is an error; a student's failing, crashing or hanging code is a score.
    return code


def roster_record(class_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """From the class folder's .roster.json (written by `course clone`): the students whose
    clone failed ({name: why}) and every student's LMS login."""
    import json

    path = class_dir / ".roster.json"
    if not path.is_file():
        return {}, {}
    students = json.loads(path.read_text()).get("students", {})
    missing = {name: f"could not get the submission: {s['error']}"
               for name, s in students.items() if s.get("error")}
    logins = {name: s.get("login") or "" for name, s in students.items()}
    return missing, logins


def cmd_check(args) -> int:
    from course.integrity import bug_record, null_check
    from course.integrity.bugs import load_bugs, load_seen_by, write_seen_by
    from course.integrity.checks import (
        GRADING_EXPECTATIONS,
        GRADING_FIXTURE,
        BugResult,
        CopySlots,
        _cuda_available,
        check_bug,
        check_course,
        check_grading_path,
        check_lab,
    )
    from course.labs import warm

    labs = select(discover(), args.labs)
    if args.write_agreement:  # that comparison alone, recorded (the other checks not run)
        problems = _check_agreement(args, labs, _cuda_available())
        for p in problems:
            print(f"  - {p}")
        return 1 if problems else 0
    course_problems = [] if args.labs else check_course()
    checks = {}
    bug_lists = {}
    for lab in labs:
        try:
            bug_lists[lab.id] = [] if args.no_bugs else load_bugs(lab)
        except Exception as exc:  # reported as a violation by check_lab
            bug_lists[lab.id] = []
            print(f"  lab {lab.id}: cannot read its planted bugs: {exc}", file=sys.stderr)
    has_cuda = _cuda_available()
    # Null starters: rerun a lab's variants only when its inputs changed since the record.
    null_record = null_check.load_record(REPO_ROOT)
    null_labs = [lab for lab in labs if null_check.in_scope(lab)
                 and (args.write_null_record or not null_check.is_current(lab, null_record))]
    null_runs: dict[str, list] = {lab.id: [] for lab in null_labs}
    variants = list(null_check.null_starters.VARIANTS)
    n_units = (len(labs) + sum(len(b) for b in bug_lists.values())
               + len(null_labs) * len(variants))
    bug_results: dict[str, list] = {lab.id: [None] * len(bug_lists[lab.id]) for lab in labs}
    # Planted bugs: replay a lab's recorded verdicts while what decides them is unchanged.
    verdicts = bug_record.load_record(REPO_ROOT)
    digests = {lab.id: bug_record.lab_digest(lab) for lab in labs if bug_lists[lab.id]}
    replayed = set()
    if not (args.write_bug_record or args.write_seen_by):
        for lab in labs:
            recorded = bug_lists[lab.id] and bug_record.recorded_verdicts(
                lab, bug_lists[lab.id], verdicts, digests[lab.id])
            if recorded:
                bug_results[lab.id] = [
                    BugResult(bug, v["status"], v.get("detail", ""), v.get("seconds", 0.0),
                              v.get("seen_by", ""))
                    for bug, v in zip(bug_lists[lab.id], recorded)]
                replayed.add(lab.id)
    n_units -= sum(len(bug_lists[lab_id]) for lab_id in replayed)
    progress = Progress(n_units, "checking")
    # Every lab's own runs and every planted bug are independent units of work: run them all
    # through one pool so that both cores stay busy.
    slots = CopySlots()  # the bugs' copies of the repository, and what their runs build
    seen_by = {} if args.write_seen_by else load_seen_by()
    try:
        with warm.session(), ThreadPoolExecutor(workers(args.jobs)) as pool:
            futures = {}
            for lab in labs:
                futures[pool.submit(check_lab, lab, bugs_required=not args.no_bugs)] = (lab, None)
                for i, bug in enumerate(bug_lists[lab.id]):
                    if lab.id in replayed:
                        continue
                    first = seen_by.get(lab.id, {}).get(bug.name, "")
                    futures[pool.submit(check_bug, lab, bug, has_cuda, slots=slots,
                                        first=first)] = (lab, i)
            for lab in null_labs:
                for variant in variants:
                    futures[pool.submit(null_check.run_variant, lab, variant, slots)] = (
                        lab, variant)
            for fut in as_completed(futures):
                lab, i = futures[fut]
                if isinstance(i, str):  # a null variant
                    r = fut.result()
                    null_runs[lab.id].append(r)
                    progress.finished(f"lab {lab.id}: null starter {r.variant}: "
                                      f"{len(r.passing)} graded passed ({r.seconds:.0f} s)")
                elif i is None:
                    c = checks[lab.id] = fut.result()
                    st = c.starter
                    progress.finished(
                        f"lab {lab.id}: solution {c.solution.passed if c.solution else '-'}/"
                        f"{c.solution.total if c.solution else '-'} passed, starter "
                        f"{len(st.by_outcome('passed')) if st else '-'} passed, "
                        f"{'ok' if not c.violations else 'VIOLATIONS'}"
                    )
                else:
                    r = bug_results[lab.id][i] = fut.result()
                    progress.finished(f"lab {lab.id}: planted bug {r.bug.name}: {r.status} "
                                      f"({r.seconds:.0f} s)")
    finally:
        slots.close()
    progress.close()
    exam_problems, exam_bugs = _check_engine_exam(args, labs, verdicts)
    ran = [lab for lab in labs if bug_lists[lab.id] and lab.id not in replayed]
    if args.write_bug_record:
        if not args.labs:  # every lab was checked: drop the entries of labs that are gone
            verdicts["labs"] = {k: v for k, v in verdicts.get("labs", {}).items()
                                if k in {lab.id for lab in labs}}
        verdicts.setdefault("labs", {}).update(
            {lab.id: bug_record.lab_entry(digests[lab.id], bug_results[lab.id]) for lab in ran})
        print(f"  wrote {bug_record.write_record(verdicts).relative_to(REPO_ROOT)}")
    elif ran and not args.no_bugs:
        print(f"  note: the planted bugs of {len(ran)} lab(s) ran: their inputs changed since "
              f"planted_bugs/{bug_record.RECORD}; record them: {bug_record.WRITE_HINT}")
    if replayed:
        print(f"  planted-bug verdicts of {len(replayed)} lab(s) replayed from "
              f"planted_bugs/{bug_record.RECORD} (nothing they depend on changed)")
    for lab in labs:
        c = checks[lab.id]
        c.bugs = bug_results[lab.id]
        for r in c.bugs:
            if r.status in ("NOT REJECTED", "invalid"):
                c.violations.append(f"planted bug {r.bug.name!r}: {r.status}: {r.detail}")
    null_lines = _null_starter_results(args, labs, checks, null_record, null_runs)
    rows = []
    for lab in labs:
        c = checks[lab.id]
        sol = c.solution
        st = c.starter
        rows.append(
            [
                lab.id,
                lab.title,
                f"{sol.passed}/{sol.total}" if sol else "-",
                f"{len(st.by_outcome('passed'))}/{st.total}" if st else "-",
                f"{sum(b.status == 'rejected' for b in c.bugs)}/{len(c.bugs)}",
                "ok" if not c.violations else f"{len(c.violations)} violation(s)",
            ]
        )
    print(
        table(
            ["Lab", "Title", "Solution passes", "Starter passes", "Bugs rejected", "Result"], rows
        )
    )
    if not args.no_bugs:
        print("\nPlanted bugs:")
        for lab in labs:
            for b in checks[lab.id].bugs:
                detail = b.detail.splitlines()[0] if b.detail else ""
                print(f"  {lab.id}  {b.bug.name:<38} {b.status:<13} {detail}")
        bugs = [b for lab in labs for b in checks[lab.id].bugs]
        moved = [b for b in bugs if b.first and b.seen_by != b.first]
        if moved:
            print(f"  note: {len(moved)} planted bug(s) were not rejected by the test "
                  "planted_bugs/seen_by.json names, so all their lab's tests ran (slower, same "
                  "verdict); record the tests anew: python -m course check --write-seen-by")
        if args.write_seen_by:
            recorded = load_seen_by()
            for lab in labs:
                recorded[lab.id] = {b.bug.name: b.seen_by for b in checks[lab.id].bugs
                                    if b.seen_by}
            print(f"  wrote {write_seen_by(recorded)}")
    print("\n".join(null_lines))
    for lab in labs:
        for note in checks[lab.id].notes:
            print(f"  note: lab {lab.id}: {note}")
    if exam_bugs:
        rejected = sum(b.status == "rejected" for b in exam_bugs)
        print(f"\nEngine exam: the reference and stand-in students pass; {rejected} of "
              f"{len(exam_bugs)} planted bugs of the engine labs run are rejected by the exam "
              "as well (the rest cannot change what an engine computes, or only a lab test "
              "sees them; those planted_bugs/exam_not_rejected.txt lists are not run again):")
        for b in exam_bugs:
            blamed = f"  bisection: lab {', '.join(b.blamed)}" if b.blamed else ""
            print(f"  {b.lab_id}  {b.bug.name:<38} {b.status:<13}{blamed}")
    violations = course_problems + exam_problems + [
        f"lab {lab.id}: {v}" for lab in labs for v in checks[lab.id].violations
    ]
    violations += _check_agreement(args, labs, has_cuda)
    if not args.labs and not args.no_grading_path and GRADING_FIXTURE.is_dir():
        print("\nThe grading path: grading the fixture class (honest, cheating and hanging "
              "submissions) end to end ...", flush=True)
        problems, facts = check_grading_path(jobs=workers(args.jobs))
        print(f"  {len(GRADING_EXPECTATIONS)} submissions graded in {facts['seconds']:g} s; "
              f"{'ok' if not problems else 'PROBLEMS'}")
        violations += [f"grading path: {p}" for p in problems]
    if violations:
        print(f"\n{len(violations)} violation(s):")
        for v in violations:
            print(f"  - {v}")
        return 1
    print(f"\nAll {len(labs)} labs pass the integrity checks.")
    return 0


def _check_agreement(args, labs: list[Lab], has_cuda: bool) -> list[str]:
    """The grader against pytest (course/integrity/agreement.py): the record checked, or, with
    --write-agreement, the comparison run again and recorded."""
    from concurrent.futures import ThreadPoolExecutor

    from course.integrity.agreement import RECORD, check_record, compare_lab, write_record
    from course.integrity.checks import CopySlots

    if args.write_agreement:
        print(f"\nThe grader against pytest, on {len(labs)} lab(s) (minutes a lab) ...",
              flush=True)
        from course.labs import warm

        slots = CopySlots()
        results = []
        try:
            with warm.session(), ThreadPoolExecutor(workers(args.jobs)) as pool:
                for lab in labs:
                    r = compare_lab(lab, slots, has_cuda=has_cuda, pool=pool)
                    results.append(r)
                    print(f"  lab {lab.id}: {sum(r.compared.values())} outcomes compared, "
                          f"{len(r.disagreements)} disagreement(s) ({r.seconds:.0f} s)",
                          flush=True)
        finally:
            slots.close()
        print(f"  wrote {write_record(results).relative_to(REPO_ROOT)}")
    if not (REPO_ROOT / RECORD).is_file():  # a course of its own (a test's fixture course)
        print(f"\nThe grader against pytest: no {RECORD} here; not compared "
              "(python -m course check --write-agreement records it).")
        return []
    problems = [f"lab {lab.id}: {p}" for lab in labs for p in check_record([lab])]
    if not problems:
        print(f"\nThe grader and pytest agree on every lab checked ({RECORD}).")
    return problems


def _null_starter_results(args, labs: list[Lab], checks: dict, record: dict,
                          runs: dict[str, list]) -> list[str]:
    """Add the null starters' violations and notes to the labs' checks, write the record when
    asked (see course/integrity/null_check.py), and return the lines to print."""
    from course.integrity import null_check

    lines = ["\nNull starters (every task body `pass`, `return None`, its first argument, or a "
             "RuntimeError): no graded test may pass:"]
    order = {v: i for i, v in enumerate(null_check.null_starters.VARIANTS)}
    fresh = {}
    for lab in labs:
        c = checks[lab.id]
        if not null_check.in_scope(lab):
            c.notes.append(null_check.out_of_scope_note(lab))
            continue
        recorded = lab.id not in runs
        if recorded:
            entry = record[lab.id]
        else:
            entry = fresh[lab.id] = null_check.entry(
                lab, sorted(runs[lab.id], key=lambda r: order[r.variant]))
            if not args.write_null_record:
                c.notes.append("null starters ran: their inputs changed since "
                               f"planted_bugs/{null_check.RECORD}; record them: "
                               + null_check.WRITE_HINT.format(lab=lab.id))
        lines.append(f"  {null_check.summary(lab, entry, recorded)}")
        c.violations.extend(null_check.violations(lab, entry, recorded))
    if args.write_null_record and fresh:
        record = null_check.load_record(REPO_ROOT)
        if not args.labs:  # every lab was checked: drop the entries of labs that are gone
            record = {k: v for k, v in record.items() if k in {lab.id for lab in labs}}
        record.update(fresh)
        path = null_check.write_record(record, REPO_ROOT)
        lines.append(f"  wrote {path.relative_to(REPO_ROOT)}")
    return lines


def _check_engine_exam(args, labs: list[Lab], verdicts: dict):
    """The engine exam part of `course check` (see course/integrity/exam_check.py). The whole
    exam (every engine lab, its bugs) is replayed from ``verdicts`` (bug_verdicts.json) while
    what decides it is unchanged, and recorded there with --write-bug-record."""
    from course.integrity import bug_record
    from course.integrity.exam_check import (
        CPU_LABS_EXCLUDED,
        EXAM_NOT_REJECTED,
        EXAM_REJECTED,
        compare_with_expected,
        exam_units,
        load_bug_list,
        recorded_results,
        run_exam_checks,
        write_exam_lists,
    )

    exam_labs = [lab.id for lab in labs if lab.engine_parts and lab.id not in CPU_LABS_EXCLUDED]
    if args.no_exam or not exam_labs:
        return [], []
    only = None if not args.labs else exam_labs
    bugs_of = [] if args.no_bugs else only
    every = args.write_exam_lists
    whole = not args.labs and not args.no_bugs and not every  # the exam the record holds
    digest = bug_record.exam_digest([lab for lab in labs if lab.engine_parts]) if whole else ""
    entry = (bug_record.recorded_exam(verdicts, digest)
             if whole and not args.write_bug_record else None)
    if entry is not None:
        problems, results = list(entry["problems"]), recorded_results(entry["results"])
        print(f"  engine exam replayed from planted_bugs/{bug_record.RECORD} (nothing it "
              "depends on changed)")
    else:
        progress = Progress(exam_units(bugs_of, every) if not args.no_bugs else 2,
                            "engine exam")
        problems, results = run_exam_checks(workers(args.jobs), bugs_of, progress, every)
        progress.close()
        if whole and args.write_bug_record:
            verdicts["exam"] = bug_record.exam_entry(digest, problems, results)
    lost, notes = compare_with_expected(results, load_bug_list(EXAM_REJECTED),
                                        load_bug_list(EXAM_NOT_REJECTED))
    if every and not lost:
        for path in write_exam_lists(results):
            print(f"  wrote {path.relative_to(REPO_ROOT)}")
        notes = []
    for note in notes:
        print(f"  note: {note}")
    return problems + lost, results


def cmd_refs(args) -> int:
    from course.upstream.refs import check_consistency, load_map
    from course.upstream.today import (
        changes_report,
        check_today_consistency,
        check_trees,
        today_version,
    )

    if args.fetch:
        from course.upstream.fetch import FetchError, fetch, pinned_versions

        for version in pinned_versions(REPO_ROOT):
            try:
                tree = fetch(version)
            except FetchError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"vLLM {version}: {tree}")
            args.vllm_src.append(str(tree))
    from course.upstream.layout import check_layout

    problems = check_consistency(REPO_ROOT) + check_today_consistency(REPO_ROOT)
    refs, _ = load_map(REPO_ROOT)
    print(f"{len(refs)} map entries; map, today's pin and READMEs "
          f"{'agree' if not problems else 'disagree'}.")
    layout = check_layout(REPO_ROOT, today_version(REPO_ROOT))
    print(f"mini_vllm's layout (upstream_refs/layout.toml): "
          f"{'every module and package mapped' if not layout else 'problems below'}.")
    problems += layout
    if args.vllm_src:
        found, lines = check_trees([Path(p) for p in args.vllm_src], REPO_ROOT)
        problems += found
        for line in lines:
            print(line)
    if args.changes is not None:
        try:
            report = changes_report(REPO_ROOT, args.changes or None)
        except KeyError as exc:
            print(f"error: {exc.args[0]}", file=sys.stderr)
            return 2
        for line in report:
            print(line)
    for p in problems:
        print(f"  - {p}")
    if problems:
        print(f"course refs: {len(problems)} problem(s), listed above; fix the map, "
              f"upstream_refs/today/ or the README they name.")
    return 1 if problems else 0


def _cmd_engine(args) -> int:
    from course.engine.command import cmd_engine
    from course.engine.exam import GRADED_SWEEP

    if args.sweep is None:
        args.sweep = GRADED_SWEEP
    if args.serve and (args.exam or args.prompt or args.list):
        print("error: --serve runs the server alone; leave out --exam, --prompt and --list",
              file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"error: --port {args.port} is not a port (1 to 65535)", file=sys.stderr)
        return 2
    if args.max_tokens < 1 or args.sweep < 0 or args.case_timeout <= 0 or args.timeout <= 0:
        print("error: --max-tokens must be >= 1, --sweep >= 0, --case-timeout and --timeout > 0",
              file=sys.stderr)
        return 2
    return cmd_engine(args)
def cmd_hint(args) -> int:
    from course.student.hints import render_hint

    (lab,) = select(discover(), [args.lab])
    try:
        print(render_hint(lab, args.task, args.level))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_upgrade(args) -> int:
    from course.student.upgrade import upgrade_lab

    try:
        (lab,) = select(discover(), [args.lab])
    except SystemExit as exc:  # an unknown lab: one line, nothing changed
        print(f"{exc}; nothing changed", file=sys.stderr)
        return 2
    code, lines = upgrade_lab(lab)
    print("\n".join(lines), file=sys.stderr if code == 2 else sys.stdout)
    return code


def cmd_measure(args) -> int:
    from course.student.measure import command

    (lab,) = select(discover(), [args.lab])
    return command(lab, quick=args.quick, plot_path=Path(args.plot) if args.plot else None,
                   show=args.show, arch=args.arch)


def cmd_clone(args) -> int:
    """`course clone`: check a roster and print its shard matrix (--plan), or clone its
    students (one shard's with --shard) into --into. Exit 2 on a bad roster or option; a student
    who cannot be cloned is recorded in INTO/.roster.json, not an error."""
    import json

    from course.grading import (
        RosterError,
        clone_class,
        parse_deadline,
        parse_shard,
        plan,
        read_roster,
    )

    try:
        students = read_roster(args.roster)
        if args.plan is not None:
            print(json.dumps(plan(students, args.plan)))
            return 0
        if not args.into:
            raise ValueError("give --into DIR (where to clone) or --plan N")
        shard = parse_shard(args.shard) if args.shard else None
        deadline = parse_deadline(args.deadline) if args.deadline else None
        clone_class(students, Path(args.into), deadline, shard,
                    log=lambda m: print(m, flush=True), jobs=args.jobs or 4)
    except (RosterError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")

    def labs_and_jobs(p):
        p.add_argument(
            "labs", nargs="*", help="lab ids (02-01), folder names or paths; default all"
        )
        p.add_argument(
            "-j", "--jobs", type=int, default=None, help="labs run in parallel (default 2)"
        )

    p = sub.add_parser("status", help="every lab against your starter (the default)")
    labs_and_jobs(p)
    p.add_argument("--impl", choices=("starter", "solution"), default="starter")
    p.add_argument("--no-exam", action="store_true",
                   help="leave out the engine exam (as graded, and on your finished engine labs)")
    p.add_argument("--no-cache", action="store_true",
                   help="run every lab you changed, even when its recorded result still holds")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "grade", help="grade submissions: grades.json, JUnit per lab, one CSV row per student"
    )
    labs_and_jobs(p)
    p.add_argument("--out", required=True, help="folder for the reports")
    p.add_argument(
        "--submission",
        metavar="DIR",
        help="a student's checkout: grade its starter files against this checkout's tests",
    )
    p.add_argument(
        "--class",
        dest="class_dir",
        metavar="DIR",
        help="a folder of students' checkouts (one sub-folder each, named after the student)",
    )
    p.add_argument("--name", help="the student's name in the reports (default: the folder's)")
    p.add_argument("--impl", choices=("starter", "solution"), default="starter")
    p.add_argument(
        "--test-timeout", type=float, default=60.0, metavar="S", help="per test (default 60 s)"
    )
    p.add_argument(
        "--lab-timeout", type=float, default=900.0, metavar="S", help="per lab (default 900 s)"
    )
    p.add_argument(
        "--reference-zero",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="a starter this similar to the reference scores 0 for the lab (default 0.9; "
        "above 1 switches it off)",
    )
    p.add_argument("--no-similarity", action="store_true", help="skip the similarity report")
    p.add_argument("--shard", metavar="I/N",
                   help="grade only the students of shard I of N (assigned by name); "
                   "`--merge` then writes the class files")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="rebuild the class files in --out from these grading outputs (shards, "
                   "or a run that was killed); nothing is graded")
    p.add_argument("--memory-limit", type=float, default=3.0, metavar="GIB",
                   help="memory of one lab's grading session (default 3 GiB)")
    p.add_argument("--allow-weak-isolation", action="store_true",
                   help="grade even where the full sandbox (root: namespaces, user nobody, a "
                   "memory limit) is not available")
    p.add_argument("--regrade", action="store_true",
                   help="grade again students whose complete grades.json is up to date")
    # `course check`'s comparison of the grader with pytest runs single tests this way; the
    # others then read "not run" (a grade is never made of part of a lab).
    p.add_argument("--only-tests", nargs="+", metavar="TEST", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser(
        "clone", help="clone a class from a roster (CSV) for `grade --class`",
        description="Clone the students of a roster (a CSV file: student,repository,ref,login; "
        "see grading/roster.example.csv) into --into, one folder per student, at their ref and "
        "the deadline; the outcome per student is in INTO/.roster.json. A private GitHub "
        "repository is read with the token in $CLASS_TOKEN. --plan N prints the shards of N "
        "that hold students, as the JSON matrix of the grading workflow: {\"shard\": [1, 3, 4]}.")
    p.add_argument("--roster", required=True, metavar="CSV", help="the roster file")
    p.add_argument("--into", metavar="DIR", help="the class folder to clone into")
    p.add_argument("--deadline", metavar="ISO8601",
                   help="grade the last commit at or before this time (with its UTC offset, "
                   "e.g. 2026-05-01T23:59:00+02:00)")
    p.add_argument("--shard", metavar="i/N", help="only the students of shard i of N")
    p.add_argument("--plan", type=int, metavar="N",
                   help="print {\"shard\": [...]}: the shards of N that hold students; no clone")
    p.add_argument("-j", "--jobs", type=int, default=None, help="clones at a time (default 4)")
    p.set_defaults(func=cmd_clone)

    p = sub.add_parser("check", help="course integrity checks (for course authors and CI)")
    labs_and_jobs(p)
    p.add_argument(
        "--lab", dest="labs_opt", action="append", default=[], help="same as a positional lab"
    )
    p.add_argument("--no-bugs", action="store_true", help="skip the planted-bug runs")
    p.add_argument("--write-seen-by", action="store_true",
                   help="run every planted bug against the lab's tests in order and record the "
                        "test that rejects it in planted_bugs/seen_by.json (run first next time)")
    p.add_argument("--write-null-record", action="store_true",
                   help="run every null starter of the labs checked (each task body `pass`, "
                        "`return None`, its first argument, a RuntimeError) and record the "
                        "outcome in planted_bugs/null_starters.json (rerun only when a lab's "
                        "starter.py, test_lab.py or the generator changes)")
    p.add_argument("--write-bug-record", action="store_true",
                   help="run every planted bug (and the engine exam over them) even where "
                        "planted_bugs/bug_verdicts.json holds their verdicts for today's inputs, "
                        "and record the verdicts there (rerun only when a lab, its bugs or the "
                        "code its tests run changes)")
    p.add_argument(
        "--no-grading-path",
        action="store_true",
        help="skip grading the fixture class of cheating and hanging submissions",
    )
    p.add_argument("--no-exam", action="store_true",
                   help="skip the engine exam (the reference, stand-ins, planted bugs)")
    p.add_argument("--write-agreement", action="store_true",
                   help="only this: grade the solution, the starter and every planted bug's "
                        "rejecting test of each lab in the grading sandbox, compare each outcome "
                        "with pytest's and record it in planted_bugs/agreement.json (minutes a "
                        "lab)")
    p.add_argument("--write-exam-lists", action="store_true",
                   help="run every planted bug of the engine labs through the exam (also those "
                        "planted_bugs/exam_not_rejected.txt lists) and write both exam lists")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "engine",
        help="your finished labs as one mini_vllm: generate, compare with the reference, exam",
        description="Your finished labs' pieces put into mini_vllm. See course/engine/command.py.",
    )
    p.add_argument("--labs", help="comma-separated lab ids whose pieces are yours, or 'all' "
                   "(default: every finished engine lab)")
    p.add_argument("--impl", choices=("starter", "solution"), default="starter",
                   help="solution: the reference engine")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt (repeatable; \\n is a newline); default the finale's")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--model", default=None,
                   help="a model for mini_vllm.LLM (a Hugging Face folder, a .gguf file, "
                   "'smollm2'); default the shipped Shakespeare model")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered with the model's chat template")
    p.add_argument("--attention-backend", choices=("paged", "triton"), default="paged",
                   help="the engine's attention: PagedAttention and chunked prefill (default), or "
                   "lab 02-07's one Triton kernel (yours when 02-07 is; interpreted on a CPU, "
                   "slow); the reference engine it is compared with uses the same")
    p.add_argument("--exam", action="store_true", help="run the engine exam")
    p.add_argument("--serve", action="store_true",
                   help="serve your engine with mini_vllm's OpenAI-compatible server (as "
                   "`python -m mini_vllm serve` serves the reference) until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1", help="with --serve: the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="with --serve: the port")
    p.add_argument("--case", action="append", default=[], help="only this exam case "
                   "(repeatable)")
    p.add_argument("--list", action="store_true", help="list the exam cases")
    p.add_argument("--sweep", type=int, default=None,
                   help="randomized configurations in the exam (default: the graded 8)")
    p.add_argument("--case-timeout", type=float, default=60.0, help="seconds per exam case")
    p.add_argument("--bisect", choices=("all", "first", "none"), default="all",
                   help="rerun the failing exam cases with one of your labs at a time, to name "
                   "the lab at fault: all of them (default), the first only, or none")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for building and running an engine, beyond the cases")
    p.add_argument("--json", metavar="PATH", help="write the exam's results as JSON")
    p.add_argument("--channel", metavar="FD", type=int, default=None,
                   help="write the exam's results as one JSON line to this descriptor (the "
                   "grader's pipe, which no process that runs your code holds)")
    p.add_argument("-j", "--jobs", type=int, default=None, help="processes in parallel")
    p.set_defaults(func=_cmd_engine)

    p = sub.add_parser("figures", add_help=False,
                       help="draw the README figures (phase-*/figures/*.svg); --check compares")
    p.set_defaults(func=None)  # main() hands `figures ...` to course.figures.main

    p = sub.add_parser("list", help="the labs, in order, with their titles")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("refs", help="check upstream references (map <-> code; vs. a source tree)")
    p.add_argument(
        "--vllm-src",
        action="append",
        default=[],
        metavar="DIR",
        help="an unpacked vLLM release (repeatable: a pinned one, today's, or both)",
    )
    p.add_argument(
        "--fetch",
        action="store_true",
        help="fetch every release upstream_refs/pins.toml names (their sdists, from the package "
        "index, kept in $VLLM_SRC_CACHE or ~/.cache/vllm-src) and check against all of them",
    )
    p.add_argument(
        "--changes",
        nargs="?",
        const="",
        metavar="LAB",
        help="per lab, the pieces that moved, changed signature or behaviour, or are gone at "
        "today's pin (one lab with its notes when LAB is given)",
    )
    p.set_defaults(func=cmd_refs)

    p = sub.add_parser("hint", help="a hint for one task: a question, an example, the idea "
                       "and its tests, upstream lines")
    p.add_argument("lab", help="lab id (02-03), folder name or path")
    p.add_argument("task", type=int, help="the task number (as in the starter's messages)")
    p.add_argument(
        "--level",
        type=int,
        choices=(1, 2, 3, 4),
        default=1,
        help="1: a question (default); 2: a worked example to trace by hand; 3: the idea and "
        "the tests that check it; 4: the upstream lines to read",
    )
    p.set_defaults(func=cmd_hint)

    p = sub.add_parser("measure", help="predict, then measure: your code beside the reference")
    p.add_argument("lab", help="lab id (02-01), folder name or path")
    p.add_argument("--plot", metavar="FILE", help="draw the plot into FILE (.png, .svg, .pdf)")
    p.add_argument("--show", action="store_true", help="show the plot in a window")
    p.add_argument("--quick", action="store_true", help="fewer, smaller sizes")
    p.add_argument("--arch", choices=("T4", "A100", "H100"),
                   help="lab 02-06: the static report (registers, occupancy, loads from the "
                   "compiled SASS) for this GPU; without a GPU it is printed for H100")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("upgrade", help="carry your starter's work onto the course's current "
                       "starter (after a course update)")
    p.add_argument("lab", help="lab id (03-01), folder name or path")
    p.set_defaults(func=cmd_upgrade)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    commands = ("status", "grade", "clone", "check", "list", "refs", "engine", "hint", "measure",
                "figures", "upgrade")
    if argv[:1] == ["figures"]:
        from course.figures import main as figures_main

        return figures_main(argv[1:])
    if not argv or (argv[0] not in commands and argv[0] not in ("-h", "--help")):
        argv = ["status", *argv]  # `python -m course [labs] [options]` is the dashboard
    args = parser.parse_args(argv)
    if getattr(args, "labs_opt", None):
        args.labs = [*args.labs, *args.labs_opt]
    return args.func(args)
