"""Lab 04-07 starter: a cache-aware router.

Fill in every body that raises ``NotImplementedError``, in the task order of this lab's README.
Each docstring is a contract. When stuck, climb the hint ladder: ``python -m course hint 04-07 N``
(a question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and
the tests that check it), then ``--level 4`` (the upstream lines to read).

Several engines, each with its own prefix cache, serve one stream of requests. You write the
router that sends each request where its prompt's blocks already are: the prompt's block hashes
as the engines' caches name them (task 1), the router's picture of each engine's cache (task 2),
and the choice, affinity against load (task 3). Given, in ``mini_vllm``: the router's state
(``PrefixRouterBase``: ``loads``, ``caches``, ``block_size``, ``num_blocks``,
``balance_abs_threshold``; ``finished``), lab 02-01's ``hash_block_tokens``, and
``RoutedEngines``, which runs ``dp_size`` engines in processes of their own behind your router.

Run the tests against this file with::

    LAB_IMPL=starter python -m pytest phase-04-vllm-today/labs/lab-07-cache-aware-router -q
"""

from __future__ import annotations

from collections.abc import Sequence

from mini_vllm.core.kv_cache_utils import BlockHash, hash_block_tokens, sha256  # noqa: F401
from mini_vllm.entrypoints.router import PrefixRouterBase

__all__ = ["PrefixRouter", "prompt_block_hashes"]


# ---------------------------------------------------------------------------- task 1


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Task 1. The hashes of the prompt's full blocks, as an engine's prefix cache names them:
    block ``i``'s hash is ``hash_block_tokens(sha256, parent, its block_size tokens)``, where the
    parent is block ``i - 1``'s hash (``None`` for block 0). A partial last block has no hash;
    a prompt shorter than a block has none.
    """
    raise NotImplementedError(
        "lab 04-07, task 1: implement prompt_block_hashes (hint: python -m course hint 04-07 1)")


class PrefixRouter(PrefixRouterBase):
    """Route each prompt to the engine whose cache, as far as the router knows, holds the
    longest leading run of its block hashes (the state is described on ``PrefixRouterBase``)."""

    # ------------------------------------------------------------------------ task 2

    def matched_blocks(self, engine_index: int, hashes: Sequence[BlockHash]) -> int:
        """Task 2. How many of ``hashes``, counted from the first, ``self.caches[engine_index]``
        holds: the run stops at the first hash it lacks (an engine's lookup stops there too).
        """
        raise NotImplementedError(
            "lab 04-07, task 2: implement PrefixRouter.matched_blocks "
            "(hint: python -m course hint 04-07 2)")

    def remember(self, engine_index: int, hashes: Sequence[BlockHash]) -> None:
        """Task 2. Record that the engine now holds ``hashes``, as its most recent blocks: the
        cache is a dict (hash -> None) whose order is recency, the last entries the most recent
        (a dict keeps the order keys were put in). Put them in from the
        last hash to the first, so that the prompt's first block ends most recent (the engine
        frees a request's blocks tail first: a shared prefix outlives the suffixes after it); a
        hash already there moves. Then drop the least recent entries until at most
        ``self.num_blocks`` remain.
        """
        raise NotImplementedError(
            "lab 04-07, task 2: implement PrefixRouter.remember "
            "(hint: python -m course hint 04-07 2)")

    # ------------------------------------------------------------------------ task 3

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """Task 3. The engine for this prompt. The *best* engine matches the most leading blocks
        (ties: fewer outstanding requests in ``self.loads``, then fewer remembered blocks, then
        the lower index); the *least loaded* has the fewest outstanding requests (ties: fewer
        remembered blocks, then the lower index). The request goes to the best engine, unless
        no engine matches a block or the best one's load exceeds the least loaded one's by more
        than ``self.balance_abs_threshold``: then to the least loaded. The chosen engine
        remembers the prompt's hashes and counts one more outstanding request.
        """
        raise NotImplementedError(
            "lab 04-07, task 3: implement PrefixRouter.route (hint: python -m course hint 04-07 3)")
