"""``n`` completions of one prompt: the parameters of each child request.

upstream: vllm/v1/engine/parallel_sampling.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mini_vllm.sampling_params import SamplingParams

__all__ = ["child_sampling_params"]


def child_sampling_params(params: SamplingParams, j: int, extra_eos: list[int]) -> SamplingParams:
    """The parameters of child `j` of a request asking for `params.n` outputs. Children of one
    prompt differ: a seeded parent gives seed + j (as upstream). generation_config.json's other
    EOS ids (`extra_eos`) stop like EOS unless EOS is ignored (as upstream).

    upstream: vllm/v1/engine/parallel_sampling.py:12 @ v0.11.0 (ParentRequest)"""
    changes: dict[str, Any] = {}
    if params.n > 1:
        changes["n"] = 1
        if params.seed is not None:
            changes["seed"] = params.seed + j
    if extra_eos and not params.ignore_eos:
        changes["stop_token_ids"] = [*params.stop_token_ids, *extra_eos]
    return dataclasses.replace(params, **changes) if changes else params
