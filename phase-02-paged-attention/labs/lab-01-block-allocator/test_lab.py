"""Graded tests of lab 02-01: the paged block allocator.

Groups (see the README): free-queue mechanics; allocate/free round trips (I1 both ways); no
dedup of identical content (I2); partial blocks never cached (I3); revive from the middle via
touch (I4) in O(1); eviction drops the index entry; the null block; the hash chain; errors that
change nothing; events; reset_prefix_cache; and a stateful machine checking I1-I4 after every
step. Several tests port upstream's tests/v1/core/test_kv_cache_utils.py and
test_prefix_caching.py at v0.11.0, with the same block ids and free-queue orders.

Task by task: every test uses only the task it is about and the tasks before it (set-ups that
need a later task build the state by hand with the complete helpers), so a student sees tests
pass after each task. `scripts/task_by_task.py 02-01` checks that.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from course.labs.loader import load_lab
from course.labs.student_process import read

lab = load_lab(__file__)


# ---------------------------------------------------------------------------------------------
# Helpers (plain functions: they touch `lab` only when a test calls them)
# ---------------------------------------------------------------------------------------------


@dataclass
class LoRA:
    lora_int_id: int


@dataclass
class FakeRequest:
    """The attributes of mini_vllm's Request that the hasher and the pool read."""

    all_token_ids: list[int]
    block_size: int
    lora_request: LoRA | None = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)
        self.block_hashes.extend(self._hash_new_blocks())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_tokens(self, tokens: list[int]) -> None:
        self.all_token_ids.extend(tokens)
        self.block_hashes.extend(self._hash_new_blocks())

    def _hash_new_blocks(self) -> list[bytes]:
        """The request's full blocks not hashed yet, chained with the lab's hash_block_tokens:
        the request hasher (lab 02-03 writes it), with the LoRA id on every block and the salt
        on the first."""
        bs, out = self.block_size, []
        parent = self.block_hashes[-1] if self.block_hashes else None
        for start in range(len(self.block_hashes) * bs, self.num_tokens - bs + 1, bs):
            keys = [self.lora_request.lora_int_id] if self.lora_request else []
            keys += [self.cache_salt] if start == 0 and self.cache_salt else []
            tokens = self.all_token_ids[start : start + bs]
            parent = lab.hash_block_tokens(lab.sha256, parent, tokens, tuple(keys) or None)
            out.append(parent)
        return out


def impl_module(function):
    """The module a lab function lives in (starter.py or mini_vllm's module), where it reads
    its globals."""
    return lab.module_of(function)


def none_hash() -> bytes:
    """The NONE_HASH the lab's hash_block_tokens reads (its module global, read now)."""
    return impl_module(lab.hash_block_tokens).NONE_HASH


