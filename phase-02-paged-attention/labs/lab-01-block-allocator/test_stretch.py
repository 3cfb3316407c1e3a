"""Lab 02-01, stretch (optional, not graded): today's vLLM behaviour behind the course's switch.

With ``LAB_IMPL=starter`` these run *your* ``stretch.py`` once it sets ``STARTED = True``, and
are skipped before that: the stretch is optional, so an untouched one is not a failure. With
``LAB_IMPL=solution`` they run the reference, ``mini_vllm`` with
``kv_cache_utils.use_today_behaviour`` on. The grader runs ``test_lab.py`` only.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from course.labs.loader import chosen_impl, load_script
from mini_vllm.core import block_pool as ref_pool
from mini_vllm.core import kv_cache_utils as ref_utils
from mini_vllm.core.kv_cache_manager import KVCacheManager
from mini_vllm.request import LoRARequest, Request
from mini_vllm.sampling_params import SamplingParams

LAB_DIR = Path(__file__).resolve().parent
SEED = ref_utils.TODAY_NONE_HASH_SEED


def pieces() -> SimpleNamespace:
    """The today-behaviour pieces under test: the reference's, or your stretch's."""
    if chosen_impl() == "solution":
        return SimpleNamespace(
            KVCacheBlock=ref_utils.KVCacheBlock,
            FreeKVCacheBlockQueue=ref_utils.FreeKVCacheBlockQueue,
            prepend_n=lambda queue, blocks: queue._prepend_n(blocks),
            BlockPool=ref_pool.BlockPool,
            init_none_hash=ref_utils.init_none_hash,
            none_hash=lambda: ref_utils.NONE_HASH,
            extra_keys=ref_utils.generate_block_hash_extra_keys,
        )
    stretch = load_script("lab_02_01_stretch", LAB_DIR / "stretch.py")
    if not stretch.STARTED:
        pytest.skip("the stretch is optional: set STARTED = True in stretch.py when you start "
                    "it (README: Stretch)")
    return SimpleNamespace(
        KVCacheBlock=stretch.KVCacheBlock,
        FreeKVCacheBlockQueue=stretch.FreeKVCacheBlockQueue,
        prepend_n=lambda queue, blocks: queue.prepend_n(blocks),
        BlockPool=stretch.BlockPool,
        init_none_hash=stretch.init_none_hash,
        none_hash=stretch.none_hash,
        extra_keys=stretch.generate_block_hash_extra_keys,
    )


@pytest.fixture
def today():
    """Today's behaviour on for the test (and NONE_HASH as it was afterwards)."""
    with ref_utils.today_behaviour():
        yield pieces()


def queue_ids(queue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def walk_both_ways(queue) -> list[int]:
    """The queue's ids read backwards from the tail sentinel, checking every back link."""
    ids, curr = [], queue.fake_free_list_tail.prev_free_block
    while curr is not queue.fake_free_list_head:
        assert curr.next_free_block.prev_free_block is curr, f"block {curr.block_id}'s links"
        ids.append(curr.block_id)
        curr = curr.prev_free_block
    return ids[::-1]


def test_prepend_n_puts_blocks_at_the_front_in_their_order(today):
    blocks = [today.KVCacheBlock(i) for i in range(6)]
    queue = today.FreeKVCacheBlockQueue(blocks)
    taken = queue.popleft_n(3)  # 0, 1, 2
    today.prepend_n(queue, [taken[2], taken[0]])
    assert queue_ids(queue) == [2, 0, 3, 4, 5] == walk_both_ways(queue)
    assert queue.num_free_blocks == 5
    today.prepend_n(queue, [])
    assert queue_ids(queue) == [2, 0, 3, 4, 5] and queue.num_free_blocks == 5
    assert queue.popleft() is taken[2], "the first prepended block must be the next one out"


def test_prepend_n_into_an_empty_queue(today):
    blocks = [today.KVCacheBlock(i) for i in range(3)]
    queue = today.FreeKVCacheBlockQueue(blocks)
    queue.popleft_n(3)
    today.prepend_n(queue, [blocks[1], blocks[0]])
    assert queue_ids(queue) == [1, 0] == walk_both_ways(queue)
    assert queue.num_free_blocks == 2


def cache_first(pool, blocks: list, n: int) -> None:
    """Put the first `n` of `blocks` into the prefix cache (as a request of 4-token blocks)."""
    hashes = [bytes([i + 1]) * 32 for i in range(len(blocks))]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(4 * len(blocks))),
                              lora_request=None)
    pool.cache_full_blocks(request, blocks, 0, n, 4, 0)


def test_freed_blocks_without_a_hash_go_to_the_front(today):
    pool = today.BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # ids 1..4; 5, 6, 7 stay free
    cache_first(pool, blocks, 2)  # 1 and 2 are cached
    pool.free_blocks(list(reversed(blocks)))  # tail first: 4, 3, 2, 1
    # Unhashed 4 and 3 first, in the order freed; cached 2 and 1 last, least recent first.
    assert queue_ids(pool.free_block_queue) == [4, 3, 5, 6, 7, 2, 1]
    assert walk_both_ways(pool.free_block_queue) == [4, 3, 5, 6, 7, 2, 1]
    assert pool.get_num_free_blocks() == 7
    assert pool.get_new_blocks(1)[0].block_id == 4, "an unhashed block is reused first"


