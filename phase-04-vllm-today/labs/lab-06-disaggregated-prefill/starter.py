"""Lab 04-06 starter: disaggregated prefill and a KV connector.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-06 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

You write the connector that moves a prompt's KV from a prefill engine to a decode engine: the
decode engine's hit in the store (task 1), the plan of a step's loads and saves (task 2), the
copies between a blob and the paged cache (task 3), and the order of the hooks around a layer's
attention (task 4). Given, in ``mini_vllm``: the connector's state and the rest of its hooks
(``BlockStoreConnectorBase``: ``start_load_kv`` stages the step's loads and the buffer its saves
fill, ``wait_for_save`` hands the saved blocks to the store), the stores (shared memory, TCP),
the scheduler's and the runner's calls into the connector, and ``DisaggregatedLLM``, which runs
a prefill engine and a decode engine in processes of their own.

A block travels as a blob: its K and V for every layer, ``[num_layers, 2, elements]`` in the
cache's dtype, keyed by the block's hash (lab 02-01's chain: the key names the block's tokens
and every token before them). The producer's block ids mean nothing to the consumer.

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-04-vllm-today/labs/lab-06-disaggregated-prefill -q
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401 (yours to use)

from mini_vllm.distributed.kv_transfer.block_connector import (  # noqa: F401 (yours to use)
    BlockStoreConnectorBase,
    BlockStoreConnectorMetadata,
    LoadSpec,
    SaveSpec,
)
from mini_vllm.worker.kv_connector_model_runner_mixin import ConnectorAttentionBase

__all__ = ["BlockStoreConnector", "ConnectorAttention"]


class BlockStoreConnector(BlockStoreConnectorBase):
    """The two halves of the block-store connector. The state you read and write is described
    on ``BlockStoreConnectorBase`` (``_fetched``, ``_loads``, ``_requests`` on the scheduler
    side; ``_layers``, ``_index``, ``_loading``, ``_pending_layers``, ``_saving``,
    ``_saved_layers`` on the worker side), with ``block_size``, ``is_producer``,
    ``is_consumer``, ``store`` and ``kv_cache_manager``."""

    # ------------------------------------------------------------------------ task 1

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Task 1. How many tokens of ``request``, past its local prefix-cache hit of
        ``num_computed_tokens`` tokens, the store can supply; ``(n, False)`` (``False``: the
        load happens within the step, never between steps).

        A consumer looks up the keys of the full blocks from the hit on
        (``request.block_hashes[first:]``, ``first = num_computed_tokens // block_size``) with
        one ``self.store.fetch_prefix(keys)``, which returns the blobs of the leading keys it
        holds. Never the block that holds the request's last token (``request.num_tokens -
        1``): that token is computed here, because its step samples the first new token. Keep
        ``(first, blobs)`` in ``self._fetched[request.request_id]`` (task 2 plans the load from
        it) and return ``len(blobs) * block_size``. A producer (``not self.is_consumer``), or a
        hit that ends inside a block, gets ``(0, False)`` without a lookup.
        """
        raise NotImplementedError(
            "lab 04-06, task 1: implement BlockStoreConnector.get_num_new_matched_tokens "
            "(hint: python -m course hint 04-06 1)")

    # ------------------------------------------------------------------------ task 2

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Task 2. ``blocks`` (a ``KVCacheBlocks``) are ``request``'s blocks in *this* engine's
        pool: its local hit, then the blocks taken for what task 1 offered; and
        ``num_external_tokens`` (what task 1 returned, or 0) are to be loaded into them.

        Take the request's entry out of ``self._fetched`` (absent: nothing fetched). With
        ``num_external_tokens > 0``, append to ``self._loads`` one ``LoadSpec(request_id,
        block_ids, blobs)``: the ``num_external_tokens // block_size`` blocks right after the
        local hit (``blocks.get_block_ids()[0]`` from the fetched ``first`` on) and their blobs,
        in order. A producer also remembers the request in ``self._requests`` (by id), to save
        its prompt's blocks as they are filled.
        """
        raise NotImplementedError(
            "lab 04-06, task 2: implement BlockStoreConnector.update_state_after_alloc "
            "(hint: python -m course hint 04-06 2)")

    def build_connector_meta(self, scheduler_output: Any) -> BlockStoreConnectorMetadata:
        """Task 2. The step's ``BlockStoreConnectorMetadata(loads, saves)``: ``loads`` are the
        ``LoadSpec`` s planned since the last step (``self._loads``, then emptied); ``saves``
        hold, for each request of ``scheduler_output.num_scheduled_tokens`` that
        ``self._requests`` holds, one ``SaveSpec(request_id, block_ids, keys)`` for the prompt
        blocks this step fills. The step is planned already, so ``request.num_computed_tokens``
        counts its tokens: it computes tokens ``[num_computed_tokens - num scheduled,
        num_computed_tokens)``; a block is filled when its last token is among them and it lies
        within the prompt. ``block_ids`` are the
        request's own (``self.kv_cache_manager.get_block_ids(request_id)[0]``), ``keys`` their
        ``request.block_hashes``. No ``SaveSpec`` for a request that fills no prompt block.
        """
        raise NotImplementedError(
            "lab 04-06, task 2: implement BlockStoreConnector.build_connector_meta "
            "(hint: python -m course hint 04-06 2)")

    # ------------------------------------------------------------------------ task 3

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Task 3. Write layer ``layer_name``'s part of the step's loads into its cache, once.

        ``self._loading`` is ``(block_ids, data)``: ``data[j, layer, 0]`` holds the flat keys of
        the block going to ``block_ids[j]``, ``data[j, layer, 1]`` its values, in the cache's
        layout; ``self._layers[layer]`` is the layer's ``(key_cache, value_cache)`` and
        ``self._index[layer_name]`` its position. Only a layer in ``self._pending_layers`` is
        written; take it out of that set once it is. Nothing else in the caches changes.
        """
        raise NotImplementedError(
            "lab 04-06, task 3: implement BlockStoreConnector.wait_for_layer_load "
            "(hint: python -m course hint 04-06 3)")

    def save_kv_layer(self, layer_name: str, kv_layer: tuple[Any, Any],
                      attn_metadata: Any) -> None:
        """Task 3. Copy layer ``layer_name``'s blocks to save into the staging buffer.

        ``self._saving`` is ``(block_ids, buffer)`` (``None``: nothing to save this step):
        ``buffer[j, layer, 0]`` gets the flat keys of block ``block_ids[j]`` from
        ``kv_layer = (key_cache, value_cache)``, ``buffer[j, layer, 1]`` its values. Add the
        layer's position to ``self._saved_layers``.
        """
        raise NotImplementedError(
            "lab 04-06, task 3: implement BlockStoreConnector.save_kv_layer "
            "(hint: python -m course hint 04-06 3)")


class ConnectorAttention(ConnectorAttentionBase):
    """Attention with the connector's hooks around it: ``self.inner`` (the runner's backend),
    ``self.connector`` (the connector's worker side), ``self.layer_of(key_cache)`` (the layer's
    name)."""

    # ------------------------------------------------------------------------ task 4

    def __call__(self, query, key, value, key_cache, value_cache, meta, scale):
        """Task 4. This layer's attention, ``self.inner(query, key, value, key_cache,
        value_cache, meta, scale)``, and its result, with the layer's hooks around it: the
        layer's loads must be in the cache before attention reads it
        (``self.connector.wait_for_layer_load(name)``), and its blocks saved only after
        ``inner`` wrote the step's K/V into them (``self.connector.save_kv_layer(name,
        (key_cache, value_cache), meta)``).
        """
        raise NotImplementedError(
            "lab 04-06, task 4: implement ConnectorAttention.__call__ "
            "(hint: python -m course hint 04-06 4)")
