"""Known-wrong edits to the lab 02-07 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

KERNEL = "mini_vllm/attention/triton_unified.py"

BUGS = [
    PlantedBug(
        name="q-rows-swapped",
        description="load_q_tile takes row m as token m % G and head m // G, so the packed rows "
        "mix up the query heads of a group with the tokens of the block",
        file=KERNEL,
        find="    token = q_block * BLOCK_Q + rows // G\n    head = kv_head * G + rows % G\n",
        replace="    token = q_block * BLOCK_Q + rows % G\n    head = kv_head * G + rows // G\n",
    ),
    PlantedBug(
        name="group-heads-not-spread",
        description="load_q_tile takes query head kv_head + m % G instead of kv_head * G + "
        "m % G, so every KV head but the first reads another group's query heads",
        file=KERNEL,
        find="    head = kv_head * G + rows % G\n",
        replace="    head = kv_head + rows % G\n",
    ),
    PlantedBug(
        name="q-rows-of-the-first-block",
        description="load_q_tile forgets the Q block's offset, so every block of a long chunk "
        "reads the chunk's first BLOCK_Q queries",
        file=KERNEL,
        find="    token = q_block * BLOCK_Q + rows // G\n",
        replace="    token = rows // G\n",
    ),
    PlantedBug(
        name="block-table-by-tile",
        description="load_kv_tile looks a position's block up as pos // TILE, as if a block "
        "held a whole tile",
        file=KERNEL,
        find="block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_seq, other=0)",
        replace="block = tl.load(table_ptr + pos // TILE, mask=in_seq, other=0)",
    ),
    PlantedBug(
        name="x-split-swapped",
        description="load_kv_tile pairs a key element's chunk and lane the wrong way round "
        "(chunk d % X, lane d // X)",
        file=KERNEL,
        find="(dims // X)[:, None] * sk_chunk\n                 + slot[None, :] * sk_slot + "
        "(dims % X)[:, None])",
        replace="(dims % X)[:, None] * sk_chunk\n                 + slot[None, :] * sk_slot + "
        "(dims // X)[:, None])",
    ),
    PlantedBug(
        name="values-past-the-sequence-read",
        description="load_kv_tile masks the value load by the head dimension only, so the NaN "
        "in slots past the sequence reaches the weighted sum (0 * NaN is NaN)",
        file=KERNEL,
        find="mask=in_seq[:, None] & dim_ok[None, :], other=0.0)",
        replace="mask=dim_ok[None, :], other=0.0)",
    ),
    PlantedBug(
        name="mask-excludes-the-diagonal",
        description="visible lets a query see only the keys strictly before it, not its own",
        file=KERNEL,
        find="return (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seq_len)[None, :]",
        replace="return (k_pos[None, :] < q_pos[:, None]) & (k_pos < seq_len)[None, :]",
    ),
    PlantedBug(
        name="mask-not-causal-inside-the-chunk",
        description="visible checks only that a key is inside the sequence, so a chunk's "
        "queries see the chunk's later tokens",
        file=KERNEL,
        find="return (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seq_len)[None, :]",
        replace="return (k_pos[None, :] >= 0) & (k_pos < seq_len)[None, :]",
    ),
    PlantedBug(
        name="running-output-not-rescaled",
        description="softmax_step adds a tile's weighted values without rescaling the output "
        "so far by exp(m_old - m_new)",
        file=KERNEL,
        find="acc_new = acc * alpha[:, None] + tl.dot(",
        replace="acc_new = acc + tl.dot(",
    ),
    PlantedBug(
        name="running-sum-not-rescaled",
        description="softmax_step adds a tile's exponentials to the running sum without "
        "rescaling it",
        file=KERNEL,
        find="l_new = l * alpha + tl.sum(p, axis=1)",
        replace="l_new = l + tl.sum(p, axis=1)",
    ),
    PlantedBug(
        name="nan-when-nothing-is-visible",
        description="softmax_step shifts by m_new even where it is -inf, so a row with no "
        "visible key in a tile (a window's first tile, an empty segment) gets NaN",
        file=KERNEL,
        find='shift = tl.where(m_new == float("-inf"), 0.0, m_new)',
        replace="shift = m_new",
    ),
    PlantedBug(
        name="reduce-without-max-correction",
        description="reduce_segments adds the segments' partials as they are, without "
        "rescaling each by exp(m_k - M)",
        file=KERNEL,
        find="weight = tl.where(seg_sum > 0, tl.exp(seg_max - overall), 0.0)",
        replace="weight = tl.where(seg_sum > 0, 1.0, 0.0)",
    ),
    PlantedBug(
        name="reduce-sum-not-rescaled",
        description="reduce_segments rescales the partial outputs but divides by the plain sum "
        "of the segments' sums",
        file=KERNEL,
        find="total = tl.sum(seg_sum * weight, axis=0)",
        replace="total = tl.sum(seg_sum, axis=0)",
    ),
    PlantedBug(
        name="window-one-key-too-wide",
        description="in_window keeps WINDOW + 1 keys: the distance test is <= instead of <",
        file=KERNEL,
        find="return q_pos[:, None] - k_pos[None, :] < WINDOW",
        replace="return q_pos[:, None] - k_pos[None, :] <= WINDOW",
    ),
    PlantedBug(
        name="window-one-key-too-narrow",
        description="in_window keeps WINDOW - 1 keys",
        file=KERNEL,
        find="return q_pos[:, None] - k_pos[None, :] < WINDOW",
        replace="return q_pos[:, None] - k_pos[None, :] < WINDOW - 1",
    ),
    PlantedBug(
        name="first-tile-rounded-up",
        description="first_tile rounds the window's first position up to a tile boundary, so "
        "the keys of the tile it starts in are skipped",
        file=KERNEL,
        find="return tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE",
        replace="return tl.cdiv(tl.maximum(first_q_pos - WINDOW + 1, 0), TILE)",
    ),
    PlantedBug(
        name="first-tile-at-the-query",
        description="first_tile starts at the earliest query's own tile, losing the window's "
        "keys in the tiles before it",
        file=KERNEL,
        find="return tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE",
        replace="return first_q_pos // TILE",
    ),
]
