"""One tensor-parallel rank's shard of a whole model.

**Attention splits by heads.** Rank ``r`` of ``tp`` keeps query heads ``[r H/tp, (r+1) H/tp)``
(those rows of q_proj, those columns of o_proj) and the KV heads they read. With ``tp`` at most
the KV heads, each rank keeps ``KV/tp`` of them; with more ranks than KV heads (``tp`` a
multiple of ``KV``), each KV head is kept whole by ``tp/KV`` ranks (replicated, upstream's
``num_kv_head_replicas``). Either way a rank's query heads read only its own KV heads (a GQA
group never straddles two ranks' KV), and its KV cache holds those heads only: the cache splits
with the model. **The MLP splits its intermediate features**: gate and up by rows, down by
columns. **The vocabulary splits** across the embedding and the LM head
(:mod:`mini_vllm.model_executor.layers.vocab_parallel_embedding`). Norms and the rotary table
are whole in every rank. Per layer the ranks then meet twice (the all-reduces after o_proj and
down_proj), and once more per step to gather the logits.

upstream: vllm/model_executor/layers/linear.py:1011 @ v0.33.0 (QKVParallelLinear's head split)
"""

from __future__ import annotations

from mini_vllm.distributed.parallel_state import TensorParallelGroup
from mini_vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
)
from mini_vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Refuse a ``tp_size`` the model cannot be split into (a ``ValueError`` that says which
    sizes it can), before any process starts.

    upstream: vllm/config/model.py:1545 @ v0.33.0
    """
    heads, kv, inter = (config.num_attention_heads, config.num_key_value_heads,
                        config.intermediate_size)
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp_size!r}")
    fits = (heads % tp_size == 0 and (kv % tp_size == 0 or tp_size % kv == 0)
            and inter % tp_size == 0)
    if not fits:
        sizes = [n for n in range(1, heads + 1)
                 if heads % n == 0 and (kv % n == 0 or n % kv == 0) and inter % n == 0]
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not split this model ({heads} query heads, "
            f"{kv} KV heads, MLP of {inter}): the query heads and the MLP must split evenly, and "
            f"the KV heads split evenly or be replicated whole; use one of {sizes}")


def head_ranges(config: ModelConfig, tp_size: int, rank: int) -> tuple[range, range]:
    """Rank ``rank``'s query heads and KV heads (global indices).

    upstream: vllm/model_executor/layers/linear.py:1065 @ v0.33.0
    """
    check_tp_size(config, tp_size)
    per_rank = config.num_attention_heads // tp_size
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    kv = config.num_key_value_heads
    if tp_size <= kv:
        kv_per_rank = kv // tp_size
        return q_heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    replicas = tp_size // kv
    return q_heads, range(rank // replicas, rank // replicas + 1)


def shard_model(model: LlamaForCausalLM, tp: TensorParallelGroup) -> LlamaForCausalLM:
    """Cut ``model`` (whole, as loaded) to ``tp``'s rank's shard, in place, and return it.
    Call before anything fuses its projections (the engine's model runner does).

    upstream: vllm/model_executor/model_loader/default_loader.py:490 @ v0.33.0 (upstream loads
    each rank's slices straight from the checkpoint)
    """
    cfg = model.config
    q_heads, kv_heads = head_ranges(cfg, tp.world_size, tp.rank)
    if tp.world_size == 1:
        return model
    d = cfg.head_dim
    inter = divide(cfg.intermediate_size, tp.world_size, "the MLP's intermediate features")
    i0, i1 = tp.rank * inter, (tp.rank + 1) * inter
    q0, q1, k0, k1 = q_heads.start * d, q_heads.stop * d, kv_heads.start * d, kv_heads.stop * d
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear.from_full(attn.q_proj, q0, q1)
        attn.k_proj = ColumnParallelLinear.from_full(attn.k_proj, k0, k1)
        attn.v_proj = ColumnParallelLinear.from_full(attn.v_proj, k0, k1)
        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, q0, q1, tp)
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
        attn._qkv_fused = None
        mlp.gate_proj = ColumnParallelLinear.from_full(mlp.gate_proj, i0, i1)
        mlp.up_proj = ColumnParallelLinear.from_full(mlp.up_proj, i0, i1)
        mlp.down_proj = RowParallelLinear.from_full(mlp.down_proj, i0, i1, tp)
        mlp._gate_up_fused = None
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embed = VocabParallelEmbedding(model.model.embed_tokens, tp)
    model.lm_head = ParallelLMHead(model.lm_head, tp, embed if tied else None)
    model.model.embed_tokens = embed
    return model
