"""How long is the report a student reads for one mistake? Lines of the lab's test command's
output, one planted bug at a time.

Issue 43's rule: a single mistake prints at most 120 lines (a failure repeated over a grid of
cases, or over tests with the same message, prints once in full and once per other case in a
line: course/labs/feedback.py). Each planted bug of a lab (planted_bugs/PP-LL.py) is one mistake
a student makes; this script applies it to a scratch copy of the repository, runs the command a
student runs,

    LAB_IMPL=solution python -m pytest <lab folder> -q

(the reference with the bug is a student's code with that one mistake), counts the lines it
prints, and writes every count with the command that made it:

    python scripts/report_lengths.py [LAB ...] [--json benchmarks/results/report_lengths.json]

Exit status 1 when a report is longer than the limit. SLOW labs are left out of a run that names
no lab (named on the command line, they run, and the record keeps them): the CUDA lab (02-06),
each of whose bugs rebuilds the emulated kernels (1 to 3 minutes a bug, 40 to 50 in all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from course.integrity.bugs import load_bugs  # noqa: E402
from course.integrity.checks import CopySlots  # noqa: E402
from course.labs.catalog import discover, select  # noqa: E402

LIMIT = 120
SLOW = {
    "02-06": "each bug rebuilds the emulated kernels",
}
TIMEOUT_S = 900


def report_of(lab, bug, slots: CopySlots) -> tuple[int, str, float]:
    """(lines printed, the output, seconds) of the lab's test command with `bug` in place."""
    with slots.copy_of(REPO_ROOT) as copy:
        bug.apply(copy)
        env = dict(os.environ, LAB_IMPL="solution", PYTHONDONTWRITEBYTECODE="1",
                   MINI_VLLM_BUILD_DIR=str(slots.build_dir))
        env["HYPOTHESIS_PROFILE"] = "student"  # what LAB_IMPL=starter runs with
        start = time.perf_counter()
        try:
            run = subprocess.run(
                [sys.executable, "-m", "pytest", str(lab.path.relative_to(REPO_ROOT)), "-q"],
                cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as exc:
            out = (f"(timed out after {TIMEOUT_S} s)\n"
                   + (exc.stdout or b"").decode(errors="replace"))
        return len(out.splitlines()), out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", help="lab ids (default: every lab but 02-06)")
    parser.add_argument("--json", type=Path, help="write every count here")
    parser.add_argument("--show-longest", action="store_true",
                        help="print the longest report of each lab")
    args = parser.parse_args(argv)
    labs = select(discover(), args.labs or None)
    if not args.labs:
        labs = [lab for lab in labs if lab.id not in SLOW]
    record: dict = {"command": "python scripts/report_lengths.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "limit": LIMIT, "labs": {}}
    if args.json and args.json.is_file():  # keep the labs measured before
        record["labs"] = json.loads(args.json.read_text()).get("labs", {})
    slots = CopySlots()
    too_long = []
    try:
        for lab in labs:
            counts, longest = {}, (0, "", "")
            for bug in load_bugs(lab):
                lines, out, seconds = report_of(lab, bug, slots)
                counts[bug.name] = lines
                print(f"{lab.id} {bug.name}: {lines} lines ({seconds:.0f} s)", flush=True)
                if lines > longest[0]:
                    longest = (lines, bug.name, out)
                if lines > LIMIT:
                    too_long.append(f"{lab.id} {bug.name}: {lines} lines")
            record["labs"][lab.id] = {"lines": counts, "longest": longest[0],
                                      "longest_bug": longest[1]}
            if args.show_longest and longest[1]:
                print(f"--- {lab.id} {longest[1]}, {longest[0]} lines ---\n{longest[2]}")
            if args.json:
                args.json.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        slots.close()
    worst = max(((v["longest"], k, v["longest_bug"]) for k, v in record["labs"].items()),
                default=None)
    if worst:
        print(f"longest report: {worst[0]} lines (lab {worst[1]}, {worst[2]}); limit {LIMIT}")
    for line in too_long:
        print(f"over the limit: {line}")
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
