"""The embedding and the LM head split over the vocabulary.

Each rank holds ``ceil(vocab / tp)`` consecutive rows of the vocabulary (the last rank's tail
padded with zero rows). **Embedding**: a rank looks up the ids in its range and writes zeros for
the others; an all-reduce of the ``[tokens, hidden]`` result gives every rank every token's row
(exactly one rank contributed it). **LM head**: a rank computes the logits of its rows; an
all-gather along the vocabulary puts them end to end, and the padding columns are cut. With tied
embeddings the head's shard is the embedding's shard (one parameter, as before the split).

upstream: vllm/model_executor/layers/vocab_parallel_embedding.py:206 @ v0.33.0
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.distributed.parallel_state import TensorParallelGroup
from mini_vllm.model_executor.models.llama import linear


def vocab_range(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """``(start, end)`` of this rank's rows (``end`` may pass ``vocab_size``: padding).

    upstream: vllm/model_executor/layers/vocab_parallel_embedding.py:108 @ v0.33.0
    """
    per_rank = math.ceil(vocab_size / tp.world_size)
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def _rows(weight: torch.Tensor, start: int, end: int) -> nn.Parameter:
    shard = torch.zeros(end - start, weight.shape[1], dtype=weight.dtype, device=weight.device)
    real = weight[start:end]
    shard[:real.shape[0]] = real.detach()
    return nn.Parameter(shard, requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ``forward`` returns every token's embedding.

    upstream: vllm/model_executor/layers/vocab_parallel_embedding.py:206 @ v0.33.0
    """

    def __init__(self, full: nn.Embedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, full.num_embeddings
        self.start, self.end = vocab_range(self.vocab_size, tp)
        self.weight = _rows(full.weight, self.start, self.end)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """This rank's rows of the LM head; ``forward`` returns the logits over the whole vocabulary.

    upstream: vllm/model_executor/layers/vocab_parallel_embedding.py:578 @ v0.33.0
    """

    def __init__(self, full: nn.Linear, tp: TensorParallelGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        if getattr(full, "weight_format", None) is not None:
            raise ValueError("tensor parallelism needs an unquantized LM head")
        self.tp, self.vocab_size = tp, full.out_features
        self.start, self.end = vocab_range(self.vocab_size, tp)
        self.weight = tied.weight if tied is not None else _rows(full.weight, self.start,
                                                                 self.end)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """upstream: vllm/model_executor/layers/logits_processor.py:122 @ v0.33.0"""
        logits = self.tp.all_gather(linear(hidden_states, self.weight), dim=-1)
        return logits[..., :self.vocab_size]
