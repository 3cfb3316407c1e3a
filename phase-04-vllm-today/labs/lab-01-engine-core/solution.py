"""Lab 04-01 reference: re-exports the engine core's pieces.

The code lives once, in ``mini_vllm`` (``engine/serial_utils.py``, ``engine/core_proc.py`` and
``engine/core_client.py``).
"""

from __future__ import annotations

from mini_vllm.engine.core_client import HEARTBEAT_TIMEOUT_S, core_failure
from mini_vllm.engine.core_proc import SHUTDOWN, EngineCoreProc
from mini_vllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from mini_vllm.engine.serial_utils import TENSOR_EXT, MsgpackDecoder, MsgpackEncoder

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "SHUTDOWN",
    "TENSOR_EXT",
    "EngineCoreAbort",
    "EngineCoreOutputs",
    "EngineCoreProc",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "core_failure",
]
