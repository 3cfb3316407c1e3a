"""Lab 03-01 solution: the reference scheduler lives in ``mini_vllm.core.sched.scheduler``."""

from __future__ import annotations

from mini_vllm.core.sched.scheduler import Scheduler, SchedulerStats, check_stop

__all__ = ["Scheduler", "SchedulerStats", "check_stop"]
