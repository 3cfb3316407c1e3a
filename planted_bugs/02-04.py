"""Known-wrong edits to the lab 02-04 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

PAGED = "mini_vllm/attention/paged_attn.py"
CACHE = "mini_vllm/attention/cache_ops.py"
FP8 = "mini_vllm/attention/fp8.py"

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
        find="keys = keys.view(rows, num_tokens, head_size)",
        replace="keys = keys.view(rows, num_tokens, head_size // x, x).transpose(-1, -2)"
        ".reshape(rows, num_tokens, head_size)",
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
        find="q = query.to(acc).view(rows, group, head_size)",
        replace="q = query.to(acc).view(num_seqs, group, num_kv_heads, head_size)"
        ".transpose(1, 2).reshape(rows, group, head_size)",
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
    PlantedBug(
        name="padding-token-written-to-slot-minus-one",
        description="reshape_and_cache keeps the padding tokens: slot -1 becomes block -1, "
        "offset block_size - 1, the last slot of the cache, which some sequence owns",
        file=CACHE,
        find="        rows = torch.nonzero(slots >= 0).squeeze(1)\n        real = slots[rows]",
        replace="        rows = torch.arange(slots.shape[0], device=slots.device)\n"
        "        real = slots[rows]",
    ),
    PlantedBug(
        name="stale-values-times-zero-weight",
        description="positions past seq_len get logit -inf but their values are used as they "
        "are: a zero softmax weight times a NaN in an unwritten slot is NaN",
        file=PAGED,
        find="values.view(num_seqs, -1, num_tokens).masked_fill_(~valid[:, None, :], 0.0)",
        replace="pass",
    ),
    PlantedBug(
        name="reduce-max-over-every-column",
        description="the v2 reduce takes the global max over every column of the buffers, "
        "including a sequence's partitions past its end, which hold junk",
        file=PAGED,
        find='m = torch.where(active, max_logits, torch.full_like(max_logits, float("-inf")))',
        replace="m = max_logits",
    ),
    PlantedBug(
        name="reduce-multiplies-junk-partitions",
        description="the v2 reduce weighs every partition's tmp_out, relying on a zero weight "
        "to cancel the junk past a sequence's end (NaN * 0 is NaN)",
        file=PAGED,
        find="partial = torch.where(active[..., None], tmp_out.float(), "
        "torch.zeros((), device=out.device))",
        replace="partial = tmp_out.float()",
    ),
    PlantedBug(
        name="v2-extra-buffer-columns-unfilled",
        description="v2 fills the empty partitions only up to ceil(max_seq_len / 512) and "
        "leaves the rest of a wider buffer as it came",
        file=PAGED,
        find="""    exp_sums[:, :, used_parts:] = 0.0
    max_logits[:, :, used_parts:] = float("-inf")
    tmp_out[:, :, used_parts:] = 0.0""",
        replace="""    exp_sums[:, :, used_parts:parts] = 0.0
    max_logits[:, :, used_parts:parts] = float("-inf")
    tmp_out[:, :, used_parts:parts] = 0.0""",
    ),
    PlantedBug(
        name="reduce-exponentiates-raw-maxima",
        description="the v2 reduce weighs partitions by exp_sum * exp(m_p) without subtracting "
        "the global max: logits near 100 overflow float32",
        file=PAGED,
        find="rescaled = torch.where(active, exp_sums * torch.exp(m - global_max), "
        "torch.zeros_like(m))",
        replace="rescaled = torch.where(active, exp_sums * torch.exp(m), torch.zeros_like(m))",
    ),
    PlantedBug(
        name="alibi-measured-from-position-0",
        description="the ALiBi bias is slope * t instead of slope * (t - (seq_len - 1)): a "
        "constant shift per row, which softmax cannot see, but v2's max_logits are off by "
        "slope * (seq_len - 1)",
        file=PAGED,
        find="dist = pos[None, :] - (seq_lens.to(torch.int64)[:, None] - 1)  # [seqs, T]",
        replace="dist = pos[None, :] + 0 * seq_lens.to(torch.int64)[:, None]  # [seqs, T]",
    ),
    # Task 7 (the FP8 KV cache).
    PlantedBug(
        name="fp8-key-scale-applied-on-write-not-on-read",
        description="keys are stored as e4m3(k / k_scale) but read back as the raw e4m3 value, "
        "without the * k_scale: every logit is off by the factor 1 / k_scale",
        file=PAGED,
        find="keys = scaled_fp8_dequant(keys, k_scale, acc)",
        replace="keys = keys.to(acc)",
    ),
    PlantedBug(
        name="fp8-e5m2-instead-of-e4m3",
        description="the cache format is e5m2 (2 mantissa bits, max 57344) instead of upstream's "
        "e4m3 for kv_cache_dtype='fp8': twice the rounding error, and a cache the checks "
        "refuse",
        file=FP8,
        find="FP8_DTYPE = torch.float8_e4m3fn",
        replace="FP8_DTYPE = torch.float8_e5m2",
    ),
    PlantedBug(
        name="fp8-clip-without-the-scale",
        description="the clamp to +-448 is applied to x instead of x / scale: with a scale "
        "above 1, values between 448 and 448 * scale saturate at 448",
        file=FP8,
        find="y = x.to(torch.float32) / scale\n    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)"
        ".to(FP8_DTYPE)",
        replace="y = x.to(torch.float32).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX) / scale\n"
        "    return y.to(FP8_DTYPE)",
    ),
    PlantedBug(
        name="weighted-sum-in-cache-dtype",
        description="the values stay in the cache's float16 / bfloat16, so the probabilities are "
        "rounded to it and the weighted sum runs in it: each output is off by several units",
        file=PAGED,
        find="keys, values = keys.to(acc), values.to(acc)",
        replace="keys, values = keys.to(acc), values",
    ),
]
