"""Known-wrong edits of the lab 01-01 reference that the tests must reject.

Each is a mistake people make when they write attention for a serving engine;
`python -m course check 01-01` applies them one at a time.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

_REF = "mini_vllm/attention/reference.py"

BUGS = [
    PlantedBug(
        name="mask-excludes-diagonal",
        description="the causal mask is shifted by one: a query no longer sees its own key "
        "(and the first query of a prefill sees nothing at all)",
        file=_REF,
        find="return key_pos[None, :] <= query_pos[:, None]",
        replace="return key_pos[None, :] < query_pos[:, None]",
    ),
    PlantedBug(
        name="mask-ignores-context",
        description="the mask is aligned top-left (query i at position i), as with SDPA's "
        "is_causal: a decode step or a chunk after a context loses most of its keys",
        file=_REF,
        find="query_pos = torch.arange(kv_len - q_len, kv_len, device=device)",
        replace="query_pos = torch.arange(0, q_len, device=device)",
    ),
    PlantedBug(
        name="gqa-heads-modulo",
        description="KV heads are tiled instead of repeated in place, so query head h reads "
        "KV head h % num_kv_heads instead of h // group",
        file=_REF,
        find="return x.repeat_interleave(num_heads // num_kv_heads, dim=1)",
        replace="return x.repeat(1, num_heads // num_kv_heads, 1)",
    ),
    PlantedBug(
        name="alibi-sign-flipped",
        description="the ALiBi distance is query minus key, which rewards distant keys",
        file=_REF,
        find="distance = key_pos[None, :] - query_pos[:, None]",
        replace="distance = query_pos[:, None] - key_pos[None, :]",
    ),
    PlantedBug(
        name="alibi-from-row-index",
        description="the ALiBi distance is measured from the query's row index i instead of its "
        "position kv_len - q_len + i: every row is off by a constant, which softmax hides, so "
        "only the bias and the scores show it",
        file=_REF,
        find="query_pos = torch.arange(kv_len - q_len, kv_len, device=slopes.device, dtype=dtype)",
        replace="query_pos = torch.arange(0, q_len, device=slopes.device, dtype=dtype)",
    ),
    PlantedBug(
        name="scale-zero-taken-for-the-default",
        description="`if not scale` instead of `if scale is None`: an explicit scale of 0.0 is "
        "replaced by head_size ** -0.5",
        file=_REF,
        find="    if scale is None:\n        scale = head_size**-0.5",
        replace="    if not scale:\n        scale = head_size**-0.5",
    ),
    PlantedBug(
        name="scores-in-half-precision",
        description="scores are computed in the input dtype, so float16 inputs accumulate in "
        "float16 instead of float32",
        file=_REF,
        find="    dtype = compute_dtype(query.dtype)\n    q = query.to(dtype)",
        replace="    dtype = query.dtype\n    q = query.to(dtype)",
    ),
    PlantedBug(
        name="empty-query-returns-before-the-checks",
        description="ref_attention takes the q_len == 0 shortcut before checking its input, so "
        "wrong slopes (or shapes) with no queries give an empty result instead of a ValueError",
        file=_REF,
        find="    _, num_heads, _ = _check_qkv(query, key, value, alibi_slopes)\n"
        "    if query.shape[0] == 0:\n        return query.new_empty(query.shape)\n",
        replace="    if query.shape[0] == 0:\n        return query.new_empty(query.shape)\n"
        "    _, num_heads, _ = _check_qkv(query, key, value, alibi_slopes)\n",
    ),
    PlantedBug(
        name="varlen-drops-causal",
        description="the packed batch does not pass `causal` on, so causal=False still masks",
        file=_REF,
        find="            causal=causal,\n        )\n    return out",
        replace="        )\n    return out",
    ),
    PlantedBug(
        name="varlen-keys-from-query-offsets",
        description="the packed batch slices keys with the query offsets, which only works "
        "when every sequence is a full prefill",
        file=_REF,
        find="            key[ks:ke],",
        replace="            key[qs:qe],",
    ),
]
