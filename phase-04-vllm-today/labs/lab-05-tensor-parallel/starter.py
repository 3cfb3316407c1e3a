"""Lab 04-05 starter: tensor parallelism.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-05 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

You write how a Llama splits over ``tp`` ranks: which heads a rank keeps (task 1), the two
ways a linear layer splits (task 2), the vocabulary split of the embedding and the LM head
(task 3), and the cut of a whole model into one rank's shard (task 4). Given, in ``mini_vllm``:
the group (``TensorParallelGroup``: ``rank``, ``world_size``, ``all_reduce(x)``,
``all_gather(x, dim)``), the plain ``Linear`` and ``linear``, and the executor that starts one
process per rank and runs your shard in each (``mini_vllm/executor/multiproc_executor.py``).

A collective is the only way ranks exchange anything, and every rank must make the same calls
in the same order. The tests run one rank at a time against *simulated peers*: a group whose
collectives answer with the whole model's value at that point and keep what your rank
contributed; the contributions of all ranks must then add up to the truth, call by call.

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-04-vllm-today/labs/lab-05-tensor-parallel -q
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed.parallel_state import TensorParallelGroup
from mini_vllm.model_executor.layers.linear import _parameter  # noqa: F401 (yours to use)
from mini_vllm.model_executor.layers.vocab_parallel_embedding import _rows  # rows, zero-padded
from mini_vllm.model_executor.models.llama import (  # noqa: F401 (linear: yours to use)
    Linear,
    LlamaForCausalLM,
    ModelConfig,
    linear,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "check_tp_size",
    "head_ranges",
    "shard_model",
    "vocab_range",
]


# ---------------------------------------------------------------------------- task 1


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Task 1. Raise ``ValueError`` unless ``config`` splits over ``tp_size`` ranks: the query
    heads and the MLP's ``intermediate_size`` split evenly, and the KV heads either split evenly
    (``num_key_value_heads % tp_size == 0``) or are replicated whole (``tp_size`` a multiple of
    them). The message names ``tensor_parallel_size={tp_size}`` and ends with the sizes that do
    split the model, from 1 to the number of query heads: ``use one of [1, 2, 4]``. A
    ``tp_size`` that is not a positive int is a ``ValueError`` too.
    """
    raise NotImplementedError(
        "lab 04-05, task 1: implement check_tp_size (hint: python -m course hint 04-05 1)")


def head_ranges(config: ModelConfig, tp_size: int, rank: int) -> tuple[range, range]:
    """Task 1. Rank ``rank``'s query heads and KV heads, as ranges of global head indices.

    Query heads: ``H / tp`` consecutive heads, rank 0 first. KV heads: with ``tp <= KV``,
    ``KV / tp`` consecutive heads, rank 0 first; with ``tp > KV``, the one KV head its query
    heads read (``tp / KV`` consecutive ranks keep the same KV head). Either way a query head
    ``h`` of the rank reads KV head ``h // (H / KV)``, which the rank keeps. Checks the size
    first (:func:`check_tp_size`).
    """
    raise NotImplementedError(
        "lab 04-05, task 1: implement head_ranges (hint: python -m course hint 04-05 1)")


# ---------------------------------------------------------------------------- task 2


class ColumnParallelLinear(Linear):
    """A slice of a whole layer's output features: this rank's rows of its weight."""

    @classmethod
    def from_full(cls, full: nn.Linear, start: int, end: int) -> ColumnParallelLinear:
        """Task 2. A layer holding rows ``start:end`` of ``full``'s weight (and of its bias,
        when it has one), as parameters of their own (``_parameter``: a shard must not be a
        view of the whole weight, or the whole weight stays alive): its forward (the
        inherited one) computes those output features from the whole input, and its
        ``in_features`` / ``out_features`` are the shard's. A layer whose weight holds GGUF
        blocks (``getattr(full, "weight_format", None)`` set) is a ``ValueError`` whose message
        says the weights must be unquantized.
        """
        raise NotImplementedError(
            "lab 04-05, task 2: implement ColumnParallelLinear.from_full "
            "(hint: python -m course hint 04-05 2)")