def ref_hash(parent: bytes | None, tokens, extra=None, seed: bytes | None = None) -> bytes:
    """Independent reference of the chained hash: sha256 of the pickled triple (`seed`: the
    NONE_HASH to start from, read from the lab's module when not given)."""
    parent = parent or seed or none_hash()
    data = pickle.dumps((parent, tuple(tokens), extra), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


def ref_chain(tokens: list[int], block_size: int, seed: bytes | None = None) -> list[bytes]:
    seed = seed or none_hash()
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(ref_hash(parent, tokens[start : start + block_size], seed=seed))
    return hashes


def key(block_hash: bytes, group_id: int = 0) -> bytes:
    return lab.make_block_hash_with_group_id(block_hash, group_id)


def walk_free(queue, limit: int) -> list:
    """The queue's blocks front to back, following next pointers for at most `limit` blocks, so
    that a broken list (a cycle, a lost sentinel) fails the test instead of hanging it."""
    out = []
    block = queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        assert block is not None, f"the free list ends without the tail sentinel after {out}"
        assert len(out) < limit, f"the free list has more than {limit} blocks: a cycle?"
        out.append(block)
        block = block.next_free_block
    return out


def free_ids(pool) -> list[int]:
    pool = read(pool)
    return [b.block_id for b in walk_free(pool.free_block_queue, len(pool.blocks))]


def index_ids(pool) -> dict[bytes, list[int]]:
    """The prefix-cache index as {key: sorted block ids}."""
    out = {}
    for k, v in read(pool).cached_block_hash_to_block._cache.items():
        out[k] = sorted(v) if isinstance(v, dict) else [v.block_id]
    return out


def snapshot(pool) -> tuple:
    """Everything a failed call must leave untouched."""
    live, pool = pool, read(pool)  # the pool in one read, where the lab has its process
    # Pointers exactly None when unlinked: a "" or 0 left behind is a corrupted block.
    blocks = tuple(
        (
            b.block_id,
            b.ref_cnt,
            b.block_hash,
            b.prev_free_block.block_id if b.prev_free_block is not None else None,
            b.next_free_block.block_id if b.next_free_block is not None else None,
        )
        for b in pool.blocks
    )
    return (
        blocks,
        tuple(free_ids(pool)),
        live.get_num_free_blocks(),
        index_ids(pool),
        len(pool.kv_event_queue),
    )


def allocate_and_cache(pool, req: FakeRequest) -> list:
    """Allocate blocks for every token of `req` and cache its full blocks (no prefix lookup)."""
    n_blocks = -(-req.num_tokens // req.block_size)
    blocks = pool.get_new_blocks(n_blocks)
    pool.cache_full_blocks(req, blocks, 0, req.num_tokens // req.block_size, req.block_size, 0)
    return blocks


def queue_of(n: int):
    blocks = [lab.KVCacheBlock(i) for i in range(n)]
    return blocks, lab.FreeKVCacheBlockQueue(blocks)


# ---------------------------------------------------------------------------------------------
# The given helpers (complete in the starter too: not graded)
# ---------------------------------------------------------------------------------------------


@pytest.mark.starter_ok
def test_kv_cache_block_hash_is_set_once_and_reset():
    block = lab.KVCacheBlock(block_id=0)
    assert (block.block_id, block.ref_cnt, block.block_hash) == (0, 0, None), (
        "a new KVCacheBlock(0) has block_id 0, ref_cnt 0 and no hash; got "
        f"{(block.block_id, block.ref_cnt, block.block_hash)!r:.80}"
    )
    k = key(b"abc")
    block.block_hash = k
    assert block.block_hash == k, (
        f"setting block.block_hash must store the key; block_hash is {block.block_hash!r:.60}"
    )
    with pytest.raises(AssertionError):
        block.block_hash = key(b"def")
    block.reset_hash()
    assert block.block_hash is None, (
        f"reset_hash() must clear the block's hash; block_hash is {block.block_hash!r:.60}"
    )


@pytest.mark.starter_ok
def test_none_hash_follows_pythonhashseed(monkeypatch):
    m = impl_module(lab.init_none_hash)
    saved = m.NONE_HASH
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
        lab.init_none_hash(lab.sha256)
        assert m.NONE_HASH == lab.sha256("python hash seed"), (
            "with PYTHONHASHSEED set, init_none_hash must set NONE_HASH = sha256(the seed); got "
            f"{m.NONE_HASH!r:.60}"
        )
        monkeypatch.delenv("PYTHONHASHSEED")
        lab.init_none_hash(lab.sha256)
        assert isinstance(m.NONE_HASH, bytes) and len(m.NONE_HASH) == 32, (
            "without PYTHONHASHSEED, NONE_HASH must be 32 random bytes; got "
            f"{type(m.NONE_HASH).__name__} {m.NONE_HASH!r:.60}"
        )
    finally:
        m.NONE_HASH = saved


@pytest.mark.starter_ok
def test_block_hash_to_block_map_keeps_duplicates():
    cache = lab.BlockHashToBlockMap()
    k0, k1 = key(b"h0"), key(b"h1")
    b0, b1, b10 = lab.KVCacheBlock(0), lab.KVCacheBlock(1), lab.KVCacheBlock(10)
    cache.insert(k0, b0)
    cache.insert(k0, b1)
    cache.insert(k1, b10)
    assert cache.pop(k0, 100) is None and cache.get_one_block(k0) is b0, (
        "pop(k0, 100): no block 100 under k0, so None and block 0 still first under k0; "
        f"get_one_block(k0) is now {getattr(cache.get_one_block(k0), 'block_id', None)}"
    )
    assert cache.pop(k0, 0) is b0 and cache.get_one_block(k0) is b1, (
        "pop(k0, 0) must return block 0 and leave block 1 under k0; get_one_block(k0) is now "
        f"{getattr(cache.get_one_block(k0), 'block_id', None)}"
    )
    assert cache.pop(k0, 1) is b1 and cache.get_one_block(k0) is None, (
        "pop(k0, 1) must return block 1 and leave nothing under k0; get_one_block(k0) is now "
        f"{getattr(cache.get_one_block(k0), 'block_id', None)}"
    )
    assert cache.pop(k1, 2) is None and cache.get_one_block(k1) is b10, (
        "pop(k1, 2): block 2 is not under k1, so None and block 10 stays; get_one_block(k1) is "
        f"{getattr(cache.get_one_block(k1), 'block_id', None)}"
    )
    assert len(cache) == 1, (
        f"after k0 is emptied only k1 stays in the map: len is {len(cache)}, expected 1"
    )


# ---------------------------------------------------------------------------------------------
# Free-queue mechanics
# ---------------------------------------------------------------------------------------------


def test_queue_starts_in_block_order_between_the_sentinels():
    blocks, queue = queue_of(5)
    assert queue.get_all_free_blocks() == blocks, (
        "get_all_free_blocks() of a fresh 5-block queue must list blocks 0-4 front to back, no "
        "sentinels; got ids "
        f"{[getattr(b, 'block_id', b) for b in queue.get_all_free_blocks() or []]}"
    )
    assert queue.num_free_blocks == 5, (
        f"a fresh 5-block queue has num_free_blocks 5, got {queue.num_free_blocks}"
    )
    assert queue.fake_free_list_head.next_free_block is blocks[0], (
        "a fresh queue's head sentinel links to block 0, got "
        f"{getattr(queue.fake_free_list_head.next_free_block, 'block_id', None)}"
    )
    assert queue.fake_free_list_tail.prev_free_block is blocks[4], (
        "a fresh queue's tail sentinel links back to block 4, got "
        f"{getattr(queue.fake_free_list_tail.prev_free_block, 'block_id', None)}"
    )
    empty = lab.FreeKVCacheBlockQueue([])
    assert empty.get_all_free_blocks() == [], (
        "get_all_free_blocks() of an empty queue must be [] (never list a sentinel), got "
        f"{[getattr(b, 'block_id', b) for b in empty.get_all_free_blocks() or []]}"
    )


def test_get_all_free_blocks_follows_pops_removes_and_appends():
    # Upstream's get_all_free_blocks test.
    blocks, queue = queue_of(5)
    queue.popleft()
    assert walk_free(queue, 5) == blocks[1:], (
        "after popleft() the queue from the head must be blocks 1-4, walked "
        f"{[b.block_id for b in walk_free(queue, 5)]}"
    )
    assert queue.get_all_free_blocks() == blocks[1:], (
        "after popleft() the linked list is right (1-4) but get_all_free_blocks() gave "
        f"{[getattr(b, 'block_id', b) for b in queue.get_all_free_blocks() or []]}"
    )
    queue.remove(blocks[2])
    assert walk_free(queue, 5) == [blocks[1], blocks[3], blocks[4]], (
        "after remove(block 2) the queue from the head must be [1, 3, 4], walked "
        f"{[b.block_id for b in walk_free(queue, 5)]}"
    )
    assert queue.get_all_free_blocks() == [blocks[1], blocks[3], blocks[4]], (
        "after remove(block 2) the linked list is right ([1, 3, 4]) but get_all_free_blocks() "
        f"gave {[getattr(b, 'block_id', b) for b in queue.get_all_free_blocks() or []]}"
    )
    queue.append(blocks[2])
    assert walk_free(queue, 5) == [blocks[1], blocks[3], blocks[4], blocks[2]], (
        "after append(block 2) the queue from the head must be [1, 3, 4, 2], walked "
        f"{[b.block_id for b in walk_free(queue, 5)]}"
    )
    assert queue.get_all_free_blocks() == [blocks[1], blocks[3], blocks[4], blocks[2]], (
        "after append(block 2) the linked list is right ([1, 3, 4, 2]) but get_all_free_blocks() "
        f"gave {[getattr(b, 'block_id', b) for b in queue.get_all_free_blocks() or []]}"
    )


def test_popleft_takes_the_front_block_and_unlinks_it():
    blocks, queue = queue_of(5)
    first = queue.popleft()
    assert first is blocks[0], (
        f"popleft() must return the front block 0, got block {getattr(first, 'block_id', first)}"
    )
    assert first.prev_free_block is None and first.next_free_block is None, (
        "popleft() must unlink the block it returns (both pointers None): prev "
        f"{getattr(first.prev_free_block, 'block_id', None)}, next "
        f"{getattr(first.next_free_block, 'block_id', None)}"
    )
    assert queue.num_free_blocks == 4, (
        f"popleft() of 5 blocks leaves num_free_blocks 4, got {queue.num_free_blocks}"
    )
    assert queue.fake_free_list_head.next_free_block is blocks[1], (
        "after popleft() the head sentinel must link to the new front block 1, got "
        f"{getattr(queue.fake_free_list_head.next_free_block, 'block_id', None)}"
    )
    assert blocks[1].prev_free_block is queue.fake_free_list_head, (
        "after popleft() the new front block 1 must link back to the head sentinel, got "
        f"{getattr(blocks[1].prev_free_block, 'block_id', None)}"
    )
    assert walk_free(queue, 1000) == blocks[1:], (
        "after popleft() the queue from the head must be blocks 1-4, walked "
        f"{[b.block_id for b in walk_free(queue, 1000)]}"
    )


def test_popleft_until_empty_then_error():
    blocks, queue = queue_of(3)
    assert [queue.popleft() for _ in range(3)] == blocks, (
        "three popleft() calls on a 3-block queue must return blocks 0, 1, 2 in that order"
    )
    assert queue.num_free_blocks == 0, (
        f"an emptied queue counts num_free_blocks 0, got {queue.num_free_blocks}"
    )
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail, (
        "after popleft() of the last block the head sentinel must link to the tail sentinel"
    )
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head, (
        "after popleft() of the last block the tail sentinel must link back to the head sentinel"
    )
    with pytest.raises(ValueError, match=r"^No free blocks available$"):
        queue.popleft()
    assert queue.num_free_blocks == 0, (
        "popleft() on an empty queue must raise and change nothing: num_free_blocks "
        f"{queue.num_free_blocks}, expected 0"
    )


def test_popleft_n_follows_queue_order_not_block_ids():
    # Upstream's popleft_n test: the queue order is 1, 3, 5, 4, 0, 2.
    blocks = [lab.KVCacheBlock(i) for i in range(6)]
    order = [blocks[i] for i in (1, 3, 5, 4, 0, 2)]
    queue = lab.FreeKVCacheBlockQueue(order)
    assert queue.popleft_n(0) == [] and queue.num_free_blocks == 6, "popleft_n(0) takes nothing"
    got = queue.popleft_n(1)
    assert got == [blocks[1]] and queue.num_free_blocks == 5, (
        f"popleft_n(1) takes the front block (1), got {[b.block_id for b in got]}"
    )
    got += queue.popleft_n(2)
    assert [b.block_id for b in got] == [1, 3, 5] and queue.num_free_blocks == 3, (
        f"the queue order is 1, 3, 5, 4, 0, 2 (not block ids): got {[b.block_id for b in got]}, "
        f"{queue.num_free_blocks} left"
    )
    assert queue.fake_free_list_head.next_free_block is blocks[4], (
        "after popleft_n the head sentinel links to the new front block (4)"
    )
    assert blocks[4].prev_free_block is queue.fake_free_list_head, (
        "the new front block (4) links back to the head sentinel"
    )
    got += queue.popleft_n(3)
    assert [b.block_id for b in got] == [1, 3, 5, 4, 0, 2], (
        f"all six in queue order 1, 3, 5, 4, 0, 2: {[b.block_id for b in got]}"
    )
    stale = [b.block_id for b in got
             if b.prev_free_block is not None or b.next_free_block is not None]
    assert not stale, f"popped blocks keep links into the queue: {stale} (set them to None)"
    assert queue.num_free_blocks == 0, f"an emptied queue counts 0, not {queue.num_free_blocks}"
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail, (
        "an emptied queue links the head sentinel to the tail sentinel"
    )
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head, (
        "an emptied queue links the tail sentinel back to the head sentinel"
    )


def test_popleft_n_more_than_free_raises_and_changes_nothing():
    blocks, queue = queue_of(4)
    with pytest.raises(ValueError, match="5"):
        queue.popleft_n(5)
    assert queue.num_free_blocks == 4, (
        "popleft_n(5) on 4 blocks must raise before changing anything: num_free_blocks "
        f"{queue.num_free_blocks}, expected 4"
    )
    assert walk_free(queue, 1000) == blocks, (
        "popleft_n(5) on 4 blocks must raise before changing anything: the queue must stay 0-3, "
        f"walked {[b.block_id for b in walk_free(queue, 1000)]}"
    )
    with pytest.raises(ValueError):
        queue.popleft_n(-1)
    assert queue.num_free_blocks == 4 and walk_free(queue, 1000) == blocks, (
        "popleft_n(-1) must raise and change nothing: expected 4 free blocks 0-3, num_free_blocks "
        f"is {queue.num_free_blocks}"
    )
    assert all(b.prev_free_block is not None and b.next_free_block is not None for b in blocks), (
        "a refused popleft_n must leave every block linked (no pointer set to None)"
    )


def test_popleft_n_of_everything_leaves_the_sentinels_linked():
    blocks, queue = queue_of(3)
    assert queue.popleft_n(3) == blocks, (
        "popleft_n(3) of a 3-block queue must return blocks 0, 1, 2 in that order"
    )
    assert queue.num_free_blocks == 0, (
        f"popleft_n of every block leaves num_free_blocks 0, got {queue.num_free_blocks}"
    )
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail, (
        "popleft_n of every block must link the head sentinel to the tail sentinel"
    )
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head, (
        "popleft_n of every block must link the tail sentinel back to the head sentinel"
    )


def test_remove_from_the_middle_relinks_both_neighbours():
    blocks, queue = queue_of(5)
    queue.remove(blocks[2])
    assert blocks[1].next_free_block is blocks[3], (
        "remove(block 2) links its front neighbour (1) forward to its back neighbour (3)"
    )
    assert blocks[3].prev_free_block is blocks[1], (
        "remove(block 2) links its back neighbour (3) back to its front neighbour (1)"
    )
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None, (
        "a removed block keeps no links into the queue"
    )
    assert queue.num_free_blocks == 4, f"4 left after one remove, got {queue.num_free_blocks}"
    walked = [b.block_id for b in walk_free(queue, 1000)]
    assert walked == [0, 1, 3, 4], f"the queue from the head must be [0, 1, 3, 4]: {walked}"


def test_remove_first_and_last_relinks_the_sentinels():
    blocks, queue = queue_of(4)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queue.fake_free_list_head.next_free_block is blocks[1], (
        "removing the front block 0 must link the head sentinel to block 1, got "
        f"{getattr(queue.fake_free_list_head.next_free_block, 'block_id', None)}"
    )
    assert blocks[1].prev_free_block is queue.fake_free_list_head, (
        "after removing block 0, block 1 must link back to the head sentinel, got "
        f"{getattr(blocks[1].prev_free_block, 'block_id', None)}"
    )
    assert queue.fake_free_list_tail.prev_free_block is blocks[2], (
        "removing the last block 3 must link the tail sentinel back to block 2, got "
        f"{getattr(queue.fake_free_list_tail.prev_free_block, 'block_id', None)}"
    )
    assert blocks[2].next_free_block is queue.fake_free_list_tail, (
        "after removing block 3, block 2 must link forward to the tail sentinel, got "
        f"{getattr(blocks[2].next_free_block, 'block_id', None)}"
    )
    assert walk_free(queue, 1000) == blocks[1:3] and queue.num_free_blocks == 2, (
        "after removing blocks 0 and 3 the queue must be [1, 2] with num_free_blocks 2; "
        f"num_free_blocks is {queue.num_free_blocks}"
    )


def test_remove_a_block_that_is_not_queued_raises():
    blocks, queue = queue_of(3)
    popped = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(popped)
    assert queue.num_free_blocks == 2 and walk_free(queue, 1000) == blocks[1:], (
        "remove() of a block not in the queue must raise RuntimeError and change nothing: "
        f"num_free_blocks {queue.num_free_blocks} (expected 2), the queue must stay [1, 2]"
    )


def test_remove_a_half_linked_block_raises_naming_it_and_changes_nothing():
    # Adversarial: one pointer set, the other None. Only a check of both refuses it cleanly.
    blocks = [lab.KVCacheBlock(i) for i in (31, 37, 41)]
    queue = lab.FreeKVCacheBlockQueue(blocks)
    stray = lab.KVCacheBlock(block_id=4242)
    stray.prev_free_block = blocks[1]
    with pytest.raises(RuntimeError, match="4242"):
        queue.remove(stray)
    assert queue.num_free_blocks == 3 and walk_free(queue, 10) == blocks, (
        "remove() of a half-linked stray block (4242) must raise before changing anything (check "
        f"both pointers first): num_free_blocks {queue.num_free_blocks}, expected 3"
    )
    assert blocks[1].next_free_block is blocks[2] and blocks[2].prev_free_block is blocks[1], (
        "remove() of the stray block must leave block 37 and 41 linked to each other both ways; "
        f"37.next is {getattr(blocks[1].next_free_block, 'block_id', None)}"
    )


def test_remove_touches_only_the_two_neighbours():
    """O(1) proof: with both sentinels cut off, any walk from either end would crash; removing
    block 500 of 1000 must still work, because it reads only its own two links."""
    blocks, queue = queue_of(1000)
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    saved = (head.next_free_block, tail.prev_free_block)
    head.next_free_block = None
    tail.prev_free_block = None
    queue.remove(blocks[500])
    head.next_free_block, tail.prev_free_block = saved
    assert blocks[499].next_free_block is blocks[501], (
        "remove(block 500) must link block 499 forward to 501, got "
        f"{getattr(blocks[499].next_free_block, 'block_id', None)}"
    )
    assert blocks[501].prev_free_block is blocks[499], (
        "remove(block 500) must link block 501 back to 499, got "
        f"{getattr(blocks[501].prev_free_block, 'block_id', None)}"
    )
    assert queue.num_free_blocks == 999, (
        f"one of 1000 blocks removed: num_free_blocks must be 999, got {queue.num_free_blocks}"
    )
    assert walk_free(queue, 1000) == blocks[:500] + blocks[501:], (
        "after remove(block 500) the queue must be blocks 0-499 then 501-999"
    )


def test_append_links_the_block_before_the_tail():
    blocks, queue = queue_of(5)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert queue.fake_free_list_tail.prev_free_block is blocks[2], (
        "append(block 2) must point the tail sentinel back at block 2, got "
        f"{getattr(queue.fake_free_list_tail.prev_free_block, 'block_id', None)}"
    )
    assert blocks[2].prev_free_block is blocks[4], (
        "append(block 2) must link block 2 back to the old last block 4, got "
        f"{getattr(blocks[2].prev_free_block, 'block_id', None)}"
    )
    assert blocks[2].next_free_block is queue.fake_free_list_tail, (
        "append(block 2) must link block 2 forward to the tail sentinel, got "
        f"{getattr(blocks[2].next_free_block, 'block_id', None)}"
    )
    assert blocks[4].next_free_block is blocks[2], (
        "append(block 2) must link the old last block 4 forward to block 2, got "
        f"{getattr(blocks[4].next_free_block, 'block_id', None)}"
    )
    assert queue.num_free_blocks == 5, (
        f"remove then append of one block leaves num_free_blocks 5, got {queue.num_free_blocks}"
    )
    assert walk_free(queue, 1000) == blocks[:2] + blocks[3:] + [blocks[2]], (
        "after append(block 2) the queue must be [0, 1, 3, 4, 2], walked "
        f"{[b.block_id for b in walk_free(queue, 1000)]}"
    )


def test_append_n_keeps_the_given_order():
    # Upstream's append_n test: into an empty queue, append [b0], then [b4, b5], then [b1..b3].
    queue = lab.FreeKVCacheBlockQueue([])
    blocks = [lab.KVCacheBlock(i) for i in range(6)]
    queue.append_n([])
    assert queue.num_free_blocks == 0, f"append_n([]) adds nothing: {queue.num_free_blocks} free"
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail, (
        "append_n([]) must leave the empty queue's head linked to its tail"
    )
    queue.append_n(blocks[0:1])
    assert blocks[0].prev_free_block is queue.fake_free_list_head, (
        "after append_n([b0]) into an empty queue, b0.prev_free_block is the head sentinel"
    )
    assert blocks[0].next_free_block is queue.fake_free_list_tail, (
        "after append_n([b0]) into an empty queue, b0.next_free_block is the tail sentinel"
    )
    queue.append_n(blocks[4:6])
    queue.append_n(blocks[1:4])
    assert queue.num_free_blocks == 6, f"6 blocks appended, num_free_blocks {queue.num_free_blocks}"
    walked = [b.block_id for b in walk_free(queue, 1000)]
    assert walked == [0, 4, 5, 1, 2, 3], (
        f"append_n puts blocks at the back in the given order: [0, 4, 5, 1, 2, 3] from the "
        f"head, walked {walked} (link the last old block and the tail sentinel to the new run)"
    )
    order = [queue.fake_free_list_head] + [blocks[i] for i in (0, 4, 5, 1, 2, 3)]
    order.append(queue.fake_free_list_tail)
    for prev, nxt in zip(order, order[1:]):
        assert prev.next_free_block is nxt and nxt.prev_free_block is prev, (
            f"the links between {prev.block_id} and {nxt.block_id} (-1: a sentinel) do not "
            f"point at each other both ways"
        )


def test_popleft_never_returns_a_sentinel():
    blocks, queue = queue_of(2)
    got = [queue.popleft(), queue.popleft()]
    queue.append(got[1])
    assert queue.popleft() is got[1], (
        f"append(block {getattr(got[1], 'block_id', None)}) to an emptied queue, then popleft() "
        "must return that block"
    )
    assert all(b.block_id >= 0 for b in got), (
        "popleft() must never return a sentinel (block id -1): got ids "
        f"{[getattr(b, 'block_id', None) for b in got]}"
    )
    with pytest.raises(ValueError):
        queue.popleft()


# ---------------------------------------------------------------------------------------------
# Allocate / free round trips (I1 both ways) and the null block
# ---------------------------------------------------------------------------------------------


def test_fresh_pool_reserves_block_0_as_the_null_block():
    pool = lab.BlockPool(num_gpu_blocks=10, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null, (
        "BlockPool.__init__ takes block 0 as the null block (is_null True)"
    )
    ids = [b.block_id for b in pool.blocks]
    assert ids == list(range(10)), f"pool.blocks[i] is block i: {ids}"
    assert free_ids(pool) == list(range(1, 10)), (
        f"a fresh pool queues blocks 1..9 in order and never the null block 0: {free_ids(pool)}"
    )
    free = pool.get_num_free_blocks()
    assert free == 9, f"9 free (all but the null block), got {free}"
    assert pool.get_usage() == 0.0, f"a fresh pool's usage is 0, got {pool.get_usage()}"


def test_get_new_blocks_takes_the_front_with_one_reference():
    pool = lab.BlockPool(num_gpu_blocks=10, enable_caching=True)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3], (
        "get_new_blocks(3) on a fresh pool must hand out blocks 1, 2, 3 from the front, got "
        f"{[b.block_id for b in got]}"
    )
    assert all(b.ref_cnt == 1 for b in got), (
        f"each block from get_new_blocks must have ref_cnt 1, got {[b.ref_cnt for b in got]}"
    )
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got), (
        "blocks handed out by get_new_blocks must leave the free queue unlinked (both pointers "
        "None)"
    )
    assert free_ids(pool) == list(range(4, 10)) and pool.get_num_free_blocks() == 6, (
        f"after get_new_blocks(3) the free queue must be 4-9 with 6 free; queue {free_ids(pool)}, "
        f"{pool.get_num_free_blocks()} free"
    )
    assert pool.get_usage() == pytest.approx(3 / 9), (
        f"3 of 9 usable blocks in use: get_usage() must be 1/3, got {pool.get_usage()}"
    )
    assert pool.get_new_blocks(0) == [], "get_new_blocks(0) must return [] and take nothing"


def test_free_blocks_appends_in_the_given_order():
    pool = lab.BlockPool(num_gpu_blocks=10, enable_caching=True)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))  # any iterable
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1], (
        f"free_blocks(reversed([1, 2, 3])) appends 3, 2, 1 in that order behind 6..9; the "
        f"free queue is {free_ids(pool)}"
    )
    assert all(x.ref_cnt == 0 for x in a), f"freed blocks have ref_cnt {[x.ref_cnt for x in a]}"
    pool.free_blocks(b)
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1, 4, 5], (
        f"free_blocks([4, 5]) appends 4 then 5; the free queue is {free_ids(pool)}"
    )
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0, (
        f"all 9 blocks free, usage 0: {pool.get_num_free_blocks()} free, usage "
        f"{pool.get_usage()}"
    )


