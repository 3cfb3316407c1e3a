"""benchmarks/student_loop.py reads the phases of a saved `bash .ci/run` log (its timings are a
benchmark's, never a test's: nothing here runs a command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from course.labs.loader import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]

LOG = """\
+ python3 -m venv .venv
ci phase: install took 134 s
....................................................................... [ 99%]
1601 passed, 21 skipped in 359.80s (0:05:59)
ci phase: test suite took 360 s
course check: 13 labs ...
ci phase: course check took 1004 s
site: install 21 s, build 38 s, browser check 15 s; screenshots in build/ci-artifacts/
ci phase: site took 74 s
ci: 1572 s in all
"""


@pytest.fixture(scope="module")
def bench():
    return load_script("student_loop_benchmark", REPO_ROOT / "benchmarks" / "student_loop.py")


def test_the_phases_total_and_site_parts_are_read_from_a_ci_log(bench):
    ci = bench.parse_ci_log(LOG)
    assert ci["phases"] == [
        {"name": "install", "seconds": 134.0},
        {"name": "test suite", "seconds": 360.0},
        {"name": "course check", "seconds": 1004.0},
        {"name": "site", "seconds": 74.0},
    ]
    assert ci["total_s"] == 1572.0 and ci["sum_of_phases_s"] == 1572.0
    assert ci["site_s"] == {"install": 21.0, "build": 38.0, "check": 15.0}


def test_a_log_that_stops_early_keeps_its_phases_and_has_no_total(bench):
    ci = bench.parse_ci_log(LOG.split("ci phase: course check")[0] + "FAILED\n")
    assert [p["name"] for p in ci["phases"]] == ["install", "test suite"]
    assert ci["total_s"] is None and ci["site_s"] is None
