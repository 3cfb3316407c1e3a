"""The two ways a request can fail inside the engine, as the caller sees them.

upstream: vllm/v1/engine/exceptions.py:3 @ v0.11.0
"""

from __future__ import annotations

__all__ = ["EngineDeadError", "EngineGenerateError"]


class EngineGenerateError(RuntimeError):
    """A step failed while the request was in flight; the engine recovered and serves on.

    upstream: vllm/v1/engine/exceptions.py:3 @ v0.11.0
    """


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more (it was shut down, or its core died): start a new one.

    upstream: vllm/v1/engine/exceptions.py:8 @ v0.11.0
    """