def test_a_shared_block_returns_only_with_its_last_reference():
    pool = lab.BlockPool(num_gpu_blocks=6, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.touch(([blk],))
    assert blk.ref_cnt == 2, f"get_new_blocks then touch: 2 holders, ref_cnt is {blk.ref_cnt}"
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in free_ids(pool), (
        f"free_blocks drops one of 2 references: ref_cnt 1 and not queued while a holder is "
        f"left; got ref_cnt {blk.ref_cnt}, free queue {free_ids(pool)}"
    )
    assert pool.get_num_free_blocks() == 4, (
        f"the block is still held: 4 free, got {pool.get_num_free_blocks()}"
    )
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool)[-1] == blk.block_id, (
        f"the last reference dropped: ref_cnt 0 and the block at the back of the free queue; "
        f"got ref_cnt {blk.ref_cnt}, free queue {free_ids(pool)}"
    )
    assert pool.get_num_free_blocks() == 5, f"5 free again, got {pool.get_num_free_blocks()}"


def test_a_block_freed_twice_in_one_call_drops_two_references_and_links_once():
    pool = lab.BlockPool(num_gpu_blocks=6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch(([a],))
    pool.free_blocks([a, b, a])
    assert (a.ref_cnt, b.ref_cnt) == (0, 0), (
        "free_blocks([a, b, a]) with a held twice must drop both counts to 0; ref_cnt "
        f"a={a.ref_cnt}, b={b.ref_cnt}"
    )
    # Each entry drops one reference; a joins the queue where its count reaches zero.
    assert free_ids(pool) == [3, 4, 5, 2, 1] and pool.get_num_free_blocks() == 5, (
        "a joins the queue once, where its count reaches 0 (after b): expected [3, 4, 5, 2, 1] "
        f"with 5 free, got {free_ids(pool)}, {pool.get_num_free_blocks()} free"
    )


def test_the_null_block_is_never_handed_out_nor_counted():
    pool = lab.BlockPool(num_gpu_blocks=5, enable_caching=False)
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4], (
        "get_new_blocks(4) on a 5-block pool must hand out 1-4, never the null block 0; got "
        f"{[b.block_id for b in got]}"
    )
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0, (
        "all 4 usable blocks in use: 0 free and usage 1.0 expected, got "
        f"{pool.get_num_free_blocks()} free, usage {pool.get_usage()}"
    )
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    # Touching and freeing the placeholder never moves it into the free queue.
    pool.touch(([pool.null_block],))
    pool.free_blocks([pool.null_block])
    assert 0 not in free_ids(pool) and pool.get_num_free_blocks() == 4, (
        "touch and free_blocks must leave the null block (is_null) out of the free queue: queue "
        f"{free_ids(pool)}, {pool.get_num_free_blocks()} free (expected 4)"
    )
    assert pool.null_block.prev_free_block is None and pool.null_block.next_free_block is None, (
        "the null block must stay unlinked (both pointers None) after touch and free_blocks"
    )


