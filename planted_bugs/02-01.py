"""Known-wrong edits of the reference allocator; lab 02-01's tests must reject every one.

Each is a mistake people really make when they write this structure (several are violations
of the lab's invariants I1-I4); `python -m course check --lab 02-01` applies them one at a time.
"""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

UTILS = "mini_vllm/core/kv_cache_utils.py"
POOL = "mini_vllm/core/block_pool.py"

BUGS = [
    PlantedBug(
        name="hash-ignores-parent",
        description="hash_block_tokens drops the parent hash, so a block under prefix 'ab' "
        "and the same block under 'xy' collide: a prefix hit serves KV of another prefix",
        file=UTILS,
        find="hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))",
        replace="hash_function((NONE_HASH, curr_block_token_ids_tuple, extra_keys))",
    ),
    PlantedBug(
        name="remove-leaves-next-neighbour-stale",
        description="FreeKVCacheBlockQueue.remove relinks prev -> next but not next -> prev, "
        "so a backward link still points at the removed block",
        file=UTILS,
        find="        nxt.prev_free_block = prev\n"
        "        block.prev_free_block = block.next_free_block",
        replace="        block.prev_free_block = block.next_free_block",
    ),
    PlantedBug(
        name="popleft-n-keeps-stale-links",
        description="popleft_n leaves prev_free_block set on the blocks it hands out",
        file=UTILS,
        find="            curr.prev_free_block = None\n",
        replace="",
    ),
    PlantedBug(
        name="append-n-forgets-tail-sentinel",
        description="append_n links the blocks in but does not point the tail sentinel at the "
        "new last block, so the next append overwrites them",
        file=UTILS,
        find="        self.fake_free_list_tail.prev_free_block = last\n"
        "        self.num_free_blocks += len(blocks)",
        replace="        self.num_free_blocks += len(blocks)",
    ),
    PlantedBug(
        name="free-appends-referenced-blocks",
        description="free_blocks returns every freed block to the queue, even one another "
        "request still references: a use-after-free (breaks I1)",
        file=POOL,
        find="if ref_cnt == 0 and not block.is_null:",
        replace="if ref_cnt >= 0 and not block.is_null:",
    ),
    PlantedBug(
        name="free-in-reverse-order",
        description="free_blocks appends blocks in reverse, so the eviction order is not the "
        "one the caller asked for (a request's shared prefix would be evicted first)",
        file=POOL,
        find="blocks_list = ordered_blocks if isinstance(ordered_blocks, list) else "
        "list(ordered_blocks)",
        replace="blocks_list = list(ordered_blocks)[::-1]",
    ),
    PlantedBug(
        name="double-free-not-detected",
        description="free_blocks lets ref_cnt go from 0 to -1 instead of refusing a double free",
        file=POOL,
        find="elif ref_cnt < 0 and not block.is_null:",
        replace="elif ref_cnt < -1 and not block.is_null:",
    ),
    PlantedBug(
        name="touch-leaves-block-in-free-queue",
        description="touch raises ref_cnt of a cached free block without taking it out of the "
        "free queue; it can be allocated to someone else while in use (breaks I1/I4)",
        file=POOL,
        find="queue.remove(block)",
        replace="pass",
    ),
    PlantedBug(
        name="eviction-keeps-index-entry",
        description="_maybe_evict_cached_block clears the block's hash but leaves its entry in "
        "cached_block_hash_to_block, so a later lookup returns a reused block",
        file=POOL,
        find="if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:",
        replace="if self.cached_block_hash_to_block.get_one_block(block_hash) is None:",
    ),
    PlantedBug(
        name="allocate-skips-eviction",
        description="get_new_blocks hands out a cached free block without evicting it",
        file=POOL,
        find="self._maybe_evict_cached_block(block)",
        replace="pass",
    ),
    PlantedBug(
        name="null-block-left-in-free-queue",
        description="the pool names block 0 the null block but leaves it in the free queue, "
        "where it is counted as free and handed out",
        file=POOL,
        find="self.null_block = self.free_block_queue.popleft()",
        replace="self.null_block = self.blocks[0]",
    ),
]
