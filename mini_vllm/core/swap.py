"""The CPU side of V0-style preemption by swapping: a CPU block pool and the swap mappings.

When the GPU runs out of blocks, a preempted request can keep its KV instead of dropping it: the
scheduler asks :class:`SwapSpace` for CPU blocks, one per GPU block that holds computed tokens,
and tells the runner to copy GPU block ``g`` to CPU block ``c`` for each pair ``(g, c)``
(``blocks_to_swap_out``). Later it allocates fresh GPU blocks and tells the runner to copy each
CPU block back (``blocks_to_swap_in``, pairs ``(c, g)``), then frees the CPU blocks.

Invariants (lab 03-03 checks them after every step):

* a request is either on the GPU (the KV cache manager holds its blocks) or on the CPU
  (``req_to_cpu_blocks`` holds them), never both and never neither while it has computed KV;
* logical block ``i`` of a request always maps to entry ``i`` of the mapping: swap-out pairs the
  request's GPU blocks with its CPU blocks in block-table order, swap-in pairs them back in the
  same order, so the KV a request resumes with is exactly the KV it left with;
* every CPU block (except the null block 0, reserved as on the GPU) is either free or owned by
  exactly one swapped request.

Nothing here touches tensors: the runner executes the mappings with
:func:`mini_vllm.attention.cache_ops.swap_blocks`.

upstream: vllm/core/block_manager.py:416 @ v0.10.2
"""

from __future__ import annotations

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import KVCacheBlock

__all__ = ["SwapSpace"]


class SwapSpace:
    """CPU blocks of swapped-out requests (block 0 of the CPU pool is never used).

    upstream: vllm/core/block_manager.py:22 @ v0.10.2
    """

    def __init__(self, num_cpu_blocks: int) -> None:
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 2:
            raise ValueError(
                f"SwapSpace: num_cpu_blocks must be an int >= 2 (block 0 is reserved), "
                f"got {num_cpu_blocks!r}"
            )
        # No prefix caching on the CPU side: a CPU block only parks one request's KV.
        self.block_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.req_to_cpu_blocks: dict[str, list[KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        """CPU blocks available for swapping out."""
        return self.block_pool.get_num_free_blocks()

    def can_swap_out(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` GPU blocks fit into the free CPU blocks.

        upstream: vllm/core/block_manager.py:402 @ v0.10.2
        """
        return 0 <= num_blocks <= self.get_num_free_blocks()

    def num_swapped_blocks(self, request_id: str) -> int:
        """How many CPU blocks ``request_id`` holds (0 when it is not swapped out)."""
        return len(self.req_to_cpu_blocks.get(request_id, ()))

    def swap_out(self, request_id: str, gpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """Give ``request_id`` one CPU block per GPU block; return ``[(gpu_id, cpu_id), ...]``.

        Pair ``i`` is the request's logical block ``i``. Raises ``ValueError`` (changing nothing)
        when the request is already swapped out or the CPU pool is too small.

        upstream: vllm/core/block_manager.py:416 @ v0.10.2
        """
        if request_id in self.req_to_cpu_blocks:
            raise ValueError(f"swap_out: request {request_id!r} is already swapped out")
        if not self.can_swap_out(len(gpu_block_ids)):
            raise ValueError(
                f"swap_out: {len(gpu_block_ids)} block(s) do not fit into the "
                f"{self.get_num_free_blocks()} free CPU block(s); check can_swap_out first"
            )
        cpu_blocks = self.block_pool.get_new_blocks(len(gpu_block_ids))
        self.req_to_cpu_blocks[request_id] = cpu_blocks
        return [(g, c.block_id) for g, c in zip(gpu_block_ids, cpu_blocks)]

    def swap_in(self, request_id: str, gpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """Pair the request's CPU blocks with new GPU blocks; free the CPU blocks.

        ``gpu_block_ids`` must hold exactly one GPU block per swapped block, in block-table
        order. Returns ``[(cpu_id, gpu_id), ...]``. Raises ``ValueError`` (changing nothing) for a
        request that is not swapped out or a wrong number of GPU blocks.

        upstream: vllm/core/block_manager.py:365 @ v0.10.2
        """
        cpu_blocks = self.req_to_cpu_blocks.get(request_id)
        if cpu_blocks is None:
            raise ValueError(f"swap_in: request {request_id!r} is not swapped out")
        if len(gpu_block_ids) != len(cpu_blocks):
            raise ValueError(
                f"swap_in: request {request_id!r} has {len(cpu_blocks)} CPU block(s) but "
                f"{len(gpu_block_ids)} GPU block(s) were given"
            )
        del self.req_to_cpu_blocks[request_id]
        mapping = [(c.block_id, g) for c, g in zip(cpu_blocks, gpu_block_ids)]
        self.block_pool.free_blocks(cpu_blocks)
        return mapping

    def free(self, request_id: str) -> None:
        """Drop a swapped request's CPU blocks without copying (it finished or was aborted)."""
        cpu_blocks = self.req_to_cpu_blocks.pop(request_id, None)
        if cpu_blocks:
            self.block_pool.free_blocks(cpu_blocks)
