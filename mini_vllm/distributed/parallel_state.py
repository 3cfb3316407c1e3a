"""The tensor-parallel group: which rank this process is, how many ranks there are, and the two
collectives a Megatron-style split of the model needs (an all-reduce after each row-parallel
layer, an all-gather of the vocabulary-parallel logits).

One process per rank, joined by ``torch.distributed``: gloo on CPUs (upstream uses NCCL on
GPUs, with its own all-reduce kernels for small messages). A process that never joined is a
group of one, whose collectives return their input: the single-process engine runs the same
layers. Every collective is counted (calls and payload bytes), which is how the course measures
what tensor parallelism costs per token.

upstream: vllm/distributed/parallel_state.py:427 @ v0.33.0
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """What this rank's collectives moved: calls, and payload bytes (the tensor each rank
    contributes; a ring all-reduce sends about twice that over each link).

    upstream: none (the course's measurement of tensor parallelism)
    """

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_gathers: int = 0
    all_gather_bytes: int = 0


class TensorParallelGroup:
    """This process's place in the tensor-parallel group, and the group's collectives.

    ``peers``: instead of a ``torch.distributed`` group, a callable ``peers(op, rank, tensor)``
    that answers each collective of this rank (``op``: ``"all_reduce"``, or ``"all_gather"``
    with ``dim=`` too) with its result: one rank run alone, its peers simulated. Tests split a
    model that way, one rank after another, with no process or network (lab 04-05's do).

    Invariant: every rank calls the same collectives in the same order with tensors of the same
    shape (each rank runs the same model code on the same batch); a rank that skips one leaves
    the others waiting until the timeout given at :func:`init_tensor_parallel`.

    upstream: vllm/distributed/parallel_state.py:427 @ v0.33.0
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, *,
                 peers: Callable[..., torch.Tensor] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"TensorParallelGroup: rank {rank} is not in 0..{world_size - 1}")
        self.rank, self.world_size, self.group, self.peers = rank, world_size, group, peers
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the ranks (a new tensor; ``x`` is unchanged).

        upstream: vllm/distributed/parallel_state.py:726 @ v0.33.0
        """
        if self.world_size == 1:
            return x
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += x.numel() * x.element_size()
        if self.peers is not None:
            return self.peers("all_reduce", self.rank, x.detach().clone())
        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order.

        upstream: vllm/distributed/parallel_state.py:754 @ v0.33.0
        """
        if self.world_size == 1:
            return x
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += x.numel() * x.element_size()
        if self.peers is not None:
            return self.peers("all_gather", self.rank, x.detach().clone(), dim=dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


_TP = TensorParallelGroup()


def init_tensor_parallel(rank: int, world_size: int, init_method: str, *,
                         backend: str = "gloo", timeout_s: float = 120.0) -> TensorParallelGroup:
    """Join the group of ``world_size`` processes as ``rank`` (every rank calls this with the
    same ``init_method``, e.g. ``"file:///tmp/x"`` or ``"tcp://127.0.0.1:PORT"``) and make it
    this process's group. A collective that waits longer than ``timeout_s`` on another rank
    raises instead of hanging.

    upstream: vllm/distributed/parallel_state.py:1837 @ v0.33.0
    """
    global _TP
    if _TP.world_size > 1 or dist.is_initialized():
        raise RuntimeError("init_tensor_parallel: this process already joined a group; call "
                           "destroy_tensor_parallel() first")
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _TP = TensorParallelGroup(rank, world_size, dist.group.WORLD)
    else:
        _TP = TensorParallelGroup()
    return _TP


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel group (a group of one unless it joined one).

    upstream: vllm/distributed/parallel_state.py:1594 @ v0.33.0
    """
    return _TP


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent); the process is a group of one again.

    upstream: vllm/distributed/parallel_state.py:2539 @ v0.33.0
    """
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup()
