"""The pytest plugin of the run of vLLM's own tests against mini_vllm (``run.py`` starts it).

It installs the adapter before any upstream test file is imported, skips every excluded item
with its written reason (``upstream_refs/left_out/upstream_tests.toml``), and writes each item's
outcome to the JSON file named by ``UPSTREAM_TESTS_OUTCOMES``: ``passed``, ``failed`` (a failure
or an error in set-up) or ``excluded``, and ``uncollected`` for a file that did not import.

upstream: none (course-only: the bridge to the newest release's tests)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import adapter
import pytest
from exclusions import load_exclusions

_outcomes: dict[str, str] = {}
_errors: dict[str, str] = {}
_reasons: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    try:
        adapter.install(os.environ.get("UPSTREAM_TESTS_IMPL", "solution"),
                        today=os.environ.get("UPSTREAM_TESTS_TODAY", "1") == "1")
    except LookupError as error:  # the stretch is not started
        raise pytest.UsageError(str(error)) from None
    _reasons.update(load_exclusions())


def _key(nodeid: str) -> str:
    """``dir/test_file.py::test_name[param]`` relative to tests/v1/."""
    return nodeid.split("tests/v1/", 1)[-1]


def _reason_for(key: str) -> str | None:
    base = key.split("[", 1)[0]
    return _reasons.get(key) or _reasons.get(base) or _reasons.get(base.split("::", 1)[0])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    adapter.STRICT = True  # the files are imported: from now on a left-out piece raises
    for item in items:
        reason = _reason_for(_key(item.nodeid))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"excluded: {reason}"))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        key = _key(report.nodeid)
        _outcomes[key] = "uncollected"
        _errors[key] = str(report.longrepr).strip().splitlines()[-1][:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    key = _key(report.nodeid)
    if report.skipped and report.when == "setup":
        excluded = _reason_for(key) is not None
        _outcomes[key] = "excluded" if excluded else "skipped"
    elif report.failed:
        _outcomes[key] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        _errors[key] = (crash.message if crash else str(report.longrepr))[:300]
    elif report.when == "call" and key not in _outcomes:
        _outcomes[key] = "passed"


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("UPSTREAM_TESTS_OUTCOMES")
    if out:
        Path(out).write_text(json.dumps({"outcomes": _outcomes, "errors": _errors}, indent=1))
