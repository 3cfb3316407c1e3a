"""Plain configuration dataclasses of mini_vllm (no model files, no engine arguments parsing).

Each dataclass checks its values once, in ``__post_init__``, and raises ``ValueError`` naming the
field; code that receives a config can trust it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mini_vllm.reservation import KV_RESERVATIONS

__all__ = ["PREEMPTION_MODES", "SchedulerConfig"]

# ---------------------------------------------------------------------------------------------
# Scheduler and KV-cache configuration (phase 03). The engine configuration is appended below
# this section by the engine's authors; keep the two apart.
# ---------------------------------------------------------------------------------------------

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    """Everything the scheduler needs: its budgets, the KV-cache geometry and the preemption mode.

    Upstream spreads these over ``SchedulerConfig`` and ``CacheConfig``; mini_vllm keeps one flat
    dataclass because the scheduler is the only reader.

    * ``max_num_seqs``: at most this many requests are RUNNING at once.
    * ``max_num_batched_tokens``: the per-step token budget (new tokens over all requests).
    * ``max_model_len``: prompt plus output never exceeds this many tokens.
    * ``block_size`` / ``num_gpu_blocks``: the paged cache (block 0 is the null block, so
      ``num_gpu_blocks - 1`` blocks are usable).
    * ``long_prefill_token_threshold``: when > 0, a request gets at most this many tokens per
      step, so that one long prompt cannot take the whole budget.
    * ``preemption_mode``: ``"recompute"`` (v1: drop the KV, recompute it later) or ``"swap"``
      (V0: copy the KV to ``num_cpu_blocks`` CPU blocks and back).
    * ``kv_reservation``: ``"paged"`` (blocks are claimed as a request grows) or an Orca-style
      policy of :mod:`mini_vllm.reservation` (``"max"``, ``"pow2"``, ``"oracle"``): a request
      claims the blocks of its whole reservation when it is admitted and keeps them until it
      finishes. Baselines for lab 03-06, not how vLLM runs.
    * ``static_batching``: admit new requests only when nothing runs, so a batch runs until its
      longest request finishes (FasterTransformer's batching; lab 03-06's baseline).

    upstream: vllm/config/scheduler.py:26 @ v0.11.0
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_gpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    kv_reservation: str = "paged"
    static_batching: bool = False

    def __post_init__(self) -> None:
        for name, low in (
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 1),
            ("block_size", 1),
            ("num_gpu_blocks", 2),
            ("long_prefill_token_threshold", 0),
            ("num_cpu_blocks", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SchedulerConfig: {name} must be an int >= {low}, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"SchedulerConfig: block_size must be a power of two, got {self.block_size}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"SchedulerConfig: preemption_mode must be one of {PREEMPTION_MODES}, "
                f"got {self.preemption_mode!r}"
            )
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(
                f"SchedulerConfig: kv_reservation must be one of {KV_RESERVATIONS}, "
                f"got {self.kv_reservation!r}"
            )
        if not isinstance(self.static_batching, bool):
            raise ValueError(
                f"SchedulerConfig: static_batching must be True or False, "
                f"got {self.static_batching!r}"
            )
        if self.preemption_mode == "swap" and self.num_cpu_blocks < 2:
            # The CPU pool reserves block 0 like the GPU pool, so one usable block needs two.
            raise ValueError(
                "SchedulerConfig: preemption_mode='swap' needs num_cpu_blocks >= 2 "
                f"(got {self.num_cpu_blocks}); give the CPU pool room for the swapped KV"
            )
