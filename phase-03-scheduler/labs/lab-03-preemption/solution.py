"""Lab 03-03 solution: the reference lives in ``mini_vllm.core.swap`` (the CPU swap space) and
``mini_vllm.core.sched.scheduler`` (preemption by swapping and the swapped queue)."""

from __future__ import annotations

from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.core.swap import SwapSpace

__all__ = ["Scheduler", "SwapSpace"]
