"""What the course prints on a terminal: a plain-text table and a progress line per finished item.

Used by every command that reports on labs (the dashboard, `course engine`, `course check`, the
grader's reports); it imports nothing of the course.
"""

from __future__ import annotations

import os
import sys
import time


class Progress:
    """One line per finished item; a live "running ..." line on a terminal."""

    def __init__(self, total: int, verb: str):
        self.total, self.done, self.verb = total, 0, verb
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def started(self, what: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r\033[K  {self.verb} {what} ...")
            sys.stderr.flush()

    def finished(self, line: str) -> None:
        self.done += 1
        prefix = "\r\033[K" if self.tty else ""
        sys.stderr.write(f"{prefix}  [{self.done}/{self.total}] {line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write(f"  finished in {time.perf_counter() - self.start:.0f} s\n\n")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def workers(n: int | None) -> int:
    """How many labs run at once: ``n``, or at most 2 (each lab's pytest is one process)."""
    return max(1, n or min(2, os.cpu_count() or 1))
