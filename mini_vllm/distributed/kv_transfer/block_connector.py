"""A KV connector that ships a prompt's full blocks through a block store, keyed by hash chain.

The producer (a prefill engine) saves every full block of a prompt as its tokens are computed;
the consumer (a decode engine), when it admits a request, fetches the longest leading run of the
prompt's block hashes that the store holds and loads those blobs into the blocks its own pool
just gave the request. The block ids differ on the two sides (each engine has its own pool): a
blob names its tokens by hash, never its producer's block id, and lands in the consumer's.

A block's blob is its K and V for every layer, ``[num_layers, 2, elements per block]`` in the
cache's dtype and layout, so both engines must run the same model, block size and cache dtype
(a blob of another size is refused). At least one prompt token is always left to compute: the
step that computes it samples the first token.

Saving happens at the end of the step that fills a block: ``save_kv_layer`` copies the layer's
blocks to a staging buffer after the layer wrote them, and ``wait_for_save`` hands each block to
the store once every layer has. Loading is synchronous too: the blobs are fetched when the
scheduler admits the request (so a match is backed by bytes in hand), and each layer's part is
written into the cache before that layer attends.

upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:85 @ v0.33.0 (the
same hooks, with files keyed by prompt hash; NixlConnector is the production pull-by-block one)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mini_vllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from mini_vllm.distributed.kv_transfer.block_store import (
    KVBlockStore,
    SharedMemoryBlockStore,
    TcpBlockStore,
)

__all__ = ["BlockStoreConnector", "BlockStoreConnectorBase", "BlockStoreConnectorMetadata",
           "LoadSpec", "SaveSpec", "make_store"]


@dataclass
class LoadSpec:
    """Blobs to write into ``block_ids`` (the consumer's own blocks), in order.

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:33 @ v0.33.0
    """

    request_id: str
    block_ids: list[int]
    blobs: list[bytes]


@dataclass
class SaveSpec:
    """Blocks ``block_ids`` (the producer's), filled in this step, to store under ``keys``.

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:33 @ v0.33.0
    """

    request_id: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class BlockStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves.

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:69 @ v0.33.0
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.saves)


def make_store(config: Any, role: KVConnectorRole) -> KVBlockStore:
    """The store a connector half needs: the worker side of a producer writes (and, over TCP,
    serves); the scheduler side of a consumer reads.

    upstream: none (upstream's connectors build their own transports in their constructors)
    """
    if config.kv_transport == "tcp":
        return TcpBlockStore(config.kv_store, config.kv_buffer_blocks,
                             serve=role is KVConnectorRole.WORKER)
    return SharedMemoryBlockStore(config.kv_store, config.kv_buffer_blocks)


class BlockStoreConnectorBase(KVConnectorBase_V1):
    """The block-store connector's state and the hooks lab 04-06 gives: fetching a step's
    blobs into one tensor (``start_load_kv``), handing saved blocks to the store
    (``wait_for_save``), and the bookkeeping around them. :class:`BlockStoreConnector` adds the
    rest.

    ``config``: a :class:`~mini_vllm.config.KVTransferConfig`. ``store``: the store to use
    instead of the one ``config`` names. ``num_loaded_blocks`` / ``num_saved_blocks`` count what
    the worker side moved.

    State, scheduler side: ``_fetched`` (request id -> ``(first block, blobs)``: what a match
    fetched, until the request is admitted), ``_loads`` (this step's :class:`LoadSpec` s so
    far), ``_requests`` (a producer's running requests). Worker side: ``_layers`` (each layer's
    ``(key_cache, value_cache)``, in layer order) and ``_index`` (layer name -> position),
    ``_loading`` (``(block ids, data [blocks, layers, 2, elements])`` of this step's loads) and
    ``_pending_layers`` (the layers not loaded yet), ``_saving`` (``(block ids, staging buffer
    [blocks, layers, 2, elements])``) and ``_saved_layers``.

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:85 @ v0.33.0
    """

    def __init__(self, role: KVConnectorRole, config: Any, block_size: int,
                 store: KVBlockStore | None = None) -> None:
        super().__init__(role)
        self.block_size = block_size
        self.is_producer = config.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = config.kv_role in ("kv_consumer", "kv_both")
        needs_store = (self.is_consumer if role is KVConnectorRole.SCHEDULER
                       else self.is_producer)
        self.store = store if store is not None else (
            make_store(config, role) if needs_store else None)
        # Scheduler side.
        self._fetched: dict[str, tuple[int, list[bytes]]] = {}  # matched, not yet admitted
        self._loads: list[LoadSpec] = []
        self._requests: dict[str, Any] = {}  # running requests whose prompt blocks we save
        # Worker side.
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._index: dict[str, int] = {}
        self._loading: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_layers: set[int] = set()
        self._saving: tuple[torch.Tensor, torch.Tensor] | None = None
        self._saved_layers: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    # ---------------------------------------------------------------- scheduler side

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self._requests.pop(request.request_id, None)
        self._fetched.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, tuple[Any, Any]]) -> None:
        self._layers = list(kv_caches.values())
        self._index = {name: i for i, name in enumerate(kv_caches)}

    def _block_shape(self) -> tuple[torch.dtype, int]:
        key_cache = self._layers[0][0]
        return key_cache.dtype, key_cache[0].numel()

    def start_load_kv(self) -> None:
        """Stage the step's loads as one tensor (``_loading``, every layer pending) and the
        buffer its saves fill (``_saving``)."""
        meta = self._metadata
        if not isinstance(meta, BlockStoreConnectorMetadata):
            return
        dtype, per_block = self._block_shape()
        num_layers = len(self._layers)
        device = self._layers[0][0].device
        save_ids = [b for spec in meta.saves for b in spec.block_ids]
        if save_ids:
            self._saving = (torch.tensor(save_ids, dtype=torch.long, device=device),
                            torch.empty(len(save_ids), num_layers, 2, per_block, dtype=dtype,
                                        device=device))
        block_ids = [b for spec in meta.loads for b in spec.block_ids]
        blobs = [blob for spec in meta.loads for blob in spec.blobs]
        if not block_ids:
            return
        expected = num_layers * 2 * per_block * dtype.itemsize
        wrong = {len(b) for b in blobs if len(b) != expected}
        if wrong:
            raise ValueError(f"BlockStoreConnector: got KV blocks of {sorted(wrong)} bytes where "
                             f"this engine's are {expected}; the prefill and decode engines must "
                             "run the same model, block size and kv_cache_dtype")
        data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(dtype)
        data = data.view(len(block_ids), num_layers, 2, per_block).to(device)
        self._loading = (torch.tensor(block_ids, dtype=torch.long, device=device), data)
        self._pending_layers = set(range(num_layers))

    def wait_for_save(self) -> None:
        """After the forward: every load landed, and every layer's share of the saves is staged;
        hand each saved block to the store under its key."""
        try:
            if self._pending_layers:
                raise RuntimeError(f"BlockStoreConnector: layers {sorted(self._pending_layers)} "
                                   "never waited for their loads; call wait_for_layer_load in "
                                   "every attention layer")
            if self._loading is not None:
                self.num_loaded_blocks += len(self._loading[0])
            meta = self._metadata
            if not isinstance(meta, BlockStoreConnectorMetadata) or not meta.saves:
                return
            missing = set(range(len(self._layers))) - self._saved_layers
            if missing:
                raise RuntimeError(f"BlockStoreConnector: layers {sorted(missing)} were never "
                                   "saved; call save_kv_layer in every attention layer")
            _, buf = self._saving
            raw = buf.cpu().view(torch.uint8).reshape(buf.shape[0], -1)
            keys = [k for spec in meta.saves for k in spec.keys]
            for key, row in zip(keys, raw):
                self.store.put(key, memoryview(row.numpy()))
            self.num_saved_blocks += len(keys)
        finally:
            self._saving, self._saved_layers = None, set()
            self._loading, self._pending_layers = None, set()

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()


class BlockStoreConnector(BlockStoreConnectorBase):
    """Save and load full prompt blocks by hash chain (see the module docstring): the hit and
    its plan on the scheduler side, the copies in and out of the paged cache on the worker side
    (lab 04-06's tasks).

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:85 @ v0.33.0
    """

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The consumer's hit past the local one: the blocks from ``num_computed_tokens`` on
        whose keys (``request.block_hashes``) lead the store, never the block of the request's
        last token (that token is computed here: its step samples). Keeps the fetched blobs in
        ``_fetched`` until the request is admitted. ``(0, False)`` for a producer, or a local
        hit that ends inside a block.

        upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:264 @ v0.33.0
        """
        bs = self.block_size
        if not self.is_consumer or num_computed_tokens % bs:
            return 0, False
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs  # the last token is always computed here
        keys = list(request.block_hashes[first:last])
        blobs = self.store.fetch_prefix(keys) if keys else []
        self._fetched[request.request_id] = (first, blobs)
        return len(blobs) * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """``blocks`` are ``request``'s blocks (this engine's ids: its local hit, then those
        taken for the load): plan the load of its ``num_external_tokens`` into the blocks after
        the local hit; a producer remembers the request to save its prompt's blocks.

        upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:301 @ v0.33.0
        """
        first, blobs = self._fetched.pop(request.request_id, (0, []))
        if self.is_producer:
            self._requests[request.request_id] = request
        if num_external_tokens:
            n = num_external_tokens // self.block_size
            block_ids = blocks.get_block_ids()[0]
            self._loads.append(LoadSpec(request.request_id, block_ids[first:first + n],
                                        blobs[:n]))

    def build_connector_meta(self, scheduler_output: Any) -> BlockStoreConnectorMetadata:
        """The step's loads (planned since the last step) and saves: every prompt block that
        this step's tokens fill, for each request a producer remembers (called once the step is
        planned: ``num_computed_tokens`` already counts the step's tokens).

        upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:312 @ v0.33.0
        """
        saves = []
        bs = self.block_size
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            # The scheduler has advanced num_computed_tokens: this step computed [start, end).
            start = request.num_computed_tokens - num_new
            end = min(request.num_computed_tokens, request.num_prompt_tokens)
            lo, hi = start // bs, min(end // bs, len(request.block_hashes))
            if hi > lo:
                block_ids = self.kv_cache_manager.get_block_ids(request_id)[0]
                saves.append(SaveSpec(request_id, block_ids[lo:hi],
                                      list(request.block_hashes[lo:hi])))
        meta = BlockStoreConnectorMetadata(loads=self._loads, saves=saves)
        self._loads = []
        return meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write ``layer_name``'s part of the step's loads into its cache, once.

        upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:200 @ v0.33.0
        """
        layer = self._index[layer_name]
        if layer not in self._pending_layers:
            return
        ids, data = self._loading
        key_cache, value_cache = self._layers[layer]
        key_cache[ids] = data[:, layer, 0].reshape(-1, *key_cache.shape[1:])
        value_cache[ids] = data[:, layer, 1].reshape(-1, *value_cache.shape[1:])
        self._pending_layers.discard(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: tuple[Any, Any],
                      attn_metadata: Any) -> None:
        """Copy ``layer_name``'s blocks to save from ``kv_layer`` into the staging buffer.

        upstream: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:212 @ v0.33.0
        """
        if self._saving is None:
            return
        ids, buf = self._saving
        layer = self._index[layer_name]
        key_cache, value_cache = kv_layer
        buf[:, layer, 0] = key_cache[ids].reshape(len(ids), -1)
        buf[:, layer, 1] = value_cache[ids].reshape(len(ids), -1)
        self._saved_layers.add(layer)
