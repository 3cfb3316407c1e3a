"""Known-wrong edits of the lab 01-03 solution that the tests must reject.

Each is a mistake people make when they first write a KV cache;
`python -m course check 01-03` applies them one at a time.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

_SOL = "phase-01-attention/labs/lab-03-kv-cache/solution.py"

BUGS = [
    PlantedBug(
        name="append-slot-off-by-one",
        description="new tokens are written one slot early, overwriting the last stored token",
        file=_SOL,
        find="start, n = int(self.seq_lens[seq_idx]), key.shape[0]",
        replace="start, n = max(int(self.seq_lens[seq_idx]) - 1, 0), key.shape[0]",
    ),
    PlantedBug(
        name="keys-include-empty-slots",
        description="keys() returns all max_seq_len slots, so attention also sees the zeros of "
        "slots that hold no token",
        file=_SOL,
        find="return self.key_cache[seq_idx, :, :n].transpose(0, 1)",
        replace="return self.key_cache[seq_idx].transpose(0, 1)",
    ),
    PlantedBug(
        name="attend-only-new-tokens",
        description="cached_attention attends the new tokens to themselves only, ignoring the "
        "cached context (decode then sees a single key)",
        file=_SOL,
        find="        cache.keys(seq_idx),\n        cache.values(seq_idx),",
        replace="        key,\n        value,",
    ),
    PlantedBug(
        name="decode-mask-off-by-one",
        description="the batched decode also attends the first empty slot after each sequence",
        file=_SOL,
        find="visible = positions[None, :] < cache.seq_lens",
        replace="visible = positions[None, :] <= cache.seq_lens",
    ),
    PlantedBug(
        name="decode-gqa-tiled",
        description="the batched decode tiles KV heads (h % num_kv_heads) instead of repeating "
        "each in place (h // group)",
        file=_SOL,
        find="k = cache.key_cache.to(dtype).repeat_interleave(group, dim=1)",
        replace="k = cache.key_cache.to(dtype).repeat(1, group, 1, 1)",
    ),
    PlantedBug(
        name="append-without-capacity-check",
        description="append does not check the room left, so an overlong write fails inside "
        "torch instead of with a clear ValueError",
        file=_SOL,
        find="if start + n > self.max_seq_len:",
        replace="if start + n > self.max_seq_len + n:",
    ),
    PlantedBug(
        name="used-memory-padded-to-longest",
        description="used memory counts every sequence at the longest final length, hiding "
        "most of the waste",
        file=_SOL,
        find="used = sum(lens) * per_token",
        replace="used = len(lens) * max(lens) * per_token",
    ),
    PlantedBug(
        name="append-rejects-an-exact-fit",
        description="the capacity check uses >= : a write that fills the sequence exactly to "
        "max_seq_len is refused",
        file=_SOL,
        find="if start + n > self.max_seq_len:",
        replace="if start + n >= self.max_seq_len:",
    ),
    PlantedBug(
        name="append-takes-negative-indices",
        description="seq_idx is checked against Python's indexing rules, so -1 silently writes "
        "into the last sequence",
        file=_SOL,
        find="if not 0 <= seq_idx < self.key_cache.shape[0]:",
        replace="if not -self.key_cache.shape[0] <= seq_idx < self.key_cache.shape[0]:",
    ),
    PlantedBug(
        name="decode-stores-before-checking",
        description="decode_step lets append find the full sequence: the sequences before it "
        "have already stored their token when the error comes",
        file=_SOL,
        find="    full = (cache.seq_lens >= max_seq_len).nonzero().flatten().tolist()\n"
        "    if full:",
        replace="    full = []\n    if full:",
    ),
    PlantedBug(
        name="decode-empty-slot-values-reach-the-output",
        description="the batched decode masks the scores of empty slots but not their values: "
        "weight 0 times a NaN left in an empty slot is NaN",
        file=_SOL,
        find="    v = v.masked_fill(~visible[:, None, :, None], 0.0)\n",
        replace="",
    ),
    PlantedBug(
        name="decode-ignores-the-scale",
        description="the batched decode always uses head_size ** -0.5, whatever scale it is given",
        file=_SOL,
        find="scale = head_size**-0.5 if scale is None else scale",
        replace="scale = head_size**-0.5",
    ),
    PlantedBug(
        name="used-bytes-counts-keys-only",
        description="used_bytes counts the keys of each token but not its values",
        file=_SOL,
        find="per_token = 2 * num_kv_heads * head_size * self.key_cache.element_size()",
        replace="per_token = num_kv_heads * head_size * self.key_cache.element_size()",
    ),
    PlantedBug(
        name="decode-in-half-precision",
        description="the batched decode computes in the cache's dtype: float16 and bfloat16 "
        "scores, softmax and weighted sums, several roundings off",
        file=_SOL,
        find="dtype = torch.float64 if query.dtype == torch.float64 else torch.float32",
        replace="dtype = query.dtype",
    ),
]
