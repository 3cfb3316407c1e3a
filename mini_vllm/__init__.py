"""mini_vllm: a small, faithful rebuild of vLLM's core, written lab by lab in this course.

``import mini_vllm`` is cheap: it does not import torch. ``mini_vllm.LLM`` and
``mini_vllm.SamplingParams`` are loaded on first access::

    from mini_vllm import LLM, SamplingParams
    llm = LLM()                       # the tiny Shakespeare model shipped with the course
    out = llm.generate("ROMEO.\n", SamplingParams(temperature=0.0, max_tokens=80))
    print(out[0].text)

The packages follow vLLM's (``upstream_refs/layout.toml`` maps each module): ``core/`` is
``vllm/v1/core/``, ``engine/`` is ``vllm/v1/engine/``, and so on.

upstream: vllm/ (and vllm/v1/, folded into one namespace)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["LLM", "SamplingParams"]

# name -> module that defines it; imported lazily by __getattr__ (PEP 562).
_LAZY = {"LLM": "mini_vllm.entrypoints.llm", "SamplingParams": "mini_vllm.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # cache: later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'mini_vllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
