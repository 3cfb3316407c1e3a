"""Known-wrong edits of the reference that the tests of lab 02-03 must reject."""

from __future__ import annotations

from course.bugs import PlantedBug

MANAGER = "mini_vllm/kv_cache_manager.py"
UTILS = "mini_vllm/kv_cache_utils.py"

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
]