def test_a_pool_of_one_block_has_nothing_to_give():
    pool = lab.BlockPool(num_gpu_blocks=1, enable_caching=True)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 0.0, (
        "a 1-block pool has only the null block: 0 free and usage 0.0 expected, got "
        f"{pool.get_num_free_blocks()} free, usage {pool.get_usage()}"
    )
    assert free_ids(pool) == [], (
        f"a 1-block pool's free queue must be empty (no null block in it), got {free_ids(pool)}"
    )
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_an_allocation_that_fits_exactly_succeeds():
    # An over-strict capacity check (>= instead of >) refuses this.
    pool = lab.BlockPool(num_gpu_blocks=6, enable_caching=True)
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5], (
        "get_new_blocks(5) with exactly 5 free must succeed with blocks 1-5, got "
        f"{[b.block_id for b in got]}"
    )
    assert pool.get_num_free_blocks() == 0 and free_ids(pool) == [], (
        "after taking every free block the queue must be empty with 0 free, got "
        f"{pool.get_num_free_blocks()} free"
    )
    assert pool.get_new_blocks(0) == [], (
        "get_new_blocks(0) must return [] (also when nothing is free)"
    )


def test_caching_disabled_allocates_the_same_way():
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=False)
    got = pool.get_new_blocks(2)
    assert [(b.block_id, b.ref_cnt) for b in got] == [(1, 1), (2, 1)], (
        "with caching off, get_new_blocks(2) must give blocks 1 and 2 with ref_cnt 1, got "
        f"{[(b.block_id, b.ref_cnt) for b in got]}"
    )
    pool.free_blocks(got)
    assert free_ids(pool) == [3, 1, 2], (
        "with caching off, free_blocks([1, 2]) must append 1 then 2 behind 3: expected [3, 1, 2], "
        f"got {free_ids(pool)}"
    )


# ---------------------------------------------------------------------------------------------
# Errors change nothing
# ---------------------------------------------------------------------------------------------


def test_out_of_blocks_names_both_numbers_and_changes_nothing():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    held = pool.get_new_blocks(2)
    pool.free_blocks(held[:1])
    before = snapshot(pool)
    with pytest.raises(ValueError) as err:
        pool.get_new_blocks(7)
    assert "7" in str(err.value) and "6" in str(err.value), (
        "get_new_blocks(7) with 6 free must raise a ValueError naming both numbers (7 and 6), got "
        f"{str(err.value)!r:.100}"
    )
    assert snapshot(pool) == before, (
        "a refused get_new_blocks(7) must change nothing (check the count before taking a block)"
    )
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert snapshot(pool) == before, "get_new_blocks(-1) must raise ValueError and change nothing"


def test_a_failed_free_undoes_everything_before_the_bad_entry():
    """The bad entry sits in the middle: blocks before it reached zero (and may already be
    linked into the queue) or lost a reference; blocks after it were not reached. All of it must
    be as before the call."""
    pool = lab.BlockPool(num_gpu_blocks=12, enable_caching=True)
    a, b, shared, c, d, gone = pool.get_new_blocks(6)
    pool.touch(([shared],))  # held twice
    pool.free_blocks([gone])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free_blocks([a, shared, b, gone, c, d])
    assert snapshot(pool) == before, (
        f"free_blocks stopped by a double free of block {gone.block_id} must undo every change it "
        "made before it (counts, links, free queue)"
    )
    assert (a.ref_cnt, b.ref_cnt, shared.ref_cnt, c.ref_cnt, d.ref_cnt) == (1, 1, 2, 1, 1), (
        "after the refused free, ref_cnt of a, b, shared, c, d must be back to (1, 1, 2, 1, 1), "
        f"got {(a.ref_cnt, b.ref_cnt, shared.ref_cnt, c.ref_cnt, d.ref_cnt)}"
    )
    # And the pool still works: the same blocks free normally afterwards.
    pool.free_blocks([a, shared, b, c, d])
    assert free_ids(pool) == [7, 8, 9, 10, 11, 6, 1, 2, 4, 5] and shared.ref_cnt == 1, (
        "after the refused call, freeing a, shared, b, c, d must give the queue [7, 8, 9, 10, 11, "
        f"6, 1, 2, 4, 5] and shared ref_cnt 1; got {free_ids(pool)}, ref_cnt {shared.ref_cnt}"
    )


def test_a_double_free_names_the_block_and_how_often_it_is_listed():
    pool = lab.BlockPool(num_gpu_blocks=12, enable_caching=True)
    blocks = pool.get_new_blocks(8)
    held = blocks[6]  # block 7: held once, listed twice below
    with pytest.raises(ValueError) as err:
        pool.free_blocks([blocks[4], held, blocks[5], held, blocks[3]])
    numbers = {int(n) for n in re.findall(r"-?\d+", str(err.value))}
    assert held.block_id in numbers and 2 in numbers, str(err.value)


def test_blocks_still_referenced_stay_out_and_are_not_counted():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.touch(([a, b],))
    pool.free_blocks([a, b, c])  # a and b are still held once
    assert (a.ref_cnt, b.ref_cnt, c.ref_cnt) == (1, 1, 0), (
        "free_blocks([a, b, c]) with a and b held twice: ref_cnt must be (1, 1, 0), got "
        f"{(a.ref_cnt, b.ref_cnt, c.ref_cnt)}"
    )
    assert free_ids(pool) == [4, 5, 6, 7, 3] and pool.get_num_free_blocks() == 5, (
        "only block 3, whose ref_cnt reached 0, may join the queue: expected [4, 5, 6, 7, 3] with "
        f"5 free, got {free_ids(pool)}, {pool.get_num_free_blocks()} free"
    )


def test_double_free_is_an_error_and_changes_nothing():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=str(a.block_id)):
        pool.free_blocks([a])
    assert snapshot(pool) == before, (
        f"a double free of block {a.block_id} must raise ValueError and change nothing"
    )
    # b is held once but listed twice: the second entry is a double free; b must keep its
    # reference and stay out of the queue.
    with pytest.raises(ValueError):
        pool.free_blocks([b, b])
    assert snapshot(pool) == before and b.ref_cnt == 1, (
        "free_blocks([b, b]) with b held once must raise and change nothing (b keeps ref_cnt 1); "
        f"b has ref_cnt {b.ref_cnt}"
    )


