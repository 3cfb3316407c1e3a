"""Run the newest vLLM release's own unit tests for the block pool, the free queue, the hashing,
prefix caching, the scheduler (synchronous and async) and the rejection sampler against
mini_vllm (with today's behaviour on), and count the outcomes, file by file.

    python upstream_refs/upstream_tests/run.py [--impl solution|stretch] [--vllm-src DIR]
                                               [--json PATH]

The test files are read from the release's source at run time, never copied into the course
(fetch it with ``python -m course refs --fetch``). Every item passes, fails, or is
excluded with a written reason (``upstream_refs/left_out/upstream_tests.toml``). Exit status: 0
when no item fails and no exclusion is stale (names nothing, or a test that passes), 1
otherwise, 2 when the source is not there.

upstream: none (course-only: the bridge to the newest release's tests)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from exclusions import load_document, load_exclusions  # noqa: E402

# The upstream files that test the pieces the course rebuilds (relative to tests/v1/): the
# block pool, hashing, prefix caching and the scheduler, then the rejection sampler. The stretch
# (lab 02-01) swaps in the student's block pool and hashing only, so its runs skip the sampler.
CORE_FILES = (
    "core/test_kv_cache_utils.py",
    "core/test_prefix_caching.py",
    "core/test_single_type_kv_cache_manager.py",
    "core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "core/test_scheduler.py",
    "core/test_async_scheduler.py",
)
SAMPLE_FILES = ("sample/test_rejection_sampler.py",)
TEST_FILES = CORE_FILES + SAMPLE_FILES


def files_for(impl: str) -> tuple[str, ...]:
    """The files a run of ``impl`` takes."""
    return TEST_FILES if impl == "solution" else CORE_FILES


def release() -> str:
    """The newest release the course bridges to (the exclusions were written against it)."""
    return load_document()["version"]


def find_source(given: str | None = None) -> Path | None:
    """The release's unpacked source: ``given``, ``$VLLM_SRC_TODAY``, or where
    ``course refs --fetch`` puts it (``${VLLM_SRC_CACHE:-~/.cache/vllm-src}/vVERSION``)."""
    cache = Path(os.environ.get("VLLM_SRC_CACHE", Path.home() / ".cache" / "vllm-src"))
    for candidate in (given, os.environ.get("VLLM_SRC_TODAY"), cache / f"v{release()}"):
        if candidate and (Path(candidate) / "tests" / "v1" / "core").is_dir():
            return Path(candidate)
    return None


def run(src: Path, impl: str = "solution", today: bool = True) -> dict:
    """Run the files in a fresh interpreter; return the counts and every item's outcome."""
    with tempfile.TemporaryDirectory(prefix="upstream-tests-") as tmp:
        outcomes_file = Path(tmp) / "outcomes.json"
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        env = dict(os.environ, UPSTREAM_TESTS_IMPL=impl,
                   UPSTREAM_TESTS_TODAY=str(int(today)),
                   UPSTREAM_TESTS_OUTCOMES=str(outcomes_file),
                   PYTHONPATH=os.pathsep.join([str(HERE), str(src), str(REPO)]))
        env.pop("PYTHONHASHSEED", None)  # the tests set it themselves where it matters
        # --noconftest: upstream's conftest files need the whole of vLLM. --tb=no: a traceback
        # into a 6,000-line test file costs a second; the plugin keeps each failure's message.
        cmd = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "plugin",
               "-p", "no:cacheprovider", "--noconftest", "--continue-on-collection-errors",
               "-c", str(ini), "--rootdir", str(src), "-W", "ignore",
               *[f"tests/v1/{f}" for f in files_for(impl)]]
        proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
        if not outcomes_file.exists():
            said = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
            detail = "" if said[-1].startswith("ERROR:") else "\n" + "\n".join(said[-40:])
            raise RuntimeError(f"the upstream test run stopped before any test ran: "
                               f"{said[-1].removeprefix('ERROR: ')}{detail}")
        data = json.loads(outcomes_file.read_text())
    outcomes, errors = data["outcomes"], data["errors"]
    counts = {k: sum(1 for v in outcomes.values() if v == k)
              for k in ("passed", "failed", "excluded", "skipped", "uncollected")}
    exclusions = {item: reason for item, reason in load_exclusions().items()
                  if item.split("::", 1)[0] in files_for(impl)}
    stale = sorted(item for item in exclusions
                   if not any(_covers(item, key) for key in outcomes)
                   or all(outcomes[key] == "passed" for key in outcomes if _covers(item, key)))
    failing = {k: errors.get(k, "") for k, v in outcomes.items()
               if v in ("failed", "uncollected", "skipped")}
    return {"counts": counts, "failing": failing, "stale_exclusions": stale,
            "outcomes": outcomes, "by_file": by_file(outcomes, files_for(impl))}


