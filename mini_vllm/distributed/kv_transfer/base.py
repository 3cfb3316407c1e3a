"""The KV connector API: the hooks through which an engine's scheduler and runner share KV
with the world outside the engine (another engine, a store), in upstream's v1 shape.

A connector comes in two halves, one per role, each built once per engine:

* the **scheduler side** decides. For a request waiting for admission,
  :meth:`~KVConnectorBase_V1.get_num_new_matched_tokens` says how many tokens past the local
  prefix-cache hit it can supply; blocks are allocated for them and reported with
  :meth:`~KVConnectorBase_V1.update_state_after_alloc`, and the scheduler counts them as
  computed. Each step, :meth:`~KVConnectorBase_V1.build_connector_meta` packs what the worker
  must move (loads into which blocks, saves from which) into the scheduler's output. (Upstream's
  scheduler makes these calls in its admission loop; mini_vllm's engine makes them around
  ``schedule()``: :mod:`mini_vllm.engine.kv_connector`.)
* the **worker side** moves. Around the step's forward pass: ``bind_connector_metadata``,
  :meth:`~KVConnectorBase_V1.start_load_kv` before it; inside it, per attention layer,
  :meth:`~KVConnectorBase_V1.wait_for_layer_load` before the layer reads its cache and
  :meth:`~KVConnectorBase_V1.save_kv_layer` after the layer wrote it; then
  :meth:`~KVConnectorBase_V1.wait_for_save` once the forward is done, and
  ``clear_connector_metadata``.

Invariants: a token the scheduler counts as computed because of the connector has its K/V in
the request's block before any layer reads that block; a block is saved only after every layer
wrote it (``save_kv_layer`` runs after the layer's cache write, ``wait_for_save`` after the
last layer).

upstream: vllm/distributed/kv_transfer/kv_connector/v1/base.py:181 @ v0.33.0
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]


class KVConnectorRole(enum.Enum):
    """Which half of the connector an instance is.

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/base.py:139 @ v0.33.0
    """

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 - a base for each connector's own dataclass
    """What the scheduler side tells the worker side for one step (each connector subclasses).

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/base.py:155 @ v0.33.0
    """


class KVConnectorBase_V1(ABC):  # noqa: N801 - upstream's name
    """The two halves of a KV connector (see the module docstring for when each hook runs).

    upstream: vllm/distributed/kv_transfer/kv_connector/v1/base.py:181 @ v0.33.0
    """

    def __init__(self, role: KVConnectorRole) -> None:
        self.role = role
        self._metadata: KVConnectorMetadata | None = None
        self.kv_cache_manager: Any = None

    # ---------------------------------------------------------------- worker side

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Hold this step's metadata for the hooks of the forward pass."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Drop the step's metadata once the step is over."""
        self._metadata = None

    def register_kv_caches(self, kv_caches: dict[str, tuple[Any, Any]]) -> None:
        """The runner's paged caches, ``layer name -> (key_cache, value_cache)``, once."""
        return None  # a connector that moves nothing on the worker side needs none

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads (before the forward pass)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once ``layer_name``'s loads are in its cache (before the layer reads it)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: tuple[Any, Any],
                      attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s blocks to save (after the layer wrote its cache)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish this step's saves (after the forward pass)."""

    # ---------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """The scheduler's KV cache manager (to look up the blocks a request holds)."""
        self.kv_cache_manager = kv_cache_manager

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of ``request`` beyond ``num_computed_tokens`` (its local prefix-cache hit)
        that this connector can load, and whether the load runs between steps (ours: never)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """``request`` was admitted: ``blocks`` (a ``KVCacheBlocks``) are all its blocks, and
        ``num_external_tokens`` of its tokens, after the local hit, are to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """What the worker side must move in this step; resets the per-step state."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        """``request`` is done and its blocks about to be freed; returns whether the freeing
        must wait for a save still in flight (ours finish within the step: never) and any
        parameters to return to the client."""
        return False, None

    def shutdown(self) -> None:
        """Release what the connector holds (connections, shared memory)."""
        return None