def test_caching_more_blocks_than_were_hashed_is_refused():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    req = FakeRequest(list(range(14)), block_size=4)  # 3 full blocks + 2 tokens
    blocks = pool.get_new_blocks(4)
    before = snapshot(pool)
    for bad in [(0, 4), (2, 1), (0, 5), (-1, 2)]:
        with pytest.raises(ValueError):
            pool.cache_full_blocks(req, blocks, bad[0], bad[1], 4, 0)
        assert snapshot(pool) == before, (
            f"cache_full_blocks(num_cached_blocks={bad[0]}, num_full_blocks={bad[1]}) must raise "
            "ValueError and change nothing"
        )


# ---------------------------------------------------------------------------------------------
# I2: no dedup of identical content
# ---------------------------------------------------------------------------------------------


def test_identical_content_gets_different_blocks_both_indexed():
    pool = lab.BlockPool(num_gpu_blocks=10, enable_caching=True)
    req_a = FakeRequest(list(range(8)), block_size=4)
    req_b = FakeRequest(list(range(8)), block_size=4)
    a = allocate_and_cache(pool, req_a)
    b = allocate_and_cache(pool, req_b)
    assert [x.block_id for x in a] == [1, 2] and [x.block_id for x in b] == [3, 4], (
        f"two 8-token requests must get blocks [1, 2] and [3, 4], got {[x.block_id for x in a]} "
        f"and {[x.block_id for x in b]}"
    )
    assert [x.block_hash for x in a] == [x.block_hash for x in b], (
        "equal tokens under the same prefix must leave both requests' blocks with equal hashes "
        "(block i's hash is the key of request.block_hashes[i])"
    )
    h0, h1 = req_a.block_hashes
    assert index_ids(pool) == {key(h0): [1, 3], key(h1): [2, 4]}, (
        "both copies must be indexed, never merged (I2): expected block ids [1, 3] and [2, 4] "
        f"under the two keys, got {sorted(index_ids(pool).values())}"
    )
    # A lookup returns the first cached block; ids never move.
    assert pool.get_cached_block(req_a.block_hashes[0], [0]) == [a[0]], (
        "get_cached_block of the shared first hash must return the block indexed first, 1"
    )
    assert [x.block_id for x in pool.blocks] == list(range(10)), (
        "block ids never change: pool.blocks[i] must be block i"
    )


def test_evicting_one_duplicate_keeps_the_other():
    # Upstream's _maybe_evict_cached_block test, with its group ids 1000/2000/3000.
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True)
    h0, h1, h2 = key(b"10", 1000), key(b"20", 2000), key(b"30", 3000)
    for blk, h in zip(pool.blocks, [h0, h1, h2, h0]):
        blk.block_hash = h
        pool.cached_block_hash_to_block.insert(h, blk)
    b0, b1, b2, b3 = pool.blocks
    assert pool._maybe_evict_cached_block(b1) is True, "evicting a cached block returns True"
    assert index_ids(pool) == {h0: [0, 3], h2: [2]} and b1.block_hash is None, (
        f"evicting block 1 drops its entry and its hash only; index {index_ids(pool)}, block 1's "
        f"hash {b1.block_hash}"
    )
    assert pool._maybe_evict_cached_block(b0) is True, "evicting a cached block returns True"
    assert index_ids(pool) == {h0: [3], h2: [2]}, (
        f"block 0 and block 3 share hash h0: evicting 0 must keep 3 under h0; index "
        f"{index_ids(pool)}"
    )
    assert pool._maybe_evict_cached_block(b0) is False, (
        "a block without a hash is not in the index: evicting it returns False"
    )
    assert pool._maybe_evict_cached_block(b2) and pool._maybe_evict_cached_block(b3), (
        "evicting the last cached blocks returns True"
    )
    assert index_ids(pool) == {}, f"every block evicted, the index still holds {index_ids(pool)}"


# ---------------------------------------------------------------------------------------------
# I3: only full blocks are cached
# ---------------------------------------------------------------------------------------------


def test_partial_block_is_not_cached_until_it_fills():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    req = FakeRequest(list(range(14)), block_size=4)
    assert len(req.block_hashes) == 3, (
        "test premise: 14 tokens in blocks of 4 give 3 full-block hashes, got "
        f"{len(req.block_hashes)}"
    )
    blocks = allocate_and_cache(pool, req)
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False], (
        "cache_full_blocks(0, 3) must cache the 3 full blocks, not the partial 4th (I3); has a "
        f"hash: {[b.block_hash is not None for b in blocks]}"
    )
    assert len(pool.cached_block_hash_to_block) == 3, (
        "3 full blocks cached: the index must hold 3 keys, got "
        f"{len(pool.cached_block_hash_to_block)}"
    )
    req.append_tokens([14, 15])  # the last block is full now
    assert len(req.block_hashes) == 4, (
        "test premise: 16 tokens in blocks of 4 give 4 full-block hashes, got "
        f"{len(req.block_hashes)}"
    )
    pool.cache_full_blocks(req, blocks, 3, 4, 4, 0)
    assert blocks[3].block_hash == key(req.block_hashes[3]), (
        "once the 4th block fills, cache_full_blocks(3, 4) must give it the key of "
        "request.block_hashes[3]"
    )
    assert pool.get_cached_block(req.block_hashes[3], [0]) == [blocks[3]], (
        "the newly cached 4th block must be found by get_cached_block of its hash"
    )


def test_cache_full_blocks_continues_from_num_cached_blocks():
    # Upstream's test_cache_blocks: blocks made outside the pool, cached 2 then 1 more.
    pool = lab.BlockPool(num_gpu_blocks=5, enable_caching=True)
    req = FakeRequest(list(range(14)), block_size=4)
    blocks = [lab.KVCacheBlock(block_id=i) for i in range(2)]
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 2, (
        f"cache_full_blocks(0, 2) must index 2 blocks, got {len(pool.cached_block_hash_to_block)}"
    )
    assert all(b.block_hash is not None for b in blocks), (
        "cache_full_blocks(0, 2) must give both blocks a hash; has a hash: "
        f"{[b.block_hash is not None for b in blocks]}"
    )
    blocks.append(lab.KVCacheBlock(block_id=2))
    pool.cache_full_blocks(req, blocks, 2, 3, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 3, (
        "cache_full_blocks(2, 3) must add the third block: 3 keys expected, got "
        f"{len(pool.cached_block_hash_to_block)}"
    )
    assert [b.block_hash for b in blocks] == [key(h) for h in req.block_hashes], (
        "block i's hash must be make_block_hash_with_group_id(request.block_hashes[i], 0)"
    )
    pool.cache_full_blocks(req, blocks, 3, 3, 4, 0)  # nothing new: a no-op
    assert len(pool.cached_block_hash_to_block) == 3, (
        "cache_full_blocks(3, 3) caches nothing: still 3 keys expected, got "
        f"{len(pool.cached_block_hash_to_block)}"
    )


def test_evicting_a_block_whose_key_indexes_another_changes_nothing():
    # Task 7 alone: the index is set up by hand. Block 2 carries the key of block 1's entry
    # but is not itself indexed: only block 1's own entry may ever be removed.
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True, enable_kv_cache_events=True)
    h = key(b"h")
    b1, b2 = pool.blocks[1], pool.blocks[2]
    b1.block_hash = h
    pool.cached_block_hash_to_block.insert(h, b1)
    b2.block_hash = h
    assert pool._maybe_evict_cached_block(b2) is False, (
        "block 2 carries block 1's key but is not indexed itself: _maybe_evict_cached_block must "
        "return False (remove only the entry of this block id)"
    )
    assert index_ids(pool) == {h: [1]} and b2.block_hash == h and pool.take_events() == [], (
        "evicting a block that is not indexed must change nothing (index, its hash, events); "
        f"index {index_ids(pool)}"
    )
    assert pool._maybe_evict_cached_block(pool.blocks[3]) is False, (  # no hash at all
        "a block with no hash is not cached: _maybe_evict_cached_block must return False"
    )
    assert pool._maybe_evict_cached_block(b1) is True, (
        "block 1 is indexed under its own hash: _maybe_evict_cached_block must return True"
    )
    assert index_ids(pool) == {} and b1.block_hash is None, (
        f"evicting block 1 must drop its index entry and reset its hash: index {index_ids(pool)}, "
        f"hash {b1.block_hash!r:.40}"
    )
    assert pool.take_events() == [lab.BlockRemoved(block_hashes=[b"h"], medium=lab.MEDIUM_GPU)], (
        "evicting block 1 must record one BlockRemoved(block_hashes=[b'h'], medium=MEDIUM_GPU): "
        "the hash without the group id"
    )


def test_get_cached_block_needs_a_hit_in_every_group():
    pool = lab.BlockPool(num_gpu_blocks=6, enable_caching=True)
    h = b"x" * 32
    b1, b2 = pool.blocks[1], pool.blocks[2]
    for blk, group in ((b1, 7), (b2, 3)):
        blk.block_hash = key(h, group)
        pool.cached_block_hash_to_block.insert(key(h, group), blk)
    before = snapshot(pool)
    assert pool.get_cached_block(h, [3, 7]) == [b2, b1], (  # in the order asked
        "get_cached_block(h, [3, 7]) must return one block per group in the order asked: blocks "
        "[2, 1]"
    )
    assert pool.get_cached_block(h, [7, 5]) is None, (  # group 5 misses
        "group 5 has no block under h: get_cached_block(h, [7, 5]) must return None"
    )
    assert pool.get_cached_block(h, []) == [], (
        "no groups asked: get_cached_block(h, []) must return []"
    )
    assert snapshot(pool) == before, (  # a lookup changes nothing, not even reference counts
        "a lookup with get_cached_block must change nothing, not even reference counts"
    )


