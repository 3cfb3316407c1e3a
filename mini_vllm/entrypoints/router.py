"""A cache-aware router in front of ``dp_size`` engines (data parallelism behind a router).

Each engine keeps its own prefix cache, so where a request goes decides whether its prompt's
blocks are found. :class:`PrefixRouter` hashes a prompt's full blocks into the same parent-chained
hashes the engine's prefix cache uses, and sends the request to the engine that (as far as the
router knows) holds the longest leading run of them, unless that engine is too busy: then the
least-loaded one takes it. :class:`RoundRobinRouter` ignores the prompt, as a plain load balancer
does. :class:`RoutedEngines` holds the engines (each an :class:`~mini_vllm.engine.async_llm.
AsyncLLM` with its engine core in a process of its own) and routes every ``generate`` call.

    with RoutedEngines(dp_size=2, num_gpu_blocks=64) as engines:
        async for out in engines.generate("To be, or not", SamplingParams(max_tokens=16)):
            ...

The router's view of a cache is approximate: it remembers what it sent, not what the engine
kept, so it forgets on its own (an LRU as large as the engine's KV cache) and never hears of the
blocks a decode fills.

upstream: none (course-only; vLLM's own data-parallel client balances engines by load alone,
``DPLBAsyncMPClient.get_core_engine_for_request`` in vllm/v1/engine/core_client.py @ v0.33.0, fed
by vllm/v1/engine/coordinator.py; cache-aware routing lives in routers outside vLLM, such as
SGLang's cache-aware router and llm-d's prefix-cache scorer)
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mini_vllm.core.kv_cache_utils import BlockHash, hash_block_tokens, sha256
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

__all__ = ["PrefixRouter", "PrefixRouterBase", "RoundRobinRouter", "RoutedEngines", "RouterBase",
           "prompt_block_hashes"]


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache names them
    (no LoRA, no cache salt): block ``i``'s hash is ``hash_block_tokens(sha256, hash of block
    i - 1, its tokens)``, block 0's parent is ``None`` (``NONE_HASH``), so hash ``i`` names tokens
    ``[0, (i + 1) * block_size)``. A partial last block has no hash (lab 04-07, task 1).

    upstream: none (course-only; the engine hashes a Request with the same chain,
    get_request_block_hasher in vllm/v1/core/kv_cache_utils.py)
    """
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(sha256, parent, prompt_token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class RouterBase:
    """What every router keeps: ``loads``, the outstanding requests of each engine. A router's
    ``route(prompt_token_ids)`` picks an engine and counts the request there; ``finished``
    is called once per routed request when it ends.

    upstream: none (course-only; see the module docstring)
    """

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"router: need at least one engine, got {num_engines}")
        self.loads = [0] * num_engines  # outstanding requests per engine

    def finished(self, engine_index: int) -> None:
        """One request routed to ``engine_index`` ended (finished, failed or abandoned)."""
        if self.loads[engine_index] <= 0:
            raise ValueError(f"router: engine {engine_index} has no outstanding request")
        self.loads[engine_index] -= 1


class RoundRobinRouter(RouterBase):
    """Engine ``0, 1, ..., n - 1, 0, ...`` whatever the prompt: the baseline.

    upstream: none (course-only; see the module docstring)
    """

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = itertools.cycle(range(num_engines))

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        index = next(self._next)
        self.loads[index] += 1
        return index


