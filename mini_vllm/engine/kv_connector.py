"""A KV connector's scheduler side, driven around the scheduler (lab 04-06).

Upstream's scheduler calls the connector from inside its admission loop. Here the engine calls
it around ``schedule()`` instead (it wraps the scheduler's ``schedule``), so that any scheduler
and any engine step (labs 03-01 and 03-04, a student's own included) work with it unchanged:

1. **Before** ``schedule()``: for each waiting request not looked up yet, the connector says how
   many tokens past the local prefix-cache hit it can supply
   (``get_num_new_matched_tokens``). That many blocks are taken from the pool, reported to the
   connector as the request's (``update_state_after_alloc``: its load goes into them), entered
   into the prefix cache under the request's block hashes and given back. Admission then finds
   them as an ordinary prefix hit: the scheduler counts them as computed and schedules the rest.
2. **After** ``schedule()``: a producer remembers each newly scheduled request
   (``update_state_after_alloc`` with no external tokens), requests finished since the last step
   are forgotten (``request_finished``), and the step's loads and saves
   (``build_connector_meta``) ride in the scheduler's output to the runner.

Why it is safe to cache blocks before their load: the load goes out in this very step and is
written into each layer's cache before that layer's attention runs. A loaded block that is
evicted and handed to another request in the same step is overwritten by that request's own
K/V, written after the load, and its other slots are never read.

upstream: vllm/v1/core/sched/scheduler.py:699 @ v0.33.0 (the connector's calls in the admission
loop, get_num_new_matched_tokens and update_state_after_alloc, and build_connector_meta after
the step is planned)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mini_vllm.core.kv_cache_manager import KVCacheBlocks

__all__ = ["KVConnectorScheduling"]


@dataclass
class _Finished:
    """A request that is gone, as ``request_finished`` needs it (its id)."""

    request_id: str


class KVConnectorScheduling:
    """``connector``'s scheduler side around ``scheduler`` (see the module docstring).

    upstream: vllm/v1/core/sched/scheduler.py:699 @ v0.33.0
    """

    def __init__(self, scheduler: Any, connector: Any) -> None:
        self.scheduler = scheduler
        self.connector = connector
        connector.bind_kv_cache_manager(scheduler.kv_cache_manager)
        self._looked_up: set[str] = set()
        # Around this scheduler's own schedule(), whoever calls it (lab 03-04's step included).
        plain = scheduler.schedule

        def schedule() -> Any:
            self.before_schedule()
            scheduler_output = plain()
            self.after_schedule(scheduler_output)
            return scheduler_output

        scheduler.schedule = schedule

    def _local_hit(self, request: Any) -> list:
        """The cached blocks of the request's leading run of hashes (the lookup admission makes,
        without counting it in the prefix-cache statistics)."""
        manager = self.scheduler.kv_cache_manager
        group = [manager.kv_cache_group_id]
        blocks = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // manager.block_size]:
            cached = manager.block_pool.get_cached_block(block_hash, group)
            if cached is None:
                break
            blocks.append(cached[0])
        return blocks

    def before_schedule(self) -> None:
        """Turn what the connector can load for waiting requests into prefix-cache blocks."""
        manager = self.scheduler.kv_cache_manager
        if not getattr(self.connector, "is_consumer", False) or not manager.enable_caching:
            return
        pool, bs = manager.block_pool, manager.block_size
        for request in self.scheduler.waiting:
            if request.request_id in self._looked_up:
                continue
            self._looked_up.add(request.request_id)
            local = self._local_hit(request)
            num_external, _ = self.connector.get_num_new_matched_tokens(request, len(local) * bs)
            count = num_external // bs
            if count > pool.get_num_free_blocks() - 1:  # no room now: it computes them instead
                count, num_external = 0, 0
            loaded = pool.get_new_blocks(count) if count else []
            self.connector.update_state_after_alloc(request, KVCacheBlocks((local + loaded,)),
                                                    num_external)
            if loaded:
                pool.cache_full_blocks(request, local + loaded, len(local),
                                       len(local) + count, bs, manager.kv_cache_group_id)
                pool.free_blocks(reversed(loaded))  # the tail goes first, as a request's does

    def after_schedule(self, scheduler_output: Any) -> None:
        """Producers remember the new requests; finished ones are forgotten; the step's loads
        and saves go into ``scheduler_output.kv_connector_metadata``."""
        connector = self.connector
        for request_id in scheduler_output.finished_req_ids:
            self._looked_up.discard(request_id)
            connector.request_finished(_Finished(request_id), [])
        if getattr(connector, "is_producer", False):
            manager = self.scheduler.kv_cache_manager
            for new in scheduler_output.scheduled_new_reqs:
                request = self.scheduler.requests[new.req_id]
                connector.update_state_after_alloc(request, manager.get_blocks(new.req_id), 0)
        scheduler_output.kv_connector_metadata = connector.build_connector_meta(scheduler_output)

    def shutdown(self) -> None:
        self.connector.shutdown()