def test_cache_full_blocks_errors_say_what_is_wrong():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    req = FakeRequest(list(range(14)), block_size=4)  # 3 hashes
    blocks = pool.get_new_blocks(5)
    with pytest.raises(ValueError) as err:
        pool.cache_full_blocks(req, blocks, 2, 1, 4, 0)
    assert {"2", "1", "5"} <= set(re.findall(r"\d+", str(err.value))), str(err.value)
    with pytest.raises(ValueError) as err:
        pool.cache_full_blocks(req, blocks, 0, 4, 4, 0)
    assert {"3", "4"} <= set(re.findall(r"\d+", str(err.value))), str(err.value)
    with pytest.raises(ValueError, match="(?i)null"):
        pool.cache_full_blocks(req, [pool.null_block, *blocks], 0, 1, 4, 0)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    before = snapshot(pool)
    with pytest.raises(ValueError) as err:
        pool.cache_full_blocks(req, [blocks[1], blocks[0]], 0, 2, 4, 0)
    assert "cached" in str(err.value).lower() and str(blocks[0].block_id) in str(err.value), (
        f"caching an already-cached block must raise naming it (block {blocks[0].block_id}) and "
        f"saying 'cached', got {str(err.value)!r:.100}"
    )
    assert "null" not in str(err.value).lower(), (
        "the block is already cached, not the null block: the message must not say 'null', got "
        f"{str(err.value)!r:.100}"
    )
    assert snapshot(pool) == before, (  # blocks[1], checked first, was not cached either
        f"the refused call must change nothing: block {blocks[1].block_id}, first in the range, "
        f"must not be cached before block {blocks[0].block_id} is found cached (check every block "
        "first)"
    )


def test_the_null_block_is_never_cached():
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True)
    req = FakeRequest(list(range(4)), block_size=4)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, [pool.null_block], 0, 1, 4, 0)
    assert snapshot(pool) == before and pool.null_block.block_hash is None, (
        "cache_full_blocks with the null block must raise and change nothing (the null block "
        "keeps no hash)"
    )


# ---------------------------------------------------------------------------------------------
# I4: cached free blocks are revived by touch (from the middle, in O(1)) or evicted
# ---------------------------------------------------------------------------------------------


def test_freed_cached_blocks_stay_findable_and_revive_from_the_middle():
    pool = lab.BlockPool(num_gpu_blocks=8, enable_caching=True)
    req = FakeRequest(list(range(12)), block_size=4)
    blocks = allocate_and_cache(pool, req)  # 1, 2, 3
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1], (
        f"freed cached blocks join the free queue's back in the given order: {free_ids(pool)}"
    )
    assert all(b.block_hash is not None for b in blocks), (
        "freeing a cached block keeps its hash: it stays findable until it is reused"
    )
    hit = pool.get_cached_block(req.block_hashes[1], [0])
    assert hit == [blocks[1]], f"get_cached_block of block 2's hash finds block 2, got {hit}"
    pool.touch((hit,))
    assert blocks[1].ref_cnt == 1 and blocks[1].block_hash == key(req.block_hashes[1]), (
        f"touch revives the free cached block: ref_cnt 1, hash kept; got ref_cnt "
        f"{blocks[1].ref_cnt}"
    )
    assert free_ids(pool) == [4, 5, 6, 7, 3, 1], (
        f"touch takes the revived block 2 out of the middle of the free queue: {free_ids(pool)}"
    )
    assert blocks[3 - 1].next_free_block is blocks[0], (
        "after block 2 left the queue, block 3 must link to block 1"
    )
    free = pool.get_num_free_blocks()
    assert free == 6, f"6 free after the revival, got {free}"


def test_touch_revives_in_o1_without_walking_the_queue():
    """With the queue's sentinels cut off, only an O(1) unlink can revive block 5000."""
    pool = lab.BlockPool(num_gpu_blocks=10_001, enable_caching=True)
    target = pool.blocks[5000]
    queue = pool.free_block_queue
    saved = (queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail.prev_free_block)
    queue.fake_free_list_head.next_free_block = None
    queue.fake_free_list_tail.prev_free_block = None
    pool.touch(([target],))
    queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail.prev_free_block = saved
    assert target.ref_cnt == 1 and target.prev_free_block is None, (
        "touch of free block 5000 must give it ref_cnt 1 and take it out of the free queue; "
        f"ref_cnt {target.ref_cnt}, prev {getattr(target.prev_free_block, 'block_id', None)}"
    )
    assert pool.blocks[4999].next_free_block is pool.blocks[5001], (
        "touch must unlink block 5000: block 4999 must link forward to 5001, got "
        f"{getattr(pool.blocks[4999].next_free_block, 'block_id', None)}"
    )
    assert pool.blocks[5001].prev_free_block is pool.blocks[4999], (
        "touch must unlink block 5000: block 5001 must link back to 4999, got "
        f"{getattr(pool.blocks[5001].prev_free_block, 'block_id', None)}"
    )
    assert pool.get_num_free_blocks() == 9_999, (
        f"one block revived from 10000 free: 9999 free expected, got {pool.get_num_free_blocks()}"
    )


def test_upstream_evict_scenario_block_ids_and_queue_order():
    # Upstream's test_evict at the pool level: 11 blocks, block size 16.
    pool = lab.BlockPool(num_gpu_blocks=11, enable_caching=True)
    last = 5 * 16 + 7
    req0 = FakeRequest(list(range(last)), block_size=16)
    req1 = FakeRequest(list(range(last, last + 3 * 16)), block_size=16)
    b0 = allocate_and_cache(pool, req0)
    b1 = allocate_and_cache(pool, req1)
    assert [b.block_id for b in b0] == [1, 2, 3, 4, 5, 6], (
        "req0 (87 tokens, block size 16) needs 6 blocks: 1-6 from a fresh pool, got "
        f"{[b.block_id for b in b0]}"
    )
    assert [b.block_id for b in b1] == [7, 8, 9], (
        f"req1 (48 tokens) needs 3 blocks: 7, 8, 9, got {[b.block_id for b in b1]}"
    )
    assert pool.get_num_free_blocks() == 1, (
        f"9 of 10 usable blocks handed out: 1 free expected, got {pool.get_num_free_blocks()}"
    )
    pool.free_blocks(reversed(b0))  # a finished request frees its tail first
    pool.free_blocks(reversed(b1))
    assert free_ids(pool) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7], (
        "free_blocks appends in the order given (tail first): expected [10, 6, 5, 4, 3, 2, 1, 9, "
        f"8, 7], got {free_ids(pool)}"
    )
    req2 = FakeRequest(list(range(2 * 16 + 3)), block_size=16)
    hits = [pool.get_cached_block(h, [0])[0] for h in req2.block_hashes]
    assert [b.block_id for b in hits] == [1, 2], (
        "req2 shares req0's first 2 full blocks: the prefix hits must be blocks 1, 2, got "
        f"{[b.block_id for b in hits]}"
    )
    pool.touch((hits,))
    new = pool.get_new_blocks(1)
    assert [b.block_id for b in new] == [10], (
        "after touch revived 1, 2, get_new_blocks(1) must take the front block 10, got "
        f"{[b.block_id for b in new]}"
    )
    assert pool.get_num_free_blocks() == 7, (
        f"7 free expected after reviving 2 and taking 1, got {pool.get_num_free_blocks()}"
    )
    assert free_ids(pool) == [6, 5, 4, 3, 9, 8, 7], (
        "touch revives 1, 2 out of the queue and get_new_blocks takes 10: expected [6, 5, 4, 3, "
        f"9, 8, 7], got {free_ids(pool)}"
    )


# ---------------------------------------------------------------------------------------------
# Eviction drops the index entry
# ---------------------------------------------------------------------------------------------


def test_reusing_a_cached_block_evicts_its_index_entry():
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True)
    req = FakeRequest(list(range(8)), block_size=4)
    blocks = allocate_and_cache(pool, req)  # 1, 2
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 1, 2], f"free queue after freeing 1, 2: {free_ids(pool)}"
    (fresh, evicted) = pool.get_new_blocks(2)
    assert (fresh.block_id, evicted.block_id) == (3, 1), (
        f"get_new_blocks takes from the front: 3, then the cached block 1; got "
        f"{(fresh.block_id, evicted.block_id)}"
    )
    assert evicted.block_hash is None, (
        "a cached block handed out again must lose its hash (evict it from the prefix cache)"
    )
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None, (
        "the reused block's hash must leave the index: get_cached_block still finds it"
    )
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]], (
        "the block not reused (2) stays cached and findable"
    )
    assert index_ids(pool) == {key(req.block_hashes[1]): [2]}, (
        f"only block 2 stays in the index: {index_ids(pool)}"
    )
    pool.get_new_blocks(1)
    hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert index_ids(pool) == {} and not hashed, (
        f"every cached block reused: the index must be empty ({index_ids(pool)}) and no block "
        f"keep a hash ({hashed})"
    )


# ---------------------------------------------------------------------------------------------
# The hash chain
# ---------------------------------------------------------------------------------------------


def test_hash_block_tokens_hashes_parent_tokens_and_extras():
    parent = b"123"
    got = lab.hash_block_tokens(lab.sha256, parent, (1, 2, 3), ("key1", "key2"))
    assert got == lab.sha256((parent, (1, 2, 3), ("key1", "key2"))), (
        "hash_block_tokens hashes the tuple (parent hash, token tuple, extra keys), parent first"
    )
    assert got == ref_hash(parent, [1, 2, 3], ("key1", "key2")), (
        "hash_block_tokens differs from upstream's hash of the same block"
    )
    # A list hashes like the tuple; no parent (None or b"") means NONE_HASH; extra_keys
    # defaults to None.
    assert lab.hash_block_tokens(lab.sha256, None, [1, 2, 3]) == ref_hash(None, [1, 2, 3]), (
        "a first block (parent None) hashes with NONE_HASH as its parent, tokens as a tuple"
    )
    assert lab.hash_block_tokens(lab.sha256, b"", [1, 2, 3]) == ref_hash(None, [1, 2, 3]), (
        "an empty parent hash (b'') counts as no parent: NONE_HASH"
    )


