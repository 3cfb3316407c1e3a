"""Lab 04-06 solution: the reference lives in ``mini_vllm.distributed.kv_transfer.block_connector``
(the connector's two sides) and ``mini_vllm.worker.kv_connector_model_runner_mixin`` (the hooks
around a layer's attention)."""

from __future__ import annotations

from mini_vllm.distributed.kv_transfer.block_connector import BlockStoreConnector
from mini_vllm.worker.kv_connector_model_runner_mixin import ConnectorAttention

__all__ = ["BlockStoreConnector", "ConnectorAttention"]
