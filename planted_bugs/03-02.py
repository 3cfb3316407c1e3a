"""Known-wrong edits to the reference metadata builder and chunked-prefill attention that lab
03-02's tests must reject."""

from __future__ import annotations

from course.bugs import PlantedBug

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
        find="positions = context_lens.long()[req_indices] + offsets_in_query",
        replace="positions = offsets_in_query",
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
]
