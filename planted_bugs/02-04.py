"""Known-wrong edits to the lab 02-04 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.bugs import PlantedBug

PAGED = "mini_vllm/attention/paged_attn.py"
CACHE = "mini_vllm/attention/cache_ops.py"

BUGS = [
    PlantedBug(
        name="x-split-swapped-on-write",
        description="reshape_and_cache splits head_size as (x, head_size // x) instead of "
        "(head_size // x, x), so key elements land in the wrong lanes (the shapes still match)",
        file=CACHE,
        find="k.reshape(-1, num_kv_heads, head_size // x, x)",
        replace="k.reshape(-1, num_kv_heads, x, head_size // x).transpose(-1, -2)",
    ),
    PlantedBug(
        name="x-split-swapped-on-read",
        description="the key read pairs the x lane with the head_size // x chunk the wrong way "
        "round (element d taken as (d % (head_size // x), d // (head_size // x))), scrambling "
        "every key's elements",
        file=PAGED,
        find="q = query.to(acc).view(num_seqs, num_kv_heads, group, head_size // x, x)",
        replace="q = query.to(acc).view(num_seqs, num_kv_heads, group, x, head_size // x)"
        ".transpose(-1, -2)",
    ),
    PlantedBug(
        name="slot-offset-off-by-one",
        description="reshape_and_cache writes each token one offset further into its block",
        file=CACHE,
        find="blocks, offsets = real // block_size, real % block_size",
        replace="blocks, offsets = real // block_size, (real + 1) % block_size",
    ),
    PlantedBug(
        name="last-block-over-read",
        description="the mask keeps whole blocks, so the unused tail of a sequence's last, "
        "partly filled block joins the softmax",
        file=PAGED,
        find="valid = pos[None, :] < seq_lens.to(torch.int64)[:, None]",
        replace="valid = pos[None, :] < (-(-seq_lens.to(torch.int64) // block_size) "
        "* block_size)[:, None]",
    ),
    PlantedBug(
        name="alibi-sign-flipped",
        description="the ALiBi distance is query minus key, so older tokens are favoured",
        file=PAGED,
        find="dist = pos[None, :] - (seq_lens.to(torch.int64)[:, None] - 1)",
        replace="dist = (seq_lens.to(torch.int64)[:, None] - 1) - pos[None, :]",
    ),
    PlantedBug(
        name="gqa-head-h-mod-kv",
        description="query heads are grouped as h % num_kv_heads instead of "
        "h // (num_heads // num_kv_heads)",
        file=PAGED,
        find="q = query.to(acc).view(num_seqs, num_kv_heads, group, head_size // x, x)",
        replace="q = query.to(acc).view(num_seqs, group, num_kv_heads, head_size // x, x)"
        ".transpose(1, 2)",
    ),
    PlantedBug(
        name="v2-reduce-without-rescale",
        description="the v2 reduce adds partitions' exp sums without rescaling each from its "
        "own max to the global max",
        file=PAGED,
        find="exp_sums * torch.exp(m - global_max)",
        replace="exp_sums",
    ),
    PlantedBug(
        name="choice-rule-inclusive",
        description="use_v1 takes exactly 512 (sequence, head) pairs as enough parallel work",
        file=PAGED,
        find="num_seqs * num_heads > V1_MIN_PARALLEL_WORK",
        replace="num_seqs * num_heads >= V1_MIN_PARALLEL_WORK",
    ),
    PlantedBug(
        name="copy-blocks-keys-only",
        description="copy_blocks copies the key caches and forgets the value caches",
        file=CACHE,
        find="caches = list(key_caches) + list(value_caches)",
        replace="caches = list(key_caches)",
    ),
    PlantedBug(
        name="swap-blocks-ignores-dst-ids",
        description="swap_blocks writes each block to its source id in the destination pool",
        file=CACHE,
        find="dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)",
        replace="dst[src_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)",
    ),
]
