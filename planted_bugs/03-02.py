"""Known-wrong edits to the reference metadata builder and chunked-prefill attention that lab
03-02's tests must reject."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

META = "mini_vllm/attention/metadata.py"
ATTN = "mini_vllm/attention/chunked_prefill.py"

BUGS = [
    PlantedBug(
        name="query-start-loc-off-by-one",
        description="query_start_loc is the inclusive running sum shifted left (no leading 0)",
        file=META,
        find="torch.cumsum(query_lens, dim=0, out=out[1:])",
        replace="torch.cumsum(query_lens, dim=0, out=out[:-1])",
    ),
    PlantedBug(
        name="positions-ignore-context",
        description="a chunk's positions start at 0 instead of after its context",
        file=META,
        find="[c + j for c, q in zip(context_list, query_list) for j in range(q)]",
        replace="[j for c, q in zip(context_list, query_list) for j in range(q)]",
    ),
    PlantedBug(
        name="slot-ignores-block-table",
        description="the slot is the token's position, as if each sequence's blocks were "
        "contiguous",
        file=META,
        find="return block_numbers * block_size + positions.long() % block_size",
        replace="return positions.long() + 0 * block_numbers",
    ),
    PlantedBug(
        name="decode-threshold-off-by-one",
        description="a one-token query is not counted as a decode",
        file=META,
        find="is_decode = [q <= decode_threshold for q in query_list]",
        replace="is_decode = [q < decode_threshold for q in query_list]",
    ),
    PlantedBug(
        name="mask-not-offset-by-context",
        description="the causal mask of a chunk starts at position 0, ignoring its context",
        file=ATTN,
        find="q_pos = ctx + torch.arange(q_len, device=dev)",
        replace="q_pos = 0 * ctx + torch.arange(q_len, device=dev)",
    ),
    PlantedBug(
        name="reorder-keeps-order",
        description="the batch is never reordered, so decodes can follow prefills",
        file=META,
        find="        if decode_idx < num_decodes:\n            break",
        replace="        if decode_idx >= 0:\n            break",
    ),
    PlantedBug(
        name="slot-mapping-in-int32",
        description="the block ids stay int32 when they are multiplied by the block size, so the "
        "slots of a large cache wrap around past 2**31",
        file=META,
        find="block_numbers = block_tables[req_indices.long(), positions.long() // block_size]"
        ".long()",
        replace="block_numbers = block_tables[req_indices.long(), positions.long() // block_size]",
    ),
    PlantedBug(
        name="table-check-refuses-an-exact-fit",
        description="a block table that holds exactly context + query slots is refused (<= for <)",
        file=META,
        find="if len(block_tables[r]) * block_size < ctx + q:",
        replace="if len(block_tables[r]) * block_size <= ctx + q:",
    ),
    PlantedBug(
        name="max-decode-seq-len-over-the-whole-batch",
        description="max_decode_seq_len is taken over every sequence, prefills included (and is "
        "not 0 when there are no decodes)",
        file=META,
        find="max_decode_seq_len=max(seq_list[:num_decodes], default=0)",
        replace="max_decode_seq_len=max(seq_list, default=0)",
    ),
    PlantedBug(
        name="reorder-walks-decodes-from-the-front",
        description="the reorder takes the decodes from the front: the first decode is usually in "
        "place already, so the walk stops before moving the ones behind a prefill",
        file=META,
        find="decode_idx = decodes[num_decodes - i]",
        replace="decode_idx = decodes[i - 1]",
    ),
    PlantedBug(
        name="gqa-heads-tiled",
        description="the KV heads are tiled (repeat) instead of interleaved, so query head h "
        "reads KV head h % num_kv_heads",
        file=ATTN,
        find="o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,\n"
        "                                           enable_gqa=group > 1)",
        replace="o = F.scaled_dot_product_attention(q, keys.repeat(1, group, 1, 1), "
        "values.repeat(1, group, 1, 1),\n                                           "
        "attn_mask=visible, scale=scale)",
    ),
    PlantedBug(
        name="default-scale-is-one",
        description="scale=None is taken as 1 instead of 1 / sqrt(head_size)",
        file=ATTN,
        find="scale = 1.0 / math.sqrt(head_size)",
        replace="scale = 1.0 + 0 * math.sqrt(head_size)",
    ),
    PlantedBug(
        name="attention-in-half-precision",
        description="scores, softmax and the weighted sum run in the query's float16 / bfloat16 "
        "instead of float32: each output is off by several units of the dtype",
        file=ATTN,
        find="acc = torch.float64 if query.dtype == torch.float64 else torch.float32",
        replace="acc = query.dtype",
    ),
    PlantedBug(
        name="nan-values-not-masked",
        description="the keys and values of whole blocks are read and only the scores are "
        "masked: the slots past seq_len hold junk, and a softmax weight of 0 times a NaN value "
        "is NaN",
        file=ATTN,
        find="""        keys = keys[:, :seq_len].to(acc).transpose(1, 2)  # [g, KVH, seq_len, D]
        values = values[:, :seq_len].to(acc).transpose(1, 2)
        flat = torch.cat([torch.arange(starts[s], starts[s] + q_len, device=dev) for s in seqs])
        q = query[flat].to(acc).view(len(seqs), q_len, num_heads, head_size).transpose(1, 2)
        # Query row i is at position ctx + i; key j is visible iff j <= it.
        q_pos = ctx + torch.arange(q_len, device=dev)
        visible = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
""",
        replace="""        keys = keys.to(acc).transpose(1, 2)  # [g, KVH, n_blk * block_size, D]
        values = values.to(acc).transpose(1, 2)
        flat = torch.cat([torch.arange(starts[s], starts[s] + q_len, device=dev) for s in seqs])
        q = query[flat].to(acc).view(len(seqs), q_len, num_heads, head_size).transpose(1, 2)
        q_pos = ctx + torch.arange(q_len, device=dev)
        visible = torch.arange(keys.shape[2], device=dev)[None, :] <= q_pos[:, None]
""",
    ),
]