class RowParallelLinear(Linear):
    """A slice of a whole layer's input features: this rank's columns of its weight."""

    tp: TensorParallelGroup

    @classmethod
    def from_full(cls, full: nn.Linear, start: int, end: int,
                  tp: TensorParallelGroup) -> RowParallelLinear:
        """Task 2. A layer holding columns ``start:end`` of ``full``'s weight (its own copy),
        the whole bias (when ``full`` has one), and ``tp``, the group it reduces over; its
        ``in_features`` / ``out_features`` are the shard's. Quantized weights: as
        :meth:`ColumnParallelLinear.from_full`.
        """
        raise NotImplementedError(
            "lab 04-05, task 2: implement RowParallelLinear.from_full "
            "(hint: python -m course hint 04-05 2)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Task 2. ``x`` is this rank's slice of the input features. Return the whole output:
        this rank's partial product (no bias), summed over the ranks with one
        ``self.tp.all_reduce``, plus the bias once (in the output's dtype).
        """
        raise NotImplementedError(
            "lab 04-05, task 2: implement RowParallelLinear.forward "
            "(hint: python -m course hint 04-05 2)")


# ---------------------------------------------------------------------------- task 3


def vocab_range(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """Task 3. ``(start, end)``: this rank's rows of the vocabulary, ``ceil(vocab_size /
    world_size)`` of them, rank 0 first. The last rank's ``end`` may pass ``vocab_size`` (its
    rows past the vocabulary are padding).
    """
    raise NotImplementedError(
        "lab 04-05, task 3: implement vocab_range (hint: python -m course hint 04-05 3)")


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (``self.weight``, rows ``self.start:self.end`` of the
    whole one, zero rows past the vocabulary)."""

    def __init__(self, full: nn.Embedding, tp: TensorParallelGroup) -> None:
        """Given."""
        super().__init__()
        self.tp, self.vocab_size = tp, full.num_embeddings
        self.start, self.end = vocab_range(self.vocab_size, tp)
        self.weight = _rows(full.weight, self.start, self.end)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Task 3. Every token's embedding ``[*input_ids.shape, hidden]``: this rank contributes
        the rows of the ids in its range and zeros for the others (never indexing outside
        ``self.weight``), and one ``self.tp.all_reduce`` sums the contributions.
        """
        raise NotImplementedError(
            "lab 04-05, task 3: implement VocabParallelEmbedding.forward "
            "(hint: python -m course hint 04-05 3)")


class ParallelLMHead(nn.Module):
    """This rank's rows of the LM head (``self.weight``; with tied embeddings, the embedding's
    shard itself)."""

    def __init__(self, full: nn.Linear, tp: TensorParallelGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        """Given."""
        super().__init__()
        self.tp, self.vocab_size = tp, full.out_features
        self.start, self.end = vocab_range(self.vocab_size, tp)
        self.weight = tied.weight if tied is not None else _rows(full.weight, self.start,
                                                                 self.end)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Task 3. The logits over the whole vocabulary ``[..., vocab_size]``: this rank's
        logits (``linear`` of the hidden states and its rows), the ranks' put end to end along
        the last dimension by one ``self.tp.all_gather``, the padding columns cut.
        """
        raise NotImplementedError(
            "lab 04-05, task 3: implement ParallelLMHead.forward "
            "(hint: python -m course hint 04-05 3)")


# ---------------------------------------------------------------------------- task 4


def shard_model(model: LlamaForCausalLM, tp: TensorParallelGroup) -> LlamaForCausalLM:
    """Task 4. Cut ``model`` (whole, as loaded) to rank ``tp.rank``'s shard, in place, and
    return it; a group of one leaves it as it is (after the size check).

    Every layer: q_proj keeps the rows of the rank's query heads, k_proj and v_proj those of its
    KV heads (column-parallel), o_proj the same columns as q_proj (row-parallel); the attention
    module's ``num_heads`` and ``num_kv_heads`` become the rank's counts and its fusion
    (``_qkv_fused``) is dropped. The MLP: gate_proj and up_proj keep the rank's ``1/tp`` of the
    intermediate features (rows), down_proj the same columns; ``_gate_up_fused`` dropped. The
    embedding and the LM head become their vocabulary-parallel versions; with tied embeddings
    (``lm_head.weight is embed_tokens.weight``) the head shares the embedding's shard.
    """
    raise NotImplementedError(
        "lab 04-05, task 4: implement shard_model (hint: python -m course hint 04-05 4)")