def test_hash_block_tokens_reads_none_hash_when_called():
    m = impl_module(lab.hash_block_tokens)
    saved = m.NONE_HASH
    try:
        m.NONE_HASH = b"another seed"
        got = lab.hash_block_tokens(lab.sha256, None, [5])
        assert got == lab.sha256((b"another seed", (5,), None)), (
            "hash_block_tokens must read NONE_HASH when called, not a copy taken earlier: with "
            "NONE_HASH = b'another seed' the first block's hash did not follow"
        )
    finally:
        m.NONE_HASH = saved


def test_hash_block_tokens_uses_the_hash_function_it_is_given():
    seen = []

    def fake(obj):
        seen.append(obj)
        return b"fake"

    assert lab.hash_block_tokens(fake, b"p", [1, 2], (9,)) == b"fake", (
        "hash_block_tokens must return what hash_function returns (b'fake'), unchanged"
    )
    assert seen == [(b"p", (1, 2), (9,))], (
        "hash_block_tokens must call hash_function once with (parent, tokens as a tuple, "
        f"extra_keys); calls: {seen!r:.100}"
    )


def test_same_tokens_under_different_parents_hash_differently():
    h_ab = lab.hash_block_tokens(lab.sha256, None, [0, 1])
    h_xy = lab.hash_block_tokens(lab.sha256, None, [7, 8])
    cd_after_ab = lab.hash_block_tokens(lab.sha256, h_ab, [2, 3])
    cd_after_xy = lab.hash_block_tokens(lab.sha256, h_xy, [2, 3])
    assert cd_after_ab != cd_after_xy, (
        "the same tokens [2, 3] under different parents hashed equal: the parent hash must go "
        "into the hash"
    )
    assert cd_after_ab == lab.hash_block_tokens(lab.sha256, h_ab, (2, 3)), (
        "tokens given as a list and as a tuple must hash the same (hash them as a tuple)"
    )


def test_request_hashes_chain_full_blocks_only():
    req = FakeRequest(list(range(10)), block_size=4)
    assert req.block_hashes == ref_chain(list(range(10)), 4), (
        "hash_block_tokens chained over 2 full blocks of 4 differs from the reference "
        "sha256((parent or NONE_HASH, tuple(tokens), None))"
    )
    assert len(req.block_hashes) == 2, (
        "test premise: 10 tokens in blocks of 4 give 2 full-block hashes, got "
        f"{len(req.block_hashes)}"
    )
    req.append_tokens([10, 11, 12])  # 13 tokens: one more full block, incrementally
    assert req.block_hashes == ref_chain(list(range(13)), 4), (
        "after 3 more tokens (13 in all) the chain of 3 full blocks differs from the reference "
        "sha256((parent, tuple(tokens), None))"
    )
    other = FakeRequest([99, 98, 97, 96] + list(range(4, 8)), block_size=4)
    assert other.block_hashes[1] != req.block_hashes[1], (  # same tokens, other prefix
        "the same tokens 4-7 after another first block hashed equal: the parent hash must go into "
        "the hash"
    )


def test_lora_id_in_every_block_cache_salt_in_the_first_only():
    tokens = list(range(8))
    req = FakeRequest(tokens, block_size=4, lora_request=LoRA(7), cache_salt="salt")
    h0 = ref_hash(None, tokens[:4], (7, "salt"))
    assert req.block_hashes == [h0, ref_hash(h0, tokens[4:], (7,))], (
        "with LoRA 7 and salt the chain differs from the reference sha256((parent, tuple(tokens), "
        "extra_keys)), extra keys (7, 'salt') on block 0 and (7,) on block 1"
    )
    salted = FakeRequest(tokens, block_size=4, cache_salt="salt")
    s0 = ref_hash(None, tokens[:4], ("salt",))
    assert salted.block_hashes == [s0, ref_hash(s0, tokens[4:], None)], (
        "with salt only the chain differs from the reference sha256((parent, tuple(tokens), "
        "extra_keys)), extra keys ('salt',) on block 0 and None on block 1"
    )
    assert FakeRequest(tokens, block_size=4).block_hashes == ref_chain(tokens, 4), (
        "without LoRA or salt the chain differs from the reference sha256((parent, "
        "tuple(tokens), None))"
    )


# ---------------------------------------------------------------------------------------------
# Events and reset_prefix_cache
# ---------------------------------------------------------------------------------------------


def test_events_stored_removed_and_cleared():
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True, enable_kv_cache_events=True)
    req = FakeRequest(list(range(10)), block_size=4, lora_request=LoRA(3))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    pool.cache_full_blocks(req, blocks, 1, 2, 4, 0)
    events = pool.take_events()
    assert events == [
        lab.BlockStored(
            block_hashes=[req.block_hashes[0]],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=4,
            lora_id=3,
            medium=lab.MEDIUM_GPU,
        ),
        lab.BlockStored(
            block_hashes=[req.block_hashes[1]],
            parent_block_hash=req.block_hashes[0],
            token_ids=[4, 5, 6, 7],
            block_size=4,
            lora_id=3,
            medium=lab.MEDIUM_GPU,
        ),
    ], (
        "two cache_full_blocks calls must record two BlockStored events (hashes, parent, tokens, "
        f"block_size 4, lora_id 3, MEDIUM_GPU); got {len(events)} event(s)"
    )
    assert pool.take_events() == [], "take_events must clear the events: a second call returns []"
    pool.free_blocks(blocks)  # queue: 1, 2, 3 (block 3 never filled)
    pool.get_new_blocks(2)  # evicts blocks 1 and 2, in that order
    assert pool.take_events() == [
        lab.BlockRemoved(block_hashes=[req.block_hashes[0]], medium=lab.MEDIUM_GPU),
        lab.BlockRemoved(block_hashes=[req.block_hashes[1]], medium=lab.MEDIUM_GPU),
    ], (
        "get_new_blocks(2) evicts cached blocks 1 then 2: expected two BlockRemoved events with "
        "their hashes, in that order"
    )
    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() is True, (
        "every block free: reset_prefix_cache must succeed and return True"
    )
    assert pool.take_events() == [lab.AllBlocksCleared()], (
        "a successful reset_prefix_cache must record one AllBlocksCleared() event"
    )


def test_no_events_when_disabled():
    pool = lab.BlockPool(num_gpu_blocks=4, enable_caching=True)
    req = FakeRequest(list(range(8)), block_size=4)
    blocks = allocate_and_cache(pool, req)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == [] and pool.kv_event_queue == [], (
        "events disabled: nothing may be recorded; kv_event_queue holds "
        f"{len(pool.kv_event_queue)} event(s)"
    )


def test_a_refused_reset_logs_a_warning_with_the_blocks_in_use(caplog):
    pool = lab.BlockPool(num_gpu_blocks=9, enable_caching=True)
    held = pool.get_new_blocks(3)
    with caplog.at_level(logging.INFO):
        assert pool.reset_prefix_cache() is False, (
            "3 blocks in use: reset_prefix_cache must refuse and return False"
        )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "a refused reset must log a warning"
    assert "3" in re.findall(r"\d+", warnings[-1].getMessage()), warnings[-1].getMessage()
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True, (
        "every block freed: reset_prefix_cache must now succeed and return True"
    )


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = lab.BlockPool(num_gpu_blocks=6, enable_caching=True, enable_kv_cache_events=True)
    req = FakeRequest(list(range(8)), block_size=4)
    blocks = allocate_and_cache(pool, req)
    pool.take_events()
    before = snapshot(pool)
    assert pool.reset_prefix_cache() is False, (
        "blocks 1 and 2 in use: reset_prefix_cache must refuse and return False"
    )
    assert snapshot(pool) == before and pool.take_events() == [], (
        "a refused reset_prefix_cache must change nothing and record no event"
    )
    pool.free_blocks(blocks)
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True, (
        "every block freed: reset_prefix_cache must succeed and return True"
    )
    assert len(pool.cached_block_hash_to_block) == 0, (
        "after a reset the prefix-cache index must be empty, got "
        f"{len(pool.cached_block_hash_to_block)} keys"
    )
    assert all(b.block_hash is None for b in pool.blocks), (
        "after a reset no block may keep a hash; hashed: "
        f"{[b.block_id for b in pool.blocks if b.block_hash is not None][:8]}"
    )
    assert free_ids(pool) == order, (
        f"a reset must keep the free queue's order: {order} before, {free_ids(pool)} after"
    )
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None, (
        "after a reset the old hash must miss: get_cached_block must return None"
    )


# ---------------------------------------------------------------------------------------------
# The stateful machine: I1-I4 after every step
# ---------------------------------------------------------------------------------------------

BLOCK_SIZE = 2
NUM_BLOCKS = 9
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)


@dataclass
class Seq:
    req: FakeRequest
    blocks: list[Any]
    num_cached: int
    hits: int = 0