class PrefixRouterBase(RouterBase):
    """The state of a cache-aware router: ``caches[e]``, the block hashes the router believes
    engine ``e`` holds (a dict of hash -> None, in order: least recently routed first),
    bounded by ``num_blocks``, each engine's usable KV blocks; ``block_size``; and
    ``balance_abs_threshold``: when the best-matching engine has more than this many
    outstanding requests beyond the least-loaded one, the least-loaded one takes the request
    (one hot prefix must not pile every request onto one engine; SGLang's router's knob of that
    name).

    upstream: none (course-only; see the module docstring)
    """

    def __init__(self, num_engines: int, *, block_size: int, num_blocks: int,
                 balance_abs_threshold: int = 8) -> None:
        super().__init__(num_engines)
        if block_size < 1 or num_blocks < 1 or balance_abs_threshold < 0:
            raise ValueError(f"PrefixRouter: need block_size >= 1, num_blocks >= 1 and "
                             f"balance_abs_threshold >= 0, got {block_size}, {num_blocks} and "
                             f"{balance_abs_threshold}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.caches: list[dict[BlockHash, None]] = [{} for _ in range(num_engines)]


class PrefixRouter(PrefixRouterBase):
    """Route to the engine whose cache (as the router saw it fill) holds the longest leading run
    of the prompt's block hashes; ties, and prompts nobody holds, go to the least-loaded engine
    (then the one holding fewest blocks, so new prefixes spread out). Lab 04-07's tasks.

    upstream: none (course-only; see the module docstring)
    """

    def matched_blocks(self, engine_index: int, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, the engine's cache holds. Only a leading run
        counts: a hit on block ``i`` alone is useless, as the engine's lookup stops at a miss.

        upstream: none (course-only; the engine's own lookup is find_longest_cache_hit)
        """
        cache = self.caches[engine_index]
        return next((i for i, h in enumerate(hashes) if h not in cache), len(hashes))

    def remember(self, engine_index: int, hashes: Sequence[BlockHash]) -> None:
        """Mark ``hashes`` as the engine's most recent blocks, evicting the least recent ones
        past ``num_blocks``. The tail goes in first so the head is the freshest: the engine
        frees a request's blocks tail first too, so a shared prefix outlives the suffixes that
        hang off it.

        upstream: none (course-only; see the module docstring)
        """
        cache = self.caches[engine_index]
        for h in reversed(hashes):
            cache.pop(h, None)
            cache[h] = None  # a dict keeps insertion order: this is now the most recent
        while len(cache) > self.num_blocks:
            del cache[next(iter(cache))]  # the least recent

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The engine for this prompt (see the class docstring): the longest leading match,
        unless nobody matches or the best is more than ``balance_abs_threshold`` requests
        busier than the least loaded; the chosen engine remembers the prompt's hashes and
        counts the request.

        upstream: none (course-only; see the module docstring)
        """
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        engines = range(len(self.loads))
        matched = [self.matched_blocks(e, hashes) for e in engines]
        least = min(engines, key=lambda e: (self.loads[e], len(self.caches[e]), e))
        best = max(engines, key=lambda e: (matched[e], -self.loads[e], -len(self.caches[e]), -e))
        too_busy = self.loads[best] - self.loads[least] > self.balance_abs_threshold
        index = least if matched[best] == 0 or too_busy else best
        self.remember(index, hashes)
        self.loads[index] += 1
        return index


class RoutedEngines:
    """``dp_size`` engines behind a router, with ``AsyncLLM.generate``'s shape.

    Each engine is ``AsyncLLM(LLM(model, **llm_kwargs), multiprocessing=True)``: its engine core
    runs in a process of its own, so the engines step in parallel. ``policy``: ``"prefix"``
    (:class:`PrefixRouter`) or ``"round_robin"``. Every engine and its process is stopped by
    :meth:`shutdown`, which ``with`` / ``async with`` call on the way out, exception or not.

    Invariants: with greedy sampling, every request's tokens equal one engine's; each routed
    request is counted outstanding on its engine until its stream ends (finished, failed or
    abandoned).

    upstream: none (course-only; see the module docstring)
    """

    def __init__(self, model: Any = None, *, dp_size: int = 2, policy: str = "prefix",
                 balance_abs_threshold: int = 8, step_timeout_s: float | None = 60.0,
                 **llm_kwargs: Any) -> None:
        if policy not in ("prefix", "round_robin") or dp_size < 1:
            raise ValueError(f"RoutedEngines: need policy 'prefix' or 'round_robin' and "
                             f"dp_size >= 1, got {policy!r} and {dp_size}")
        self.engines: list[AsyncLLM] = []
        self.routed = [0] * dp_size  # requests sent to each engine so far
        self._ids = itertools.count()
        try:
            for _ in range(dp_size):
                self.engines.append(AsyncLLM(LLM(model, **llm_kwargs), multiprocessing=True,
                                             step_timeout_s=step_timeout_s))
        except BaseException:  # a half-built set leaves no process behind
            self.shutdown()
            raise
        sched = self.engines[0].llm._scheduler_config
        self.router: RouterBase = (
            PrefixRouter(dp_size, block_size=sched.block_size, num_blocks=sched.num_gpu_blocks - 1,
                         balance_abs_threshold=balance_abs_threshold)
            if policy == "prefix" else RoundRobinRouter(dp_size))

    @property
    def tokenizer(self) -> Any:
        return self.engines[0].tokenizer

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Route the request, then stream its engine's output (as
        :meth:`AsyncLLM.generate <mini_vllm.engine.async_llm.AsyncLLM.generate>` does).

        upstream: none (course-only; see the module docstring)
        """
        request_id = request_id or f"dp-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        _, ids = self.engines[0].llm._parse_one(prompt, "the prompt")  # bad input: raises here
        index = self.router.route(ids)
        self.routed[index] += 1
        try:
            async for out in self.engines[index].generate(prompt, sampling_params, request_id):
                yield out
        finally:
            self.router.finished(index)

    def prefix_cache_stats(self) -> list[dict[str, float]]:
        """Per engine: prompt tokens looked up in its prefix cache (``queries``), found
        (``hits``), and ``hit_rate``. The engine core counts them and sends them with every
        step's outputs, so they are current as of the last step this process has read.

        upstream: none (course-only; vLLM exports them per engine as vllm:prefix_cache_queries
        and vllm:prefix_cache_hits)
        """
        stats = []
        for engine in self.engines:
            load = engine.stat_logger.load
            q, h = load.prefix_cache_queries, load.prefix_cache_hits
            stats.append({"queries": q, "hits": h, "hit_rate": h / q if q else 0.0})
        return stats

    def shutdown(self) -> None:
        """Stop every engine and its process, even if stopping one of them fails. Safe to call
        twice."""
        errors = []
        for engine in self.engines:
            try:
                engine.shutdown()
            except BaseException as exc:  # noqa: BLE001 - stop the rest first, then re-raise
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> RoutedEngines:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def __enter__(self) -> RoutedEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
