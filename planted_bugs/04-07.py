"""Known-wrong edits to the lab 04-07 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

ROUTER = "mini_vllm/entrypoints/router.py"

BUGS = [
    PlantedBug(
        name="hashes-tokens-not-the-chain",
        description="each block is hashed from its tokens alone: equal blocks after different "
        "prefixes look like a match, which the engine's cache never gives",
        file=ROUTER,
        find="        parent = hash_block_tokens(sha256, parent, "
        "prompt_token_ids[start:start + block_size])\n        hashes.append(parent)\n",
        replace="        hashes.append(hash_block_tokens(sha256, None,\n"
        "                                        prompt_token_ids[start:start + block_size]))\n",
    ),
    PlantedBug(
        name="partial-block-hashed",
        description="the prompt's partial last block gets a hash too, which no engine cache "
        "ever holds",
        file=ROUTER,
        find="    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):\n",
        replace="    for start in range(0, len(prompt_token_ids), block_size):\n",
    ),
    PlantedBug(
        name="match-counts-every-held-block",
        description="a match counts every held hash, not the leading run: a block after a miss "
        "counts though the engine's lookup stops at the miss",
        file=ROUTER,
        find="        return next((i for i, h in enumerate(hashes) if h not in cache), "
        "len(hashes))\n",
        replace="        return sum(h in cache for h in hashes)\n",
    ),
    PlantedBug(
        name="remember-head-first",
        description="the prompt's hashes go in from the first, so its shared prefix is the "
        "least recent and is dropped before the suffixes after it",
        file=ROUTER,
        find="        for h in reversed(hashes):\n            cache.pop(h, None)\n",
        replace="        for h in hashes:\n            cache.pop(h, None)\n",
    ),
    PlantedBug(
        name="remember-not-bounded",
        description="the picture of a cache grows forever: the router believes an engine holds "
        "blocks it evicted long ago",
        file=ROUTER,
        find="        while len(cache) > self.num_blocks:\n"
        "            del cache[next(iter(cache))]  # the least recent\n",
        replace="",
    ),
    PlantedBug(
        name="evicts-most-recent",
        description="past the bound the most recent entries are dropped instead of the least "
        "recent",
        file=ROUTER,
        find="            del cache[next(iter(cache))]  # the least recent\n",
        replace="            del cache[next(reversed(cache))]\n",
    ),
    PlantedBug(
        name="no-load-balance",
        description="affinity always wins: one hot prefix piles every request onto one engine",
        file=ROUTER,
        find="        index = least if matched[best] == 0 or too_busy else best\n",
        replace="        index = least if matched[best] == 0 else best\n",
    ),
    PlantedBug(
        name="threshold-inclusive",
        description="the least loaded engine takes over when the difference equals the "
        "threshold, one request early",
        file=ROUTER,
        find="        too_busy = self.loads[best] - self.loads[least] > "
        "self.balance_abs_threshold\n",
        replace="        too_busy = self.loads[best] - self.loads[least] >= "
        "self.balance_abs_threshold\n",
    ),
    PlantedBug(
        name="tie-ignores-load",
        description="among engines matching as many blocks, the first wins whatever its load",
        file=ROUTER,
        find="        best = max(engines, key=lambda e: (matched[e], -self.loads[e], "
        "-len(self.caches[e]), -e))\n",
        replace="        best = max(engines, key=lambda e: (matched[e], -e))\n",
    ),
    PlantedBug(
        name="load-not-counted",
        description="the chosen engine does not count the request: every engine looks idle and "
        "the threshold never acts",
        file=ROUTER,
        find="        self.remember(index, hashes)\n        self.loads[index] += 1\n"
        "        return index\n",
        replace="        self.remember(index, hashes)\n        return index\n",
    ),
]
