"""Predict, then measure: removing a block from the middle of the free queue as it grows.

`python -m course measure 02-01 --plot free_queue.png` runs this on your starter.py and on the
reference, beside a deque of block ids (what `collections.deque.remove` must do: find the block by
scanning). Answer the README's "Predict, then measure" questions before you look.
"""

from __future__ import annotations

import time
from collections import deque

TITLE = "Taking a block out of the middle of the free queue"
X_LABEL = "free blocks in the queue"
Y_LABEL = "microseconds per removal (best of 5 rounds)"
LOG_X = LOG_Y = True
REMOVALS = 64  # blocks taken out around the middle in each round
ROUNDS = 5


def sizes(quick: bool) -> list[int]:
    return [1_000, 10_000, 100_000] if quick else [1_000, 3_000, 10_000, 30_000, 100_000, 300_000]


def _middle(n: int) -> range:
    return range(n // 2 - REMOVALS // 2, n // 2 + REMOVALS // 2)


def run(impl, n: int) -> float:
    """Your FreeKVCacheBlockQueue (or the reference's): microseconds per `remove` of a block in
    the middle of a queue of n blocks. Only the removals are timed, not building the queue."""
    best = float("inf")
    for _ in range(ROUNDS):
        blocks = [impl.KVCacheBlock(i) for i in range(n)]
        queue = impl.FreeKVCacheBlockQueue(blocks)
        victims = [blocks[i] for i in _middle(n)]
        start = time.perf_counter()
        for block in victims:
            queue.remove(block)
        best = min(best, time.perf_counter() - start)
    return best / REMOVALS * 1e6


def deque_remove(n: int) -> float:
    """The same removals from a collections.deque of block ids: deque.remove scans for the
    value, as any array- or deque-backed queue must."""
    best = float("inf")
    for _ in range(ROUNDS):
        queue = deque(range(n))
        victims = list(_middle(n))
        start = time.perf_counter()
        for block_id in victims:
            queue.remove(block_id)
        best = min(best, time.perf_counter() - start)
    return best / REMOVALS * 1e6


BASELINES = {"deque.remove (scans)": deque_remove}
