"""Known-wrong edits to the lab 04-05 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

LOADER = "mini_vllm/model_executor/model_loader/tp_loader.py"
LINEAR = "mini_vllm/model_executor/layers/linear.py"
VOCAB = "mini_vllm/model_executor/layers/vocab_parallel_embedding.py"

BUGS = [
    PlantedBug(
        name="replicas-by-rank-modulo",
        description="with more ranks than KV heads, rank r keeps KV head r % KV instead of "
        "r // (tp / KV): its query heads read another group's keys",
        file=LOADER,
        find="    return q_heads, range(rank // replicas, rank // replicas + 1)\n",
        replace="    return q_heads, range(rank % kv, rank % kv + 1)\n",
    ),
    PlantedBug(
        name="kv-split-by-query-heads",
        description="the KV heads' share is computed from the query heads' count (H/tp), so a "
        "GQA model's ranks read past their KV heads",
        file=LOADER,
        find="        kv_per_rank = kv // tp_size\n",
        replace="        kv_per_rank = config.num_attention_heads // tp_size\n",
    ),
    PlantedBug(
        name="replication-refused",
        description="check_tp_size accepts only sizes that split the KV heads evenly, refusing "
        "upstream's replication (tp a multiple of the KV heads)",
        file=LOADER,
        find="    fits = (heads % tp_size == 0 and (kv % tp_size == 0 or tp_size % kv == 0)\n",
        replace="    fits = (heads % tp_size == 0 and (kv % tp_size == 0)\n",
    ),
    PlantedBug(
        name="mlp-not-checked",
        description="check_tp_size forgets the MLP: a size that splits the heads but not the "
        "intermediate features is let through",
        file=LOADER,
        find="            and inter % tp_size == 0)\n    if not fits:",
        replace="            )\n    if not fits:",
    ),
    PlantedBug(
        name="o-proj-cut-by-kv-heads",
        description="o_proj keeps the columns of the rank's KV heads instead of its query "
        "heads, so the partial product mixes the wrong heads' outputs",
        file=LOADER,
        find="        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, q0, q1, tp)\n",
        replace="        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, k0, k0 + q1 - q0, "
        "tp)\n",
    ),
    PlantedBug(
        name="no-all-reduce",
        description="the row-parallel layer returns its partial product: every rank continues "
        "with its own share of the sum",
        file=LINEAR,
        find="        out = self.tp.all_reduce(linear(x, self.weight))\n",
        replace="        out = linear(x, self.weight)\n",
    ),
    PlantedBug(
        name="bias-before-the-reduce",
        description="the row-parallel layer adds its bias before the all-reduce, so the sum "
        "holds tp biases",
        file=LINEAR,
        find="        out = self.tp.all_reduce(linear(x, self.weight))\n"
        "        return out if self.bias is None else out + self.bias.to(out.dtype)\n",
        replace="        return self.tp.all_reduce(linear(x, self.weight, self.bias))\n",
    ),
    PlantedBug(
        name="column-shard-a-view",
        description="the column-parallel layer keeps a view of the whole weight's rows, not a "
        "copy: the whole weight stays alive and a change to it reaches the shard",
        file=LINEAR,
        find="        layer.weight = _parameter(full.weight[start:end])\n",
        replace="        layer.weight = nn.Parameter(full.weight[start:end], "
        "requires_grad=False)\n",
    ),
    PlantedBug(
        name="vocab-floor-division",
        description="each rank takes vocab // tp rows, so the last ids of a vocabulary that does "
        "not split evenly belong to no rank",
        file=VOCAB,
        find="    per_rank = math.ceil(vocab_size / tp.world_size)\n",
        replace="    per_rank = vocab_size // tp.world_size\n",
    ),
    PlantedBug(
        name="embedding-not-masked",
        description="the embedding sends the rows its clamped indices point at for every id, "
        "not zeros for the ids of other ranks",
        file=VOCAB,
        find="        rows = F.embedding(local, self.weight) * "
        "mine.unsqueeze(-1).to(self.weight.dtype)\n",
        replace="        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), "
        "self.weight)\n",
    ),
    PlantedBug(
        name="padding-logits-kept",
        description="the LM head returns the gathered logits with the padding columns, so the "
        "vocabulary looks larger (and its extra ids score 0)",
        file=VOCAB,
        find="        return logits[..., :self.vocab_size]\n",
        replace="        return logits\n",
    ),
    PlantedBug(
        name="tied-head-copied",
        description="with tied embeddings the LM head gets its own copy of the rows instead of "
        "the embedding's shard",
        file=VOCAB,
        find="        self.weight = tied.weight if tied is not None else "
        "_rows(full.weight, self.start,\n"
        "                                                                 self.end)\n",
        replace="        self.weight = _rows(full.weight, self.start, self.end)\n",
    ),
]