def by_file(outcomes: dict[str, str], files_run: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per upstream test file (in ``files_run`` order): its items, and how many passed, failed
    or were excluded."""
    files: dict[str, dict[str, int]] = {
        f: {"items": 0, "passed": 0, "failed": 0, "excluded": 0} for f in files_run}
    for key, outcome in outcomes.items():
        row = files.setdefault(key.split("::", 1)[0], {"items": 0, "passed": 0, "failed": 0,
                                                        "excluded": 0})
        row["items"] += 1
        row[outcome if outcome in ("passed", "excluded") else "failed"] += 1
    return files


def _covers(item: str, key: str) -> bool:
    base = key.split("[", 1)[0]
    return item in (key, base, base.split("::", 1)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("solution", "stretch"), default="solution",
                        help="the reference (default) or your lab 02-01 stretch")
    parser.add_argument("--vllm-src", help="the unpacked release (default: where "
                        "`python -m course refs --fetch` puts it)")
    parser.add_argument("--pinned", action="store_true",
                        help="keep v0.11.0's behaviour (the switch off): which tests tell the "
                        "two apart")
    parser.add_argument("--json", help="write the counts and the command here (with the "
                        "counts of a second run with the switch off)")
    args = parser.parse_args(argv)
    src = find_source(args.vllm_src)
    if src is None:
        print(f"the vLLM {release()} source is not here: fetch it with `python -m course refs "
              "--fetch` (or pass --vllm-src DIR)")
        return 2
    try:
        result = run(src, args.impl, today=not args.pinned)
    except RuntimeError as error:
        print(error)
        return 1
    counts = result["counts"]
    total = sum(counts.values())
    behaviour = "v0.11.0's behaviour" if args.pinned else "today's behaviour on"
    print(f"vLLM {release()}'s tests/v1 against mini_vllm ({args.impl}, {behaviour}): "
          f"{counts['passed']} passed, {counts['failed']} failed, {counts['excluded']} "
          f"excluded with a reason, of {total} items")
    for name, row in result["by_file"].items():
        print(f"  {name}: {row['items']} items, {row['passed']} passed, {row['failed']} failed, "
              f"{row['excluded']} excluded")
    for key, error in sorted(result["failing"].items()):
        print(f"  FAILED {key}: {error}")
    for item in result["stale_exclusions"]:
        print(f"  STALE exclusion (names nothing, or only passing items): {item}")
    if args.json:
        reasons: dict[str, int] = {}
        exclusions = load_exclusions()
        for key, outcome in result["outcomes"].items():
            if outcome == "excluded":
                reason = next(exclusions[i] for i in exclusions if _covers(i, key))
                reasons[reason] = reasons.get(reason, 0) + 1
        # The same run with the switch off: the items that tell v0.11.0's behaviour from today's.
        off = run(src, args.impl, today=False)
        Path(args.json).write_text(json.dumps({
            "command": "python upstream_refs/upstream_tests/run.py --impl "
                       f"{args.impl}{' --pinned' if args.pinned else ''} --json {args.json}",
            "behaviour": "v0.11.0" if args.pinned else "today",
            "release": release(),
            "impl": args.impl,
            "files": [f"tests/v1/{f}" for f in files_for(args.impl)],
            "counts": counts,
            "by_file": result["by_file"],
            "failing": result["failing"],
            "excluded_by_reason": reasons,
            "excluded_list": "upstream_refs/left_out/upstream_tests.toml",
            "with_the_switch_off": {
                "command": f"python upstream_refs/upstream_tests/run.py --impl {args.impl} "
                           "--pinned",
                "counts": off["counts"],
                "failing": sorted(off["failing"]),
            },
        }, indent=2) + "\n", encoding="utf-8")
    return 0 if not result["failing"] and not result["stale_exclusions"] else 1


if __name__ == "__main__":
    sys.exit(main())
