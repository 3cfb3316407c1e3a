"""What grading writes: per student grades.json, grades.txt and one JUnit XML per graded unit;
per class grades.csv (one row per student), summary.md (a table) and similarity.csv.

Files are written whole and renamed into place, so a reader (or a killed run) never sees half a
file; a student's files are rewritten as each of their units finishes.
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
from pathlib import Path
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


def _flags(sub, results) -> list[str]:
    flags = list(sub.flags)
    for lab_id, notes in sub.lab_flags.items():
        flags += [f"{lab_id}: {n}" for n in notes]
    for r in results:
        if r.uses_reference:
            flags.append(f"{r.id}: uses the reference ({'; '.join(r.uses_reference)})")
        if r.status == "timed out":
            flags.append(f"{r.id}: the lab's time budget ran out")
    return flags


def student_report(sub, results, units, meta) -> dict:
    return {
        **{k: v for k, v in meta.items() if k != "seconds"},
        "student": sub.name,
        "submission": str(sub.path),
        "commit": sub.commit,
        "files_graded": sorted(sub.files),
        "totals": totals(results, units),
        "flags": _flags(sub, results),
        "units_graded": len(results),
        "units": len(units),
        "labs": [
            {
                "id": r.id,
                "kind": r.kind,
                "title": r.title,
                "folder": r.folder,
                "status": r.status,
                "points": {t: r.points(t) for t in r.max_points},
                "max_points": r.max_points,
                "passed": r.count("passed"),
                "failed": r.count("failed", "crashed", "exited", "timed_out"),
                "not_implemented": r.count("not_implemented"),
                "not_run": r.count("not_run", "skipped"),
                "total": len(r.tests),
                "uses_reference": r.uses_reference,
                "flags": r.flags + sub.lab_flags.get(r.id, []),
                "seconds": round(r.seconds, 1),
                "junit": f"junit/{_junit_name(r.id)}",
                "error": r.error,
                "tests": [
                    {
                        "id": t.id,
                        "tier": t.tier,
                        "outcome": t.outcome,
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


def text_table(results, units, tot) -> str:

    got = {r.id: r for r in results}
    rows = []
    for u in units:
        r = got.get(u.id)
        if r is None:
            rows.append([u.id, u.title, "-", "-", "-", "not graded yet"])
            continue
        ran = [t for t in r.tests if t.tier == "cpu"]
        cpu = f"{r.points('cpu'):g}/{r.max_points['cpu']:g}" if "cpu" in r.max_points else "-"
        gpu = f"{r.points('gpu'):g}/{r.max_points['gpu']:g}" if "gpu" in r.max_points else "-"
        passed = sum(t.outcome == "passed" for t in ran)
        rows.append([u.id, u.title, f"{passed}/{len(ran)}", cpu, gpu, r.status])
    text = table(["Unit", "Title", "CPU tests", "CPU points", "GPU points", "Status"], rows)
    for tier, t in tot.items():
        text += f"\n{tier.upper()} total: {t['points']:g} / {t['max_points']:g} points"
    return text


def write_student(folder: Path, sub, results, units, meta) -> None:
    report = student_report(sub, results, units, meta)
    _atomic(folder / "grades.json", json.dumps(report, indent=1))
    text = f"{sub.name}  (commit {sub.commit or 'unknown'})\n\n"
    text += text_table(results, units, report["totals"])
    if report["flags"]:
        text += "\n\nFlags:\n" + "\n".join(f"  - {f}" for f in report["flags"])
    _atomic(folder / "grades.txt", text + "\n")
    for r in results:
        _atomic(folder / "junit" / _junit_name(r.id), junit(sub, r, meta))


def csv_columns(units) -> list[str]:
    cols = ["student", "commit", "cpu_points", "cpu_max", "gpu_points", "gpu_max"]
    for u in units:
        cols += [f"{u.id}{'' if tier == 'cpu' else ' gpu'}" for tier in TIERS
                 if tier in u.max_points]
    return [*cols, "graded", "flags", "errors"]


def write_class(out: Path, subs, results, units, meta, similarity, class_mode: bool) -> None:
    rows = []
    for sub in subs:
        done = [results[sub.name][u.id] for u in units if u.id in results[sub.name]]
        tot = totals(done, units)
        row = {
            "student": sub.name,
            "commit": sub.commit or "",
            "cpu_points": tot.get("cpu", {}).get("points", 0),
            "cpu_max": tot.get("cpu", {}).get("max_points", 0),
            "gpu_points": tot.get("gpu", {}).get("points", 0) if meta["gpu"] else "",
            "gpu_max": tot.get("gpu", {}).get("max_points", 0),
            "graded": f"{len(done)}/{len(units)}",
            "flags": " | ".join(_flags(sub, done)),
            "errors": " | ".join(f"{r.id}: grading error" for r in done if r.error),
        }
        for r in done:
            for tier in r.max_points:
                ran = tier == "cpu" or meta["gpu"]
                row[f"{r.id}{'' if tier == 'cpu' else ' gpu'}"] = r.points(tier) if ran else ""
        rows.append(row)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, csv_columns(units), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    _atomic(out / "grades.csv", buf.getvalue())
    _atomic(out / "class.json", json.dumps({**meta, "students": [s.name for s in subs]},
                                           indent=1))
    if similarity is not None:
        _atomic(out / "similarity.csv", similarity.to_csv())
    _atomic(out / "summary.md", summary_md(rows, units, meta, class_mode, subs, results))


def summary_md(rows, units, meta, class_mode, subs, results) -> str:
    gpu_note = "" if meta["gpu"] else " (no GPU on this grader: GPU tests not run)"
    lines = [
        "## Grades",
        "",
        f"Course revision `{meta['course_revision'][:12]}`"
        f"{' (uncommitted changes!)' if meta['course_dirty'] else ''}; isolation "
        f"`{meta['isolation']['level']}`; {meta.get('seconds', 0):g} s{gpu_note}.",
        "",
    ]
    if class_mode or len(rows) > 1:
        lines += ["| student | commit | CPU points | GPU points | flags |",
                  "| --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['student']} | `{r['commit'][:10]}` | {r['cpu_points']:g} / "
                         f"{r['cpu_max']:g} | {r['gpu_points'] or '-'} / {r['gpu_max']:g} | "
                         f"{len(r['flags'].split(' | ')) if r['flags'] else 0} |")
    else:
        (sub,) = subs
        got = results[sub.name]
        lines += ["| unit | title | CPU points | GPU points | status |",
                  "| --- | --- | --- | --- | --- |"]
        for u in units:
            r = got.get(u.id)
            if r is None:
                continue
            cpu = f"{r.points('cpu'):g} / {r.max_points['cpu']:g}" if "cpu" in r.max_points \
                else "-"
            gpu = f"{r.points('gpu'):g} / {r.max_points['gpu']:g}" if "gpu" in r.max_points \
                else "-"
            lines.append(f"| {u.id} | {u.title} | {cpu} | {gpu} | {r.status} |")
        row = rows[0]
        lines += ["", f"**CPU total: {row['cpu_points']:g} / {row['cpu_max']:g}**"]
        if row["flags"]:
            lines += ["", "Flags:", *[f"- {f}" for f in row["flags"].split(" | ")]]
    return "\n".join(lines) + "\n"
