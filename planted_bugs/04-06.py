"""Known-wrong edits to the lab 04-06 reference; the lab's tests must reject every one."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

CONNECTOR = "mini_vllm/distributed/kv_transfer/block_connector.py"
HOOKS = "mini_vllm/worker/kv_connector_model_runner_mixin.py"

BUGS = [
    PlantedBug(
        name="saved-before-written",
        description="the connector saves a layer's blocks before the layer's attention wrote "
        "the step's K/V into them: the decode engine loads stale keys",
        file=HOOKS,
        find="        out = self.inner(query, key, value, key_cache, value_cache, meta, scale)\n"
        "        self.connector.save_kv_layer(name, (key_cache, value_cache), meta)\n",
        replace="        self.connector.save_kv_layer(name, (key_cache, value_cache), meta)\n"
        "        out = self.inner(query, key, value, key_cache, value_cache, meta, scale)\n",
    ),
    PlantedBug(
        name="attend-before-load",
        description="the layer attends before its loads are written: the first step of a "
        "decode engine reads empty blocks where the prompt's KV should be",
        file=HOOKS,
        find="        self.connector.wait_for_layer_load(name)\n"
        "        out = self.inner(query, key, value, key_cache, value_cache, meta, scale)\n",
        replace="        out = self.inner(query, key, value, key_cache, value_cache, meta, scale)\n"
        "        self.connector.wait_for_layer_load(name)\n",
    ),
    PlantedBug(
        name="block-ids-not-remapped",
        description="the load goes to the blocks at the request's first positions, ignoring the "
        "local hit: the blobs overwrite the engine's own cached blocks",
        file=CONNECTOR,
        find="            self._loads.append(LoadSpec(request.request_id, "
        "block_ids[first:first + n],",
        replace="            self._loads.append(LoadSpec(request.request_id, block_ids[:n],",
    ),
    PlantedBug(
        name="last-token-loaded",
        description="the hit may cover the block of the prompt's last token, so no token is "
        "left to compute and sample from",
        file=CONNECTOR,
        find="        last = (request.num_tokens - 1) // bs  "
        "# the last token is always computed here\n",
        replace="        last = request.num_tokens // bs\n",
    ),
    PlantedBug(
        name="hit-from-block-zero",
        description="the lookup starts at block 0 whatever the local hit, so a hit past it is "
        "counted from the wrong block",
        file=CONNECTOR,
        find="        first = num_computed_tokens // bs\n        last =",
        replace="        first = 0\n        last =",
    ),
    PlantedBug(
        name="saves-one-block-late",
        description="a step saves the blocks it started, not the ones it filled: a block is "
        "saved before its last token was computed",
        file=CONNECTOR,
        find="            lo, hi = start // bs, min(end // bs, len(request.block_hashes))\n",
        replace="            lo, hi = start // bs, min((end + bs - 1) // bs, "
        "len(request.block_hashes))\n",
    ),
    PlantedBug(
        name="saves-past-the-prompt",
        description="decode steps save the blocks their output tokens fill too, under hashes "
        "the producer's prompt never named",
        file=CONNECTOR,
        find="            end = min(request.num_computed_tokens, request.num_prompt_tokens)\n",
        replace="            end = request.num_computed_tokens\n",
    ),
    PlantedBug(
        name="loads-planned-twice",
        description="the step's loads are not emptied once built: every later step loads the "
        "same blobs again over blocks that have moved on",
        file=CONNECTOR,
        find="        meta = BlockStoreConnectorMetadata(loads=self._loads, saves=saves)\n"
        "        self._loads = []\n",
        replace="        meta = BlockStoreConnectorMetadata(loads=list(self._loads), "
        "saves=saves)\n",
    ),
    PlantedBug(
        name="layer-loaded-into-layer-0",
        description="every layer's part of a blob is written into the first layer's cache",
        file=CONNECTOR,
        find="        key_cache, value_cache = self._layers[layer]\n"
        "        key_cache[ids] = data[:, layer, 0]",
        replace="        key_cache, value_cache = self._layers[0]\n"
        "        key_cache[ids] = data[:, layer, 0]",
    ),
    PlantedBug(
        name="keys-and-values-swapped",
        description="a saved block's keys go where its values belong and the other way round",
        file=CONNECTOR,
        find="        buf[:, layer, 0] = key_cache[ids].reshape(len(ids), -1)\n"
        "        buf[:, layer, 1] = value_cache[ids].reshape(len(ids), -1)\n",
        replace="        buf[:, layer, 1] = key_cache[ids].reshape(len(ids), -1)\n"
        "        buf[:, layer, 0] = value_cache[ids].reshape(len(ids), -1)\n",
    ),
    PlantedBug(
        name="producer-matches-too",
        description="a producer looks its prompts up too and loads instead of computing them",
        file=CONNECTOR,
        find="        if not self.is_consumer or num_computed_tokens % bs:\n",
        replace="        if num_computed_tokens % bs:\n",
    ),
]
