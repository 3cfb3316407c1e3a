"""Linear layers split over the tensor-parallel group (Megatron-LM's scheme).

A ``[out, in]`` weight splits two ways. **Column-parallel**: each rank holds a slice of the
output features (rows of the weight) and computes its slice of the output from the whole input;
nothing is communicated. **Row-parallel**: each rank holds a slice of the input features
(columns of the weight), reads the matching slice of its input (exactly what a column-parallel
layer before it left) and computes a partial sum of the whole output; an all-reduce adds the
partials, and the bias is added once, after it. A column-parallel layer followed by a
row-parallel one (q/k/v then o, gate/up then down) costs one all-reduce of the output.

Each layer here is made from the whole layer (``from_full``) by keeping this rank's slice:
mini_vllm builds the whole model in every rank and cuts it
(:mod:`mini_vllm.model_executor.model_loader.tp_loader`). Upstream builds only the shards and
loads each rank's slice of each checkpoint tensor (the layers' ``weight_loader``), never holding
the whole model in one rank.

upstream: vllm/model_executor/layers/linear.py:436 @ v0.33.0
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed.parallel_state import TensorParallelGroup
from mini_vllm.model_executor.models.llama import Linear, linear


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, which must be exact (``what`` names the split).

    upstream: vllm/distributed/utils.py:130 @ v0.33.0
    """
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} does not split evenly over {denominator} ranks")
    return numerator // denominator


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone().contiguous(), requires_grad=False)


def _check_plain(full: nn.Linear) -> None:
    if getattr(full, "weight_format", None) is not None:
        raise ValueError("tensor parallelism needs unquantized weights; load the model without "
                         "GGUF blocks (a float checkpoint) to split it")


class ColumnParallelLinear(Linear):
    """Rows ``start:end`` of a whole layer's weight (and bias): this rank's slice of the output
    features, computed from the whole input.

    upstream: vllm/model_executor/layers/linear.py:436 @ v0.33.0
    """

    @classmethod
    def from_full(cls, full: nn.Linear, start: int, end: int) -> ColumnParallelLinear:
        """This rank's rows ``start:end`` of ``full``.

        upstream: vllm/model_executor/layers/linear.py:589 @ v0.33.0
        """
        _check_plain(full)
        layer = cls(full.in_features, end - start, bias=full.bias is not None,
                    device="meta")
        layer.weight = _parameter(full.weight[start:end])
        if full.bias is not None:
            layer.bias = _parameter(full.bias[start:end])
        return layer


class RowParallelLinear(Linear):
    """Columns ``start:end`` of a whole layer's weight: this rank's partial sum of the whole
    output from its slice of the input, all-reduced over the group; the bias (whole) is added
    after the reduce, so it counts once.

    upstream: vllm/model_executor/layers/linear.py:1653 @ v0.33.0
    """

    tp: TensorParallelGroup

    @classmethod
    def from_full(cls, full: nn.Linear, start: int, end: int,
                  tp: TensorParallelGroup) -> RowParallelLinear:
        """This rank's columns ``start:end`` of ``full``, reducing over ``tp``.

        upstream: vllm/model_executor/layers/linear.py:1772 @ v0.33.0
        """
        _check_plain(full)
        layer = cls(end - start, full.out_features, bias=full.bias is not None, device="meta")
        layer.weight = _parameter(full.weight[:, start:end])
        if full.bias is not None:
            layer.bias = _parameter(full.bias)
        layer.tp = tp
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias.to(out.dtype)
