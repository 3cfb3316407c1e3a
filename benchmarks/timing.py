"""Time spent inside chosen methods of a running engine, summed across calls.

A benchmark wraps the methods it wants to account for (a scheduler's ``schedule``, a runner's
``_prepare_inputs``) on the instance, runs, reads the total and unwraps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopwatch:
    """Seconds spent in the methods :meth:`wrap` put on an instance, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._wrapped: list[tuple[object, str]] = []

    def wrap(self, owner: object, *names: str) -> None:
        """Time ``owner.<name>`` for each name, on the instance (its class is untouched)."""
        for name in names:
            setattr(owner, name, self._timed(getattr(owner, name)))
            self._wrapped.append((owner, name))

    def unwrap(self) -> None:
        """Put every wrapped method back (the instance's own attribute goes)."""
        for owner, name in self._wrapped:
            vars(owner).pop(name, None)
        self._wrapped.clear()

    def _timed(self, method: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call
