"""What grading writes: per student grades.json, grades.txt and one JUnit XML per graded unit;
per class grades.csv (one row per student), gradebook.csv (for an LMS), summary.md (a table),
class.json and similarity.csv.

Files are written whole and renamed into place, so a reader (or a killed run) never sees half a
file; a student's files are rewritten as each of their units finishes, the class files as each
student finishes. The class files are made from the students' grades.json alone, so that
`course grade --merge` rebuilds them from shards or from a killed run.
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree as ET

from course.labs.console import table

TIERS = ("cpu", "gpu")


def _atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def totals(results, units) -> dict[str, dict]:
    """Fixed maxima (every unit counts, run or not) and points, per tier, never mixed."""
    got = {r.id: r for r in results}
    out = {}
    for tier in TIERS:
        maximum = sum(u.max_points.get(tier, 0.0) for u in units)
        if not maximum:
            continue
        points = sum(got[u.id].points(tier) for u in units if u.id in got)
        out[tier] = {"points": round(points, 3), "max_points": round(maximum, 3)}
    return out


GPU_NOT_RUN = "not run (no GPU)"


def _flags(sub, results) -> list[str]:
    flags = list(sub.flags)
    for lab_id, notes in sub.lab_flags.items():
        flags += [f"{lab_id}: {n}" for n in notes]
    for r in results:
        if r.uses_reference:
            flags.append(f"{r.id}: uses the reference ({'; '.join(r.uses_reference)})")
        if r.status.startswith("timed out"):
            flags.append(f"{r.id}: {r.status}: {r.reason}")
        if tampered_reason(r):
            flags.append(f"{r.id}: tampered: {tampered_reason(r)}")
    return flags


def tampered(r) -> list[str]:
    """The tests of unit result `r` that caught their machinery changed while they ran (kind
    "tampered": a pytest plugin registered, a hook or a function of the test replaced), each as
    "test name: what was seen"."""
    return [f"{t.id.split('::', 1)[-1]}: "
            f"{t.message if len(t.message) <= 240 else t.message[:237] + '...'}"
            for t in r.tests if t.kind == "tampered"]


def tampered_reason(r) -> str:
    """The first test that caught tampering and what it saw, with how many more did ("" when
    none did): the reason of the status "tampered"."""
    caught = tampered(r)
    if len(caught) > 1:
        return f"{caught[0]} (and {len(caught) - 1} more test{'s' * (len(caught) > 2)})"
    return caught[0] if caught else ""


def unit_list(units) -> list[dict]:
    """What every unit is worth: the same for every student (the class files are built from it)."""
    return [{"id": u.id, "title": u.title, "kind": u.kind, "max_points": u.max_points}
            for u in units]


def student_report(sub, results, units, meta) -> dict:
    """grades.json: everything the class files and grades.txt are made from."""
    return {
        **{k: v for k, v in meta.items() if k not in ("seconds", "units")},
        "student": sub.name,
        "login": sub.login,
        "submission": str(sub.path),
        "commit": sub.commit,
        "not_submitted": sub.missing,
        "files_graded": sorted(sub.files),
        "totals": totals(results, units),
        "flags": _flags(sub, results),
        "units_graded": len(results),
        "units": len(units),
        "unit_list": unit_list(units),
        "labs": [
            {
                "id": r.id,
                "kind": r.kind,
                "title": r.title,
                "folder": r.folder,
                "status": r.status,
                "reason": r.reason,
                "points": {t: r.points(t) for t in r.max_points},
                "max_points": r.max_points,
                "passed": r.count("passed"),
                "failed": r.count("failed", "crashed", "exited", "timed_out"),
                "not_implemented": r.count("not_implemented"),
                "not_run": r.count("not_run", "skipped"),
                "total": len(r.tests),
                "uses_reference": r.uses_reference,
                "tampered": tampered(r),  # "test: what was seen", for each test that caught it
                "flags": r.flags + sub.lab_flags.get(r.id, []),
                "notes": r.notes,
                "seconds": round(r.seconds, 1),
                "peak_memory_mib": None if getattr(r, "peak_memory", None) is None
                else round(r.peak_memory / 2**20, 1),
                "junit": f"junit/{_junit_name(r.id)}",
                "error": r.error,
                "tests": [
                    {
                        "id": t.id,
                        "tier": t.tier,
                        "outcome": t.outcome,
                        "kind": t.kind,  # what failed: "assertion", "tampered", "timeout", ...
                        "points": 0.0 if r.uses_reference else round(t.points, 4),
                        "max_points": round(t.max_points, 4),
                        "message": t.message,
                    }
                    for t in r.tests
                ],
            }
            for r in results
        ],
    }


def complete(report: dict) -> bool:
    return report.get("units_graded") == report.get("units")


def _junit_name(unit_id: str) -> str:
    return f"lab-{unit_id}.xml" if unit_id[:2].isdigit() else f"{unit_id}.xml"


def junit(sub, r, meta) -> str:
    """One unit as JUnit XML valid against pytest's junit-10.xsd: points live in the suite's
    <properties> (a testcase may not hold properties in that schema)."""
    failures = sum(t.outcome not in ("passed", "skipped", "not_run") for t in r.tests)
    skipped = sum(t.outcome in ("skipped", "not_run") for t in r.tests)
    root = ET.Element("testsuites", name=f"mini_vllm grading: {sub.name}",
                      tests=str(len(r.tests)), failures=str(failures), errors="0",
                      time=f"{r.seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"{r.id} {r.title}", tests=str(len(r.tests)),
                          failures=str(failures), errors="0", skipped=str(skipped),
                          time=f"{r.seconds:.3f}", timestamp=meta["created"],
                          hostname=socket.gethostname())
    props = ET.SubElement(suite, "properties")

    def prop(name, value):
        ET.SubElement(props, "property", name=name, value=str(value))

    prop("student", sub.name)
    prop("commit", sub.commit or "")
    prop("status", r.status)
    if r.reason:
        prop("reason", r.reason)
    for tier, maximum in r.max_points.items():
        prop(f"points.{tier}", f"{r.points(tier):g}")
        prop(f"max_points.{tier}", f"{maximum:g}")
    if r.uses_reference:
        prop("uses_reference", "; ".join(r.uses_reference))
    for t in r.tests:
        prop(f"points[{t.id}]", f"{0.0 if r.uses_reference else t.points:.4g}/{t.max_points:.4g}")
    for t in r.tests:
        file_part, _, name = t.id.rpartition("::")
        case = ET.SubElement(suite, "testcase", classname=file_part.replace("/", ".")
                             .removesuffix(".py"), name=name or t.id, time=f"{t.seconds:.3f}")
        pts = f"{0.0 if r.uses_reference else t.points:.4g}/{t.max_points:.4g} points"
        if t.outcome in ("skipped", "not_run"):
            ET.SubElement(case, "skipped", type=t.outcome, message=f"{pts}: {t.message}")
        elif t.outcome != "passed" or r.uses_reference:
            why = "uses the reference" if t.outcome == "passed" else t.message
            failure = ET.SubElement(case, "failure", type=t.kind or t.outcome,
                                    message=f"{pts}: {why}"[:1000])
            failure.text = t.detail[-4000:] if t.detail else why
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode")


def _points(lab: dict, tier: str, gpu_ran) -> str:
    if tier not in lab["max_points"]:
        return "-"
    if tier == "gpu" and not gpu_ran:
        return f"{GPU_NOT_RUN} / {lab['max_points'][tier]:g}"
    return f"{lab['points'][tier]:g}/{lab['max_points'][tier]:g}"


def student_text(report: dict) -> str:
    """grades.txt: a table of units, the totals, each failed test with the first line of its
    message, and the flags."""
    gpu_ran = report.get("gpu")
    got = {lab["id"]: lab for lab in report["labs"]}
    rows = []
    for u in report["unit_list"]:
        lab = got.get(u["id"])
        if lab is None:
            rows.append([u["id"], u["title"], "-", "-", "-", "not graded yet"])
            continue
        cpu_tests = [t for t in lab["tests"] if t["tier"] == "cpu"]
        passed = sum(t["outcome"] == "passed" for t in cpu_tests)
        rows.append([u["id"], u["title"], f"{passed}/{len(cpu_tests)}",
                     _points(lab, "cpu", gpu_ran), _points(lab, "gpu", gpu_ran), lab["status"]])
    text = f"{report['student']}  (commit {report['commit'] or 'unknown'})\n"
    if report.get("not_submitted"):
        text += f"Not graded: {report['not_submitted']}\n"
    text += "\n" + table(["Unit", "Title", "CPU tests", "CPU points", "GPU points", "Status"],
                         rows)
    for tier, t in report["totals"].items():
        got_points = GPU_NOT_RUN if tier == "gpu" and not gpu_ran else f"{t['points']:g}"
        text += f"\n{tier.upper()} total: {got_points} / {t['max_points']:g} points"
    failed = []
    for lab in report["labs"]:
        if lab["reason"]:
            failed.append(f"  {lab['id']}: {lab['status']}: {lab['reason']}")
        if lab["status"] in ("not started", "does not import", "uses the reference",
                             "similarity", "not submitted"):
            continue  # every test fails for the one reason above
        for t in lab["tests"]:
            if t["outcome"] not in ("passed", "skipped") and not (
                    t["tier"] == "gpu" and not gpu_ran):
                first = (t["message"].strip().splitlines() or [t["outcome"]])[0][:200]
                failed.append(f"  {lab['id']} {t['id'].split('::', 1)[-1]}: {first}")
    if failed:
        text += "\n\nWhat failed:\n" + "\n".join(failed)
    notes = [f"  {lab['id']}: {n}" for lab in report["labs"] for n in lab.get("notes", [])]
    if notes:
        text += "\n\nNotes:\n" + "\n".join(notes)
    flags = [*report["flags"], *report.get("peer_flags", [])]
    if flags:
        text += "\n\nFlags:\n" + "\n".join(f"  - {f}" for f in flags)
    return text + "\n"


def write_student(folder: Path, report: dict, results=()) -> None:
    """grades.json and grades.txt from the report; one JUnit file per unit in `results`."""
    _atomic(folder / "grades.json", json.dumps(report, indent=1))
    _atomic(folder / "grades.txt", student_text(report))
    meta = {"created": report["created"]}
    who = SimpleNamespace(name=report["student"], commit=report["commit"])
    for r in results:
        _atomic(folder / "junit" / _junit_name(r.id), junit(who, r, meta))


def csv_columns(units: list[dict]) -> list[str]:
    cols = ["student", "commit", "cpu_points", "cpu_max", "gpu_points", "gpu_max"]
    for u in units:
        cols += [f"{u['id']}{'' if tier == 'cpu' else ' gpu'}" for tier in TIERS
                 if tier in u["max_points"]]
    cols += [f"{u['id']} status" for u in units]
    return [*cols, "graded", "flags", "errors"]


def class_row(report: dict, units: list[dict], gpu_ran) -> dict:
    tot = report["totals"]
    done = report["labs"]
    row = {
        "student": report["student"],
        "commit": report["commit"] or "",
        "cpu_points": tot.get("cpu", {}).get("points", 0),
        "cpu_max": tot.get("cpu", {}).get("max_points", 0),
        "gpu_points": tot.get("gpu", {}).get("points", 0) if gpu_ran else GPU_NOT_RUN,
        "gpu_max": tot.get("gpu", {}).get("max_points", 0),
        "graded": f"{len(done)}/{len(units)}",
        "flags": " | ".join([*report["flags"], *report.get("peer_flags", [])]),
        "errors": " | ".join(f"{lab['id']}: grading error" for lab in done if lab["error"]),
    }
    for lab in done:
        for tier in lab["max_points"]:
            ran = tier == "cpu" or gpu_ran
            row[f"{lab['id']}{'' if tier == 'cpu' else ' gpu'}"] = (
                lab["points"][tier] if ran else GPU_NOT_RUN)
        row[f"{lab['id']} status"] = lab["status"]
    return row


def gradebook(reports: list[dict], gpu_ran) -> str:
    """gradebook.csv for an LMS: Canvas's import columns (Student, ID, SIS User ID, SIS Login
    ID, Section), then one total per tier with two decimals; Moodle's CSV import can match "SIS
    Login ID" to the username. (Not imported into either LMS here.) The GPU column exists only
    where the GPU tier ran (an LMS reads a blank as "no grade", a text as an error)."""
    cpu_max = next((r["totals"]["cpu"]["max_points"] for r in reports if "cpu" in r["totals"]),
                   0)
    cols = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
            f"mini_vllm CPU ({cpu_max:g})"]
    gpu_max = next((r["totals"]["gpu"]["max_points"] for r in reports if "gpu" in r["totals"]),
                   0)
    if gpu_ran and gpu_max:
        cols.append(f"mini_vllm GPU ({gpu_max:g})")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for r in reports:
        line = [r["student"], "", "", r.get("login") or r["student"], "",
                f"{r['totals'].get('cpu', {}).get('points', 0):.2f}"]
        if len(cols) == 7:
            line.append(f"{r['totals'].get('gpu', {}).get('points', 0):.2f}")
        w.writerow(line)
    return buf.getvalue()


def write_class(out: Path, reports: list[dict], meta: dict, similarity_csv: str | None = None
                ) -> None:
    """grades.csv, gradebook.csv, summary.md and class.json, from the students' reports (sorted
    by name, so a merged run and a one-machine run write the same rows)."""
    reports = sorted(reports, key=lambda r: r["student"])
    units = meta["units"]
    gpu_ran = meta["gpu"]
    rows = [class_row(r, units, gpu_ran) for r in reports]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, csv_columns(units), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    _atomic(out / "grades.csv", buf.getvalue())
    _atomic(out / "gradebook.csv", gradebook(reports, gpu_ran))
    _atomic(out / "class.json", json.dumps(
        {**meta, "students": [r["student"] for r in reports],
         "complete": [r["student"] for r in reports if complete(r)]}, indent=1))
    if similarity_csv is not None:
        _atomic(out / "similarity.csv", similarity_csv)
    _atomic(out / "summary.md", summary_md(rows, reports, meta))


def summary_md(rows, reports, meta) -> str:
    gpu_note = "" if meta["gpu"] else f" GPU tier: {GPU_NOT_RUN}."
    done = sum(complete(r) for r in reports)
    lines = [
        "## Grades",
        "",
        f"Course revision `{meta['course_revision'][:12]}`"
        f"{' (uncommitted changes!)' if meta['course_dirty'] else ''}; isolation "
        f"`{meta['isolation']['level']}`; {done} of {len(reports)} students graded; "
        f"{meta.get('seconds', 0):g} s.{gpu_note}",
        "",
    ]
    units = meta["units"]
    if len(rows) > 1 or meta.get("class_mode"):
        lines += ["| student | commit | CPU points | GPU points | " +
                  " | ".join(u["id"] for u in units) + " | flags |",
                  "| --- " * (5 + len(units)) + "|"]
        for r in rows:
            gpu = r["gpu_points"] if meta["gpu"] else GPU_NOT_RUN
            statuses = " | ".join(r.get(f"{u['id']} status", "not graded yet") for u in units)
            lines.append(f"| {r['student']} | `{r['commit'][:10]}` | {r['cpu_points']:g} / "
                         f"{r['cpu_max']:g} | {gpu} / {r['gpu_max']:g} | {statuses} | "
                         f"{len(r['flags'].split(' | ')) if r['flags'] else 0} |")
    elif reports:
        report = reports[0]
        got = {lab["id"]: lab for lab in report["labs"]}
        lines += ["| unit | title | CPU points | GPU points | status |",
                  "| --- | --- | --- | --- | --- |"]
        for u in units:
            lab = got.get(u["id"])
            if lab is None:
                continue
            lines.append(f"| {u['id']} | {u['title']} | {_points(lab, 'cpu', meta['gpu'])} | "
                         f"{_points(lab, 'gpu', meta['gpu'])} | {lab['status']} |")
        row = rows[0]
        lines += ["", f"**CPU total: {row['cpu_points']:g} / {row['cpu_max']:g}**"]
        if row["flags"]:
            lines += ["", "Flags:", *[f"- {f}" for f in row["flags"].split(" | ")]]
    return "\n".join(lines) + "\n"