class AllocatorMachine(RuleBasedStateMachine):
    """Requests start (with prefix-cache hits), grow chunk by chunk, finish or are preempted and
    come back, as the KV-cache manager drives the pool. A model records, per block id, the
    tokens whose KV the block holds (its whole prefix), how many live requests hold it, and the
    free queue's order. After every step the invariants I1-I4 are checked; and every refusal is
    checked both ways: the pool refused exactly when the model says it had to.

    Rules pick a request by index (`finish(i=1)`), so a failing example prints as calls you can
    read and replay."""

    @initialize()
    def setup(self):
        self.pool = lab.BlockPool(NUM_BLOCKS, enable_caching=True)
        self.seqs: list[Seq] = []
        self.refs = [0] * NUM_BLOCKS
        # the expected free queue, front first: LRU order as upstream keeps it
        self.order = list(range(1, NUM_BLOCKS))
        # block id -> the token prefix ending at this block (what its KV was computed from)
        self.content: dict[int, tuple[int, ...]] = {}
        self.keys: dict[bytes, bytes] = {}
        self.seed = none_hash()  # NONE_HASH, as the lab's module has it (no step changes it)

    def _write(self, seq: Seq, first: int) -> None:
        tokens = seq.req.all_token_ids
        blocks = read(seq.blocks)
        for i in range(first, len(blocks)):
            end = min((i + 1) * BLOCK_SIZE, len(tokens))
            self.content[blocks[i].block_id] = tuple(tokens[:end])

    def _take(self, n: int) -> list[Any] | None:
        """Ask the pool for n blocks. It must refuse exactly when the model has fewer than n
        free (and then change nothing), and otherwise hand out the front n of the queue."""
        must_refuse = n > len(self.order)
        before = snapshot(self.pool)
        try:
            new = self.pool.get_new_blocks(n)
        except ValueError:
            assert must_refuse, f"refused {n} blocks with {len(self.order)} free"
            assert snapshot(self.pool) == before, "a refused allocation changed the pool"
            return None
        assert not must_refuse, f"handed out {n} blocks with only {len(self.order)} free"
        assert [b.block_id for b in read(new)] == self.order[:n], (
            "not taken from the queue's front"
        )
        del self.order[:n]
        for b in read(new):
            assert not b.is_null and self.refs[b.block_id] == 0, "handed out a block in use"
            self.refs[b.block_id] = 1
        return new

    def _pick(self, i: int) -> Seq:
        return self.seqs[i % len(self.seqs)]

    def _start(self, tokens: list[int]) -> Seq | None:
        req = FakeRequest(tokens, BLOCK_SIZE)
        hits = []
        # At least the last token is computed, so its block is never a hit (as upstream).
        for i, h in enumerate(req.block_hashes[: (len(tokens) - 1) // BLOCK_SIZE]):
            got = self.pool.get_cached_block(h, [0])
            if got is None:
                break
            assert self.content[got[0].block_id] == tuple(tokens[: (i + 1) * BLOCK_SIZE]), (
                "a prefix hit served KV computed from other tokens"
            )
            hits.append(got[0])
        need = -(-len(tokens) // BLOCK_SIZE) - len(hits)
        reviving = sum(1 for b in read(hits) if b.ref_cnt == 0)
        if need > len(self.order) - reviving:
            # Not enough room: the engine would not admit it. The allocation must be refused.
            assert self._take(len(self.order) + 1) is None, (
                f"get_new_blocks({len(self.order) + 1}) with {len(self.order)} free must raise "
                f"ValueError and change nothing"
            )
            return None
        self.pool.touch((hits,))
        for b in read(hits):
            if self.refs[b.block_id] == 0:
                self.order.remove(b.block_id)  # revived from wherever it was in the queue
            self.refs[b.block_id] += 1
        new = self._take(need)
        assert new is not None, (
            f"get_new_blocks({need}) refused with {len(self.order)} blocks in the free queue"
        )
        seq = Seq(req, hits + new, len(hits), hits=len(hits))
        self._write(seq, len(hits))
        self._cache(seq)
        self.seqs.append(seq)
        return seq

    @rule(tokens=tokens_st)
    def start(self, tokens):
        self._start(tokens)

    def _cache(self, seq: Seq) -> None:
        full = seq.req.num_tokens // BLOCK_SIZE
        self.pool.cache_full_blocks(seq.req, seq.blocks, seq.num_cached, full, BLOCK_SIZE, 0)
        seq.num_cached = full

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 7), tokens=tokens_st)
    def grow(self, i, tokens):
        """A chunk of prefill or a few decode steps: blocks only when the last one fills."""
        seq = self._pick(i)
        old_len = len(seq.blocks)
        need = -(-(seq.req.num_tokens + len(tokens)) // BLOCK_SIZE) - old_len
        if need > 0:
            new = self._take(need)
            if new is None:
                return
            seq.blocks += new
        seq.req.append_tokens(tokens)
        self._write(seq, max(old_len - 1, 0))
        self._cache(seq)

    def _free(self, seq: Seq) -> None:
        self.seqs.remove(seq)
        self.pool.free_blocks(reversed(seq.blocks))  # tail first, as the manager frees
        blocks = read(seq.blocks)
        for b in reversed(blocks):
            self.refs[b.block_id] -= 1
            if self.refs[b.block_id] == 0:
                self.order.append(b.block_id)
        freed = [live for live, b in zip(seq.blocks, blocks) if b.ref_cnt == 0]
        if freed:
            before = snapshot(self.pool)
            with pytest.raises(ValueError):
                self.pool.free_blocks(freed[:1])
            assert snapshot(self.pool) == before, "a refused double free changed the pool"

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        """A request finishes or is aborted, at any point."""
        self._free(self._pick(i))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 7))
    def preempt_and_readmit(self, i):
        """Preemption by recomputation: free everything, then come back with the same tokens.
        Nothing was allocated in between, so every full block but the last token's must hit."""
        seq = self._pick(i)
        tokens = list(seq.req.all_token_ids)
        self._free(seq)
        again = self._start(tokens)  # may be refused: its last block can be held by others
        if again is not None:
            assert again.hits == (len(tokens) - 1) // BLOCK_SIZE, "its own cached blocks missed"

    @rule()
    def reset(self):
        before = snapshot(self.pool)
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.seqs), "reset refused with nothing in use, or done with blocks held"
        if not ok:
            assert snapshot(self.pool) == before, (
                "reset_prefix_cache refused (blocks in use) must change nothing, yet the pool "
                "changed"
            )

    @invariant()
    def i1_free_queue_is_exactly_the_unreferenced_blocks(self):
        if not hasattr(self, "pool"):
            return
        live = self.pool
        listed = [b.block_id for b in read(live.free_block_queue.get_all_free_blocks())]
        num_free = live.get_num_free_blocks()
        usage = live.get_usage()
        pool = read(live)  # one read of the whole pool (a copy of this moment) for the rest
        walk = walk_free(pool.free_block_queue, NUM_BLOCKS)
        ids = [b.block_id for b in walk]
        assert listed == ids, (
            f"get_all_free_blocks {listed} differs from the linked list walked head to tail {ids}"
        )
        assert len(ids) == len(set(ids)) == num_free, (
            f"the free queue holds {ids} ({len(set(ids))} distinct) but num_free_blocks is "
            f"{num_free}"
        )
        assert ids == self.order, "free queue out of eviction order"
        expected = {b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null}
        assert set(ids) == expected, (
            f"the free queue must hold exactly the blocks with ref_cnt 0: missing "
            f"{sorted(expected - set(ids))}, held yet queued {sorted(set(ids) - expected)}"
        )
        chain = [pool.free_block_queue.fake_free_list_head, *walk]
        for prev, nxt in zip(chain, chain[1:]):
            assert nxt.prev_free_block is prev, (
                f"block {nxt.block_id}'s prev_free_block is not the block before it in the queue "
                f"({getattr(prev, 'block_id', 'head')}): a link was not updated"
            )
        for b in pool.blocks:
            if b.block_id not in expected:
                assert b.prev_free_block is None and b.next_free_block is None, (
                    f"block {b.block_id} is out of the free queue but keeps its links; set "
                    f"prev_free_block and next_free_block to None when removing it"
                )
        assert usage == pytest.approx(1 - len(ids) / (NUM_BLOCKS - 1)), (
            f"get_usage {usage} with {len(ids)} of {NUM_BLOCKS - 1} blocks free"
        )

    @invariant()
    def i2_ids_stable_and_reference_counts_match_holders(self):
        if not hasattr(self, "pool"):
            return
        blocks = read(self.pool).blocks
        ids = [b.block_id for b in blocks]
        assert ids == list(range(NUM_BLOCKS)), f"pool.blocks[i] must be block i: {ids}"
        for b in blocks[1:]:
            assert b.ref_cnt == self.refs[b.block_id], (
                f"block {b.block_id} has ref_cnt {b.ref_cnt} but {self.refs[b.block_id]} "
                f"sequence(s) hold it"
            )
        for blocks in read([seq.blocks for seq in self.seqs]):
            held = [b.block_id for b in blocks]
            assert len(set(held)) == len(held), f"one sequence holds a block twice: {held}"

    def _key(self, block_hash: bytes) -> bytes:
        """key(block_hash), asked once per hash of an example (a call into the lab's code)."""
        if block_hash not in self.keys:
            self.keys[block_hash] = key(block_hash)
        return self.keys[block_hash]

    @invariant()
    def i3_i4_index_matches_full_block_content(self):
        if not hasattr(self, "pool"):
            return
        pool = read(self.pool)
        index = pool.cached_block_hash_to_block._cache
        in_index = {}
        for k, v in index.items():
            for b in v.values() if isinstance(v, dict) else [v]:
                in_index[b.block_id] = k
        for b in pool.blocks:
            if b.block_hash is None:
                assert b.block_id not in in_index, (
                    f"block {b.block_id} has no hash but the cache index still lists it: "
                    f"remove it from the index when its hash is reset"
                )
                continue
            assert in_index.get(b.block_id) == b.block_hash, "cached block missing from index"
            content = list(self.content[b.block_id])
            assert len(content) % BLOCK_SIZE == 0, "a partial block was cached"
            assert b.block_hash == self._key(ref_chain(content, BLOCK_SIZE, self.seed)[-1]), (
                f"block {b.block_id}'s hash is not the hash chain of the tokens it holds: "
                f"hashed with the wrong parent or the wrong tokens"
            )


TestAllocatorMachine = pytest.mark.points(3)(AllocatorMachine.TestCase)