def test_without_caching_every_freed_block_goes_to_the_front(today):
    pool = today.BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    assert queue_ids(pool.free_block_queue) == [2, 1, 3, 4, 5]


def test_a_shared_block_joins_when_its_last_reference_goes(today):
    pool = today.BlockPool(6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch(([a],))  # a is held twice
    pool.free_blocks([a, b])
    assert queue_ids(pool.free_block_queue) == [2, 3, 4, 5] and a.ref_cnt == 1
    pool.free_blocks([pool.null_block, a])  # the null block is skipped
    assert queue_ids(pool.free_block_queue) == [1, 2, 3, 4, 5]


def test_a_double_free_changes_nothing(today):
    pool = today.BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    cache_first(pool, blocks, 1)
    pool.free_blocks([blocks[3]])
    before = (queue_ids(pool.free_block_queue), [b.ref_cnt for b in pool.blocks[1:]],
              pool.get_num_free_blocks())
    with pytest.raises(ValueError, match=r"\b4\b"):
        pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])  # 4 is free already
    after = (queue_ids(pool.free_block_queue), [b.ref_cnt for b in pool.blocks[1:]],
             pool.get_num_free_blocks())
    assert after == before, "a refused free_blocks must leave counts and the queue as they were"
    assert walk_both_ways(pool.free_block_queue) == before[0]


def test_switch_off_keeps_v0_11_order():
    impl = pieces()
    with ref_utils.today_behaviour(False):
        pool = impl.BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    cache_first(pool, blocks, 2)
    pool.free_blocks(list(reversed(blocks)))
    assert queue_ids(pool.free_block_queue) == [5, 6, 7, 4, 3, 2, 1]


def test_none_hash_is_fixed_unless_pythonhashseed_is_set(today, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    today.init_none_hash(ref_utils.sha256)
    assert today.none_hash() == ref_utils.sha256(SEED)
    today.init_none_hash(ref_utils.sha256)
    assert today.none_hash() == ref_utils.sha256(SEED), "the same in every process and call"
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    today.init_none_hash(ref_utils.sha256)
    assert today.none_hash() == ref_utils.sha256("42")


def test_none_hash_stays_random_with_the_switch_off(monkeypatch):
    impl = pieces()
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with ref_utils.today_behaviour(False):
        impl.init_none_hash(ref_utils.sha256)
        first = impl.none_hash()
        impl.init_none_hash(ref_utils.sha256)
        assert impl.none_hash() != first and first != ref_utils.sha256(SEED)


def make_request(lora: bool, salt: str | None) -> Request:
    return Request("r", list(range(12)), SamplingParams(), None, cache_salt=salt,
                   lora_request=LoRARequest("adapter", 3) if lora else None)


def test_extra_keys_are_tagged(today):
    request = make_request(lora=True, salt="s3cret")
    assert today.extra_keys(request, 0, 4, 0) == (
        (("lora", "adapter", None), ("cache_salt", "s3cret")), 0)
    assert today.extra_keys(request, 4, 8, 2) == ((("lora", "adapter", None),), 2)
    assert today.extra_keys(make_request(False, "s"), 0, 4, 0) == ((("cache_salt", "s"),), 0)
    assert today.extra_keys(make_request(False, "s"), 4, 8, 0) == (None, 0)
    assert today.extra_keys(make_request(False, ""), 0, 4, 0) == (None, 0)


def test_reference_extra_keys_are_untagged_with_the_switch_off():
    if chosen_impl() != "solution":
        pytest.skip("the switched-off keys are lab 02-03's hasher, not part of this stretch")
    with ref_utils.today_behaviour(False):
        request = make_request(lora=True, salt="s3cret")
        assert ref_utils.generate_block_hash_extra_keys(request, 0, 4, 0) == ((3, "s3cret"), 0)


def test_reference_hashes_finer_than_the_block():
    """Today's hash granularity in the reference (not a stretch task): requests hashed every 2
    tokens, blocks of 4; each block is named by the hash at its last token."""
    if chosen_impl() != "solution":
        pytest.skip("finer hash granularity is the reference's: read it in README: Stretch")
    with ref_utils.today_behaviour():
        manager = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
        manager._use_hash_block_size(2)
        hasher = ref_utils.get_request_block_hasher(2, ref_utils.sha256)

        def request(rid: str, tokens: list[int]) -> Request:
            return Request(rid, tokens, SamplingParams(), None, block_hasher=hasher)

        first = request("a", list(range(11)))
        assert len(first.block_hashes) == 5  # every 2 tokens
        manager.allocate_slots(first, 11)
        held = manager.req_to_blocks["a"]
        assert [b.block_hash for b in held[:2]] == [
            ref_utils.make_block_hash_with_group_id(first.block_hashes[i], 0) for i in (1, 3)]
        same = request("b", list(range(11)))
        hit, num_tokens = manager.get_computed_blocks(same)
        assert hit.blocks[0] == held[:2] and num_tokens == 8
        differs_at_5 = request("c", [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10])
        hit, num_tokens = manager.get_computed_blocks(differs_at_5)
        assert hit.blocks[0] == held[:1] and num_tokens == 4
        with pytest.raises(ValueError, match="divisor"):
            KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)._use_hash_block_size(3)
