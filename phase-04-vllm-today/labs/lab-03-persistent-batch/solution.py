"""Lab 04-03 reference: re-exports the persistent batch's pieces.

The code lives once, in ``mini_vllm`` (``worker/input_batch.py``, ``worker/block_table.py`` and
``worker/persistent_runner.py``).
"""

from __future__ import annotations

import numpy as np  # noqa: F401  (as the starter: the tests make arrays where the lab runs)

from mini_vllm.worker.block_table import BlockTable
from mini_vllm.worker.input_batch import InputBatch
from mini_vllm.worker.persistent_runner import PersistentBatchRunner

__all__ = ["BlockTable", "InputBatch", "PersistentBatchRunner"]
