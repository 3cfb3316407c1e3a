"""How far apart the grader's similarity puts disguised copies of the reference and honest work.

The submissions are tests/fixtures/similarity/<lab>/*.py (labs 02-01 and 02-03: three honest
implementations in different styles, and copies of the reference disguised at three levels; see
that folder's README) and, as one more honest student, tests/fixtures/student's file for the lab.
Each is measured against the reference as `course grade` measures it, by both of its measures:
copydetect (text k-grams, winnowing) and structure (function by function on normalised syntax
trees). The table gives each file's two scores and whether the grader flags it; then, per lab,
the lowest disguised score against the highest honest one, and the honest files' scores against
each other. Time per student is the grader's cost for these two labs, the reference's own
fingerprints already made (they are made once per run).

Run it from the repository root::

    python benchmarks/similarity_separation.py
    python benchmarks/similarity_separation.py --json benchmarks/results/similarity_separation.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from record import write_result  # noqa: E402

from course.grading import similarity, structure  # noqa: E402
from course.labs.catalog import discover  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "similarity"
STUDENT = REPO_ROOT / "tests" / "fixtures" / "student"
LABS = ("02-01", "02-03")


def submissions(lab) -> dict[str, bytes]:
    """{name: starter.py} of the lab's fixtures, plus the course's student fixture."""
    files = {f.stem: f.read_bytes() for f in sorted((FIXTURES / lab.id).glob("*.py"))}
    extra = STUDENT / lab.rel / "starter.py"
    if extra.is_file():
        files["student_fixture"] = extra.read_bytes()
    return files


def kind(name: str) -> str:
    return "disguised" if name.startswith("disguised") else "honest"


def measure(labs) -> dict:
    rows, labs_out = [], {}
    seconds, structure_seconds = [], []
    for lab in labs:
        files = submissions(lab)
        rel = f"{lab.rel}/starter.py"
        similarity.class_similarity({"warm": {rel: files["honest_a"]}}, [lab], REPO_ROOT,
                                    peers=False)  # the reference's fingerprints, made once
        keep, given, refs = similarity._reference_units(lab, REPO_ROOT)
        for name, data in files.items():
            start = time.perf_counter()
            sim = similarity.class_similarity({name: {rel: data}}, [lab], REPO_ROOT, peers=False)
            seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            structure.compare(structure.own(structure.units(data.decode(), keep), given), refs)
            structure_seconds.append(time.perf_counter() - start)
            row = sim.rows[0]
            notes = [n for _, n in sim.flags.get(name, [])]
            rows.append({
                "lab": lab.id, "file": name, "kind": kind(name),
                "copydetect": row["reference"], "structure": row["structure"],
                "flag": next((n.split(":")[0] for n in notes), ""),
            })
        peers = similarity.class_similarity({n: {rel: d} for n, d in files.items()}, [lab],
                                            REPO_ROOT, peers=True)
        honest = sorted(n for n in files if kind(n) == "honest")
        shapes = {n: structure.own(structure.units(files[n].decode(), keep), given)
                  for n in honest}
        pairs = {f"{a} vs {b}": round(structure.compare(shapes[a], shapes[b]).score, 3)
                 for a, b in itertools.permutations(honest, 2)}
        mine = [r for r in rows if r["lab"] == lab.id]
        labs_out[lab.id] = {
            "lowest_disguised": {m: min(r[m] for r in mine if r["kind"] == "disguised")
                                 for m in ("copydetect", "structure")},
            "highest_honest": {m: max(r[m] for r in mine if r["kind"] == "honest")
                               for m in ("copydetect", "structure")},
            "honest_peers_structure": pairs,
            "honest_peer_flags": sorted(n for n in honest if peers.peer_flags.get(n)),
        }
    return {"rows": rows, "labs": labs_out,
            "seconds_per_student_per_lab": round(sum(seconds) / len(seconds), 3),
            "structure_seconds_per_student_per_lab": round(
                sum(structure_seconds) / len(structure_seconds), 3),
            "thresholds": {"structure_copy": similarity.COPY,
                           "copydetect_zero": similarity.ZERO}}


def environment() -> dict:
    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True,
                                  capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        revision = "-"
    return {"python": platform.python_version(), "machine": platform.machine(),
            "copydetect": importlib.metadata.version("copydetect"), "git_revision": revision}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    labs = [lab for lab in discover() if lab.id in LABS]
    result = measure(labs)
    print(f"{'lab':6} {'file':16} {'kind':10} {'copydetect':>10} {'structure':>10}  flag")
    for r in result["rows"]:
        print(f"{r['lab']:6} {r['file']:16} {r['kind']:10} {r['copydetect']:>10.3f} "
              f"{r['structure']:>10.3f}  {r['flag']}")
    print()
    for lab_id, s in result["labs"].items():
        for m in ("copydetect", "structure"):
            low, high = s["lowest_disguised"][m], s["highest_honest"][m]
            print(f"{lab_id} {m:10}: lowest disguised {low:.3f}, highest honest {high:.3f}, "
                  f"gap {low - high:+.3f}")
        peers = s["honest_peers_structure"]
        print(f"{lab_id} honest vs honest (structure): {min(peers.values()):.3f} to "
              f"{max(peers.values()):.3f}; flagged: {s['honest_peer_flags'] or 'none'}")
    print(f"\ngrader's cost: {result['seconds_per_student_per_lab']:.3f} s per student per lab "
          f"(structure {result['structure_seconds_per_student_per_lab']:.3f} s of it)")
    write_result(args.json, "similarity_separation.py", environment(), result, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
