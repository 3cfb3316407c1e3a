"""Lab 04-07 solution: the reference lives in ``mini_vllm.entrypoints.router``."""

from __future__ import annotations

from mini_vllm.entrypoints.router import PrefixRouter, prompt_block_hashes

__all__ = ["PrefixRouter", "prompt_block_hashes"]
