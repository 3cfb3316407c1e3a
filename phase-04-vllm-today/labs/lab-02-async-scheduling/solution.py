"""Lab 04-02 reference: re-exports asynchronous scheduling's pieces.

The code lives once, in ``mini_vllm`` (``core/sched/async_scheduler.py`` and ``engine/core.py``).
"""

from __future__ import annotations

from mini_vllm.core.sched.async_scheduler import AsyncScheduler
from mini_vllm.engine.core import BATCH_QUEUE_SIZE, EngineCore

__all__ = ["BATCH_QUEUE_SIZE", "AsyncScheduler", "EngineCore"]
