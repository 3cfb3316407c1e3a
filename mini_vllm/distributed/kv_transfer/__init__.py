"""Moving KV between engines: the KV connector API (:mod:`.base`), a connector that ships a
prompt's full blocks by their hash-chain keys (:mod:`.block_connector`), and the stores it ships
them through (:mod:`.block_store`: shared memory or TCP).

A prefill engine (``kv_role="kv_producer"``) saves the blocks of every prompt it computes; a
decode engine (``"kv_consumer"``) finds the longest run of a new prompt's blocks in the store,
loads them into blocks of its own pool and computes only the rest. Nothing here imports the rest
of mini_vllm: the scheduler and the runner call the connector, not the other way round.

upstream: vllm/distributed/kv_transfer/ @ v0.33.0
"""

from mini_vllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from mini_vllm.distributed.kv_transfer.block_connector import (
    BlockStoreConnector,
    BlockStoreConnectorBase,
    BlockStoreConnectorMetadata,
    LoadSpec,
    SaveSpec,
)
from mini_vllm.distributed.kv_transfer.block_store import (
    KVBlockStore,
    MemoryBlockStore,
    SharedMemoryBlockStore,
    TcpBlockStore,
    remove_shm_segments,
)

__all__ = [
    "BlockStoreConnector",
    "BlockStoreConnectorBase",
    "BlockStoreConnectorMetadata",
    "KVBlockStore",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "LoadSpec",
    "MemoryBlockStore",
    "SaveSpec",
    "SharedMemoryBlockStore",
    "TcpBlockStore",
    "remove_shm_segments",
]
