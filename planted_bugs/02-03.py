"""Known-wrong edits of the reference that the tests of lab 02-03 must reject.

The mistakes people make when they write a KV cache manager: several were found by mutation
testing (`scripts/mutation_test.py 02-03`) or by a student's code that passed the old tests.
`python -m course check --lab 02-03` applies them one at a time.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

MANAGER = "mini_vllm/core/kv_cache_manager.py"
UTILS = "mini_vllm/core/kv_cache_utils.py"
_TOUCH = (
    "        if self.enable_caching:\n"
    "            self.block_pool.touch((new_computed_block_list,))\n"
)
_SAVE_AND_ALLOCATE = (
    "        self._save_new_computed_blocks(request.request_id, new_computed_block_list)\n"
    "        new_blocks = self._allocate_new_blocks(request.request_id, "
    "num_tokens_need_slot)\n"
)

BUGS = [
    PlantedBug(
        name="free-in-forward-order",
        description="free returns a request's blocks head first, so its shared prefix is "
        "evicted before its private tail",
        file=MANAGER,
        find="ordered_blocks = reversed(req_blocks)",
        replace="ordered_blocks = iter(req_blocks)",
    ),
    PlantedBug(
        name="hit-search-skips-misses",
        description="the prefix lookup keeps going after a miss and serves a cached block at "
        "the wrong position",
        file=MANAGER,
        find="break  # chained hashes: after a miss, no later block can be a valid hit",
        replace="continue",
    ),
    PlantedBug(
        name="hit-blocks-claim-no-capacity",
        description="the capacity check forgets that reviving a free hit block takes it out of "
        "the free queue, so allocation runs out half-way",
        file=MANAGER,
        find="return num_new_blocks + num_evictable_computed_blocks",
        replace="return num_new_blocks",
    ),
    PlantedBug(
        name="cache-partial-block",
        description="cache_blocks rounds the number of full blocks up and caches the partial "
        "block",
        file=MANAGER,
        find="num_full_blocks = num_computed_tokens // self.block_size",
        replace="num_full_blocks = cdiv(num_computed_tokens, self.block_size)",
    ),
    PlantedBug(
        name="no-salt-on-first-block",
        description="the cache salt is left out of the first block's hash, so salted requests "
        "share KV with everybody",
        file=UTILS,
        find="salt_keys = [request.cache_salt] if start_token_idx == 0 and request.cache_salt "
        "else []",
        replace="salt_keys = []",
    ),
    PlantedBug(
        name="hit-covers-the-whole-prompt",
        description="the lookup may cover every prompt token, leaving nothing to compute "
        "logits from",
        file=MANAGER,
        find="max_cache_hit_length = request.num_tokens - 1",
        replace="max_cache_hit_length = request.num_tokens",
    ),
    PlantedBug(
        name="touch-before-capacity-check",
        description="hit blocks are claimed before the capacity check, so a failed allocation "
        "leaves them claimed",
        file=MANAGER,
        find="        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():\n"
        "            return None  # nothing has been touched yet\n"
        "\n"
        "        # Claim the hit blocks first, so that allocating the new blocks cannot evict "
        "them.\n"
        "        if self.enable_caching:\n"
        "            self.block_pool.touch((new_computed_block_list,))\n",
        replace="        free_before = self.block_pool.get_num_free_blocks()\n"
        "        if self.enable_caching:\n"
        "            self.block_pool.touch((new_computed_block_list,))\n"
        "        if num_blocks_to_allocate > free_before:\n"
        "            return None\n",
    ),
    PlantedBug(
        name="cache-lookahead-slots",
        description="allocate_slots caches up to the lookahead slots instead of the tokens the "
        "request really has",
        file=MANAGER,
        find="num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)",
        replace="num_tokens_to_cache = num_tokens_need_slot",
    ),
    PlantedBug(
        name="hash-partial-block",
        description="the request hasher also hashes the last, partial block",
        file=UTILS,
        find="if end_token_idx > num_tokens:",
        replace="if start_token_idx >= num_tokens:",
    ),
    PlantedBug(
        name="forget-cached-count",
        description="cache_blocks does not record how many blocks are cached and caches them "
        "again on the next step",
        file=MANAGER,
        find="        self.num_cached_block[request_id] = num_full_blocks\n",
        replace="\n",
    ),
    PlantedBug(
        name="hasher-does-not-chain",
        description="the request hasher never advances the parent, so every block is hashed "
        "as if it started the sequence",
        file=UTILS,
        find="            prev_block_hash_value = block_hash",
        replace="            prev_block_hash_value = None",
    ),
    PlantedBug(
        name="cache-salt-on-every-block",
        description="the cache salt is mixed into every block instead of the first only, so "
        "hashes disagree with upstream's",
        file=UTILS,
        find="if start_token_idx == 0 and request.cache_salt",
        replace="if request.cache_salt",
    ),
    PlantedBug(
        name="free-keeps-the-cached-count",
        description="free forgets the table but not num_cached_block, and a re-admitted request "
        "keeps the old count: after a preemption its recomputed blocks are never cached (a "
        "student's code did this and passed the old tests; the engine exam caught it)",
        file=MANAGER,
        find="        self.num_cached_block.pop(request.request_id, None)\n",
        replace="",
    ),
    PlantedBug(
        name="capacity-counts-held-hit-blocks",
        description="every hit block is counted as taken from the free queue, also those another "
        "request holds, so an allocation that fits exactly is refused",
        file=MANAGER,
        find="blk.ref_cnt == 0 and not blk.is_null for blk in new_computed_blocks",
        replace="not blk.is_null for blk in new_computed_blocks",
    ),
    PlantedBug(
        name="capacity-forgets-held-blocks",
        description="the capacity count ignores the blocks the request already holds, so a "
        "decode step that fits exactly (or needs no block at all) is refused",
        file=MANAGER,
        find="num_new_blocks = num_required_blocks - len(new_computed_blocks) - num_held",
        replace="num_new_blocks = num_required_blocks - len(new_computed_blocks)",
    ),
    PlantedBug(
        name="capacity-check-off-by-one",
        description="the allocation is refused when the blocks needed equal the free blocks: "
        "an exact fit fails",
        file=MANAGER,
        find="if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():",
        replace="if num_blocks_to_allocate >= self.block_pool.get_num_free_blocks():",
    ),
    PlantedBug(
        name="new-blocks-before-hits-are-claimed",
        description="the new blocks are taken before the hit blocks are touched, so a free hit "
        "block at the front of the queue is evicted and handed out again as a new block",
        file=MANAGER,
        find=_TOUCH + _SAVE_AND_ALLOCATE,
        replace=_SAVE_AND_ALLOCATE + _TOUCH,
    ),
    PlantedBug(
        name="chunk-sized-by-the-whole-prompt",
        description="slots are counted from the request's tokens instead of the tokens computed "
        "by the end of this step, so a prefill chunk takes the whole prompt's blocks",
        file=MANAGER,
        find="            num_computed_tokens + num_new_tokens + num_lookahead_tokens, "
        "self.max_model_len",
        replace="            max(request.num_tokens, num_computed_tokens + num_new_tokens) "
        "+ num_lookahead_tokens, self.max_model_len",
    ),
    PlantedBug(
        name="caching-off-returns-a-list",
        description="with caching off the lookup returns a plain empty list instead of an "
        "empty KVCacheBlocks, which the scheduler cannot add to the new blocks",
        file=MANAGER,
        find="            return self.create_empty_block_list(), 0",
        replace="            return [], 0",
    ),
    PlantedBug(
        name="hit-count-overwritten",
        description="the lookup sets the hit counter instead of adding to it, so the hit rate "
        "reports only the last request (a mutation survivor of the old tests)",
        file=MANAGER,
        find="self.prefix_cache_stats.hits += num_new_computed_tokens",
        replace="self.prefix_cache_stats.hits = num_new_computed_tokens",
    ),
    PlantedBug(
        name="max-model-len-off-by-one",
        description="a request that reaches exactly max_model_len tokens is refused (a mutation "
        "survivor of the old tests)",
        file=MANAGER,
        find="if num_computed_tokens + num_new_tokens > self.max_model_len:",
        replace="if num_computed_tokens + num_new_tokens >= self.max_model_len:",
    ),
]
