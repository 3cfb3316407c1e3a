"""Graded tests of lab 02-03: the request block hasher, the KV cache manager, prefix caching.

The tests reach the implementation only through the course loader (``lab.<name>``). The hash
values they expect are computed here, independently, from ``sha256`` and ``NONE_HASH`` of the
block-allocator lab, so a hasher that drops the parent, the LoRA id or the salt cannot agree.

Groups:
  1. the request block hasher (task 1)
  2. the seed's worked example (block_size 4)
  3. the properties of upstream v0.11.0 ``tests/v1/core/test_prefix_caching.py``, with its exact
     block ids and free-queue orders
  4. the edges: a fully cached prompt, eviction and reuse, lookahead, bad input
  5. a Hypothesis state machine over requests, checking the invariants after every step
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mini_vllm.kv_cache_utils as kcu
from course.loader import load_lab

lab = load_lab(__file__)

EOS = 100


# --------------------------------------------------------------------------- helpers


def make_request(rid, tokens, block_size, *, salt=None, lora_id=None, own_hasher=False):
    """A request whose block hashes come from the reference hasher, or from the lab's own
    (task 1) when ``own_hasher``: the manager's tests do not depend on task 1."""
    lora = lab.LoRARequest(f"adapter-{lora_id}", lora_id) if lora_id is not None else None
    make_hasher = lab.get_request_block_hasher if own_hasher else kcu.get_request_block_hasher
    return lab.Request(
        rid,
        list(tokens),
        lab.SamplingParams(max_tokens=17),
        EOS,
        lora_request=lora,
        cache_salt=salt,
        block_hasher=make_hasher(block_size, lab.sha256),
    )


def expected_hashes(tokens, block_size, *, salt=None, lora_id=None):
    """The chained hashes of the full blocks of ``tokens``, computed independently."""
    out, parent = [], kcu.NONE_HASH
    for i in range(len(tokens) // block_size):
        extra = ([lora_id] if lora_id is not None else []) + ([salt] if salt and i == 0 else [])
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = kcu.sha256((parent, block, tuple(extra) if extra else None))
        out.append(parent)
    return out


def keyed(block_hash):
    """What a cached block stores: its hash packed with KV-cache group id 0."""
    return kcu.make_block_hash_with_group_id(block_hash, 0)


def free_ids(manager):
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prompt(manager, req):
    """What the scheduler does for a new request: look up the cache, allocate the rest."""
    hit, num_hit = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, num_hit, new


def snapshot(manager):
    """Everything a failed allocate_slots must leave untouched."""
    pool = manager.block_pool
    return (
        free_ids(manager),
        pool.free_block_queue.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {r: [b.block_id for b in bl] for r, bl in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
    )


def table(manager, req):
    return manager.req_to_blocks[req.request_id]


COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16


# --------------------------------------------------------------------------- 1. the hasher


def test_hasher_hashes_full_blocks_only_and_keeps_up_with_appends():
    tokens = list(range(10))
    req = make_request("r", tokens, 4, own_hasher=True)
    assert req.block_hashes == expected_hashes(tokens, 4)  # 2 full blocks, 2 tokens left over
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2, "a block with 3 of 4 tokens must not be hashed"
    req.append_output_token_ids(11)
    assert req.block_hashes == expected_hashes(list(range(12)), 4)
    req.append_output_token_ids([12, 13, 14, 15, 16])
    assert req.block_hashes == expected_hashes(list(range(17)), 4)


def test_hasher_chains_parents():
    a = make_request("a", [1, 2, 3, 4, 9, 9, 9, 9], 4, own_hasher=True)
    b = make_request("b", [5, 6, 7, 8, 9, 9, 9, 9], 4, own_hasher=True)
    assert a.block_hashes[1] != b.block_hashes[1], "same tokens under different parents collided"
    assert a.block_hashes == expected_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)


def test_hasher_extra_keys_lora_on_every_block_salt_on_the_first():
    tokens = list(range(12))
    req = make_request("r", tokens, 4, salt="s1", lora_id=7, own_hasher=True)
    assert req.block_hashes == expected_hashes(tokens, 4, salt="s1", lora_id=7)
    salted = make_request("s", tokens, 4, salt="s1", own_hasher=True)
    assert salted.block_hashes == expected_hashes(tokens, 4, salt="s1")
    lora = make_request("l", tokens, 4, lora_id=7, own_hasher=True)
    assert lora.block_hashes == expected_hashes(tokens, 4, lora_id=7)
    plain = make_request("p", tokens, 4, own_hasher=True)
    # The salt enters block 0 only, but the chain carries it into every later block.
    assert all(x != y for x, y in zip(salted.block_hashes, plain.block_hashes))


def test_hasher_rejects_a_bad_block_size():
    for bad in (0, -4):
        with pytest.raises(ValueError):
            lab.get_request_block_hasher(bad, lab.sha256)


# --------------------------------------------------------------------------- 2. worked example


def test_seed_worked_example_block_size_4():
    """'The cat sat on the mat and then', then 'The cat sat on the rug': one block hit."""
    vocab: dict[str, int] = {}

    def tok(text):
        return [vocab.setdefault(w, len(vocab)) for w in text.split()]

    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    a = make_request("A", tok("The cat sat on the mat and then"), 4)
    hit, n, new = schedule_prompt(m, a)
    assert n == 0 and new.get_block_ids() == ([1, 2],)
    assert [b.block_hash for b in table(m, a)] == [keyed(h) for h in a.block_hashes]

    b = make_request("B", tok("The cat sat on the rug"), 4)
    assert len(b.block_hashes) == 1  # "the rug" is a partial block: not hashed
    hit, n, new = schedule_prompt(m, b)
    assert hit.get_block_ids() == ([1],) and n == 4  # prefill skips "The cat sat on"
    assert new.get_block_ids() == ([3],)
    assert m.block_pool.blocks[1].ref_cnt == 2
    assert m.block_pool.blocks[3].block_hash is None, "the partial block must not be cached"
    assert m.get_block_ids("B") == ([1, 3],)


# --------------------------------------------------------------------------- 3. upstream


def test_prefill_partial_hit_and_free_queue_order():
    """Upstream test_prefill: hits while in use and after free, then LRU eviction order."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    hit, n, new = schedule_prompt(m, r0)
    assert n == 0 and hit.get_block_ids() == ([],)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    for i, h in enumerate(expected_hashes(COMMON, 16)):
        assert m.block_pool.blocks[i + 1].block_hash == keyed(h)
        assert m.block_pool.blocks[i + 1].ref_cnt == 1
    assert m.block_pool.blocks[4].block_hash is None and m.block_pool.blocks[4].ref_cnt == 1

    r1 = make_request("1", COMMON + [3] * 5, 16)
    hit, n, new = schedule_prompt(m, r1)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48
    assert new.get_block_ids() == ([5],)
    assert [b.ref_cnt for b in hit.blocks[0]] == [2, 2, 2]
    assert m.block_pool.get_num_free_blocks() == 5

    m.free(r0)
    m.free(r1)
    # Never used first, then each request's tail, and the shared prefix last, deepest first.
    assert free_ids(m) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]

    r2 = make_request("2", COMMON + [3] * 6, 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48
    assert new.get_block_ids() == ([6],)
    assert m.block_pool.get_num_free_blocks() == 6
    assert all(b.ref_cnt == 0 for b in m.block_pool.free_block_queue.get_all_free_blocks())
    m.free(r2)

    r3 = make_request("3", [99] * 160, 16)
    hit, n, new = schedule_prompt(m, r3)
    assert n == 0
    assert new.get_block_ids() == ([7, 8, 9, 10, 4, 5, 6, 3, 2, 1],)  # the eviction order
    assert m.block_pool.get_num_free_blocks() == 0


def test_decode_allocates_only_when_a_block_fills():
    """Upstream test_decode."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    _, _, new = schedule_prompt(m, r0)
    assert new.get_block_ids() == ([1, 2, 3, 4],)

    for _ in range(4):
        r0.append_output_token_ids(8)
    new = m.allocate_slots(r0, 4)  # 55 + 4 = 59 tokens still fit 4 blocks
    assert new is not None and new.get_block_ids() == ([],)
    assert table(m, r0)[-1].block_hash is None
    r0.num_computed_tokens = 59

    r0.append_output_token_ids([7] * 19)  # fills block 4, and 14 tokens into a fifth
    new = m.allocate_slots(r0, 19)
    assert new is not None and len(new.blocks[0]) == 1
    assert table(m, r0)[-2].block_hash == keyed(r0.block_hashes[3])
    assert table(m, r0)[-1].block_hash is None


def test_lru_eviction_order_after_free():
    """Upstream test_evict."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    n0 = 5 * 16 + 7
    r0 = make_request("0", range(n0), 16)
    _, _, new = schedule_prompt(m, r0)
    assert len(new.blocks[0]) == 6
    r1 = make_request("1", range(n0, n0 + 48), 16)
    _, _, new = schedule_prompt(m, r1)
    assert len(new.blocks[0]) == 3
    assert m.block_pool.get_num_free_blocks() == 1

    m.free(r0)
    m.free(r1)
    assert m.block_pool.get_num_free_blocks() == 10
    assert free_ids(m) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]

    r2 = make_request("2", range(2 * 16 + 3), 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1, 2],) and n == 32
    assert new.get_block_ids() == ([10],)
    assert m.block_pool.get_num_free_blocks() == 7


def test_reused_block_loses_its_old_hash():
    """Upstream test_hash_block_correct_reuse."""
    m = lab.KVCacheManager(num_blocks=2, block_size=16, max_model_len=8192)
    r0 = make_request("0", range(16), 16)
    _, _, new = schedule_prompt(m, r0)
    assert new.get_block_ids() == ([1],) and m.block_pool.blocks[1].block_hash is not None
    m.free(r0)
    r1 = make_request("1", range(15), 16)
    _, n, new = schedule_prompt(m, r1)
    assert n == 0 and new.get_block_ids() == ([1],)
    assert m.block_pool.blocks[1].block_hash is None


def test_hit_blocks_are_not_evicted_while_other_blocks_are_free():
    """Upstream test_computed_blocks_not_evicted."""
    m = lab.KVCacheManager(num_blocks=3, block_size=16, max_model_len=8192)
    r0 = make_request("0", range(16), 16)
    assert schedule_prompt(m, r0)[2].get_block_ids() == ([1],)
    r1 = make_request("1", range(16, 32), 16)
    assert schedule_prompt(m, r1)[2].get_block_ids() == ([2],)
    m.free(r0)
    m.free(r1)
    r2 = make_request("2", range(32), 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1],) and n == 16
    assert new.get_block_ids() == ([2],)


def test_caching_disabled():
    """Upstream test_basic_prefix_caching_disabled."""
    m = lab.KVCacheManager(num_blocks=5, block_size=4, max_model_len=8192, enable_caching=False)
    r1 = make_request("1", range(10), 4)
    hit, n, new = schedule_prompt(m, r1)
    assert n == 0 and len(new.blocks[0]) == 3
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.free(r1)
    r2 = make_request("2", range(16), 4)
    hit, n, new = schedule_prompt(m, r2)
    assert n == 0 and not hit.blocks[0] and len(new.blocks[0]) == 4
    r3 = make_request("3", range(4), 4)
    hit, n, new = schedule_prompt(m, r3)
    assert n == 0 and new is None  # all 4 usable blocks are held by r2


def test_salt_changes_the_whole_chain():
    """Upstream test_cache_key_salting."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    tokens = COMMON + [3] * 11
    r0 = make_request("0", tokens, 16, salt="salt1")
    assert r0.block_hashes == expected_hashes(tokens, 16, salt="salt1")
    hit, n, new = schedule_prompt(m, r0)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    r0.append_output_token_ids([8] * 5)
    assert m.allocate_slots(r0, 5).get_block_ids() == ([],)
    assert r0.block_hashes == expected_hashes(tokens + [8] * 5, 16, salt="salt1")

    same_salt = make_request("1", COMMON + [4] * 11, 16, salt="salt1")
    hit, n = m.get_computed_blocks(same_salt)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48
    other_salt = make_request("2", COMMON + [4] * 11, 16, salt="salt2")
    hit, n = m.get_computed_blocks(other_salt)
    assert hit.get_block_ids() == ([],) and n == 0
    no_salt = make_request("3", COMMON + [4] * 11, 16)
    assert m.get_computed_blocks(no_salt)[1] == 0


def test_failed_allocation_touches_nothing():
    """Upstream test_prefill_not_enough_free_blocks_with_computed_blocks."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON, 16)
    schedule_prompt(m, r0)
    part0 = list(table(m, r0))
    r1 = make_request("1", COMMON * 2, 16)
    hit, n = m.get_computed_blocks(r1)
    assert hit.blocks[0] == part0 and n == 48
    m.allocate_slots(r1, 48, n, hit)
    part1 = list(table(m, r1))
    m.free(r1)
    assert [b.ref_cnt for b in part1] == [1, 1, 1, 0, 0, 0]

    r2 = make_request("2", [7] * 32, 16)
    schedule_prompt(m, r2)
    assert m.block_pool.get_num_free_blocks() == 5
    # r3 hits all six blocks of r1, three of them free (eviction candidates), and needs three
    # more: 3 + 3 > 5 free, so nothing may happen.
    r3 = make_request("3", COMMON * 3, 16)
    hit, n = m.get_computed_blocks(r3)
    assert hit.blocks[0] == part1 and n == 96
    before = snapshot(m)
    assert m.allocate_slots(r3, 48, n, hit) is None
    assert snapshot(m) == before
    assert [b.ref_cnt for b in part1] == [1, 1, 1, 0, 0, 0]


def test_reset_only_when_nothing_is_in_use():
    """Upstream test_reset_prefix_cache."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192, log_stats=True)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    assert m.allocate_slots(r0, 55).get_block_ids() == ([1, 2, 3, 4],)
    r1 = make_request("1", COMMON + [4] * 7, 16)
    hit, n = m.get_computed_blocks(r1)
    assert len(hit.blocks[0]) == 3
    assert m.allocate_slots(r1, 7, n, hit).get_block_ids() == ([5],)

    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    assert m.make_prefix_cache_stats().reset is False

    m.free(r0)
    m.free(r1)
    assert m.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.get_computed_blocks(make_request("2", COMMON + [3], 16))[1] == 0
    assert m.make_prefix_cache_stats().reset is True


def test_prefix_cache_stats():
    """Upstream test_prefix_cache_stats_disabled, plus queries / hits / hit rate."""
    off = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    schedule_prompt(off, make_request("0", range(16), 16))
    assert off.reset_prefix_cache() is False
    assert off.prefix_cache_stats is None and off.make_prefix_cache_stats() is None

    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192, log_stats=True)
    schedule_prompt(m, make_request("a", COMMON + [3] * 7, 16))  # 55 queried, 0 hit
    schedule_prompt(m, make_request("b", COMMON + [4] * 2, 16))  # 50 queried, 48 hit
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 105, 48)
    assert stats.hit_rate == pytest.approx(48 / 105)
    fresh = m.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits, fresh.hit_rate) == (0, 0, 0, 0.0)


# --------------------------------------------------------------------------- 4. edges


@pytest.mark.parametrize("prompt_len, expect_hit", [(48, 32), (49, 48), (47, 32)])
def test_a_fully_cached_prompt_still_computes_its_last_token(prompt_len, expect_hit):
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    schedule_prompt(m, make_request("warm", list(range(64)), 16))
    req = make_request("r", list(range(prompt_len)), 16)
    hit, n = m.get_computed_blocks(req)
    assert n == expect_hit and n < req.num_tokens
    new = m.allocate_slots(req, req.num_tokens - n, n, hit)
    assert new is not None and len(m.get_block_ids("r")[0]) == -(-prompt_len // 16)


def test_evicted_then_reused_block_is_never_served_for_its_old_hash():
    m = lab.KVCacheManager(num_blocks=3, block_size=4, max_model_len=64)
    old = make_request("old", [1, 2, 3, 4, 5], 4)
    schedule_prompt(m, old)
    assert m.get_block_ids("old") == ([1, 2],)
    m.free(old)  # block 1 stays cached, as an eviction candidate
    new = make_request("new", [9, 9, 9, 9, 8, 8, 8, 8, 7], 4)
    assert m.allocate_slots(new, 9) is None  # needs 3 blocks, only 2 usable
    new = make_request("new", [9, 9, 9, 9, 8, 8, 8, 8], 4)
    schedule_prompt(m, new)  # evicts and refills blocks 2 and 1
    assert sorted(m.get_block_ids("new")[0]) == [1, 2]
    m.free(new)

    again = make_request("again", [1, 2, 3, 4, 5], 4)
    hit, n = m.get_computed_blocks(again)
    assert n == 0, "a block reused for new content was served for its old hash"
    same_as_new = make_request("same", [9, 9, 9, 9, 8, 8, 8, 8, 1], 4)
    hit, n = m.get_computed_blocks(same_as_new)
    assert n == 8
    for blk, h in zip(hit.blocks[0], same_as_new.block_hashes):
        assert blk.block_hash == keyed(h)


def test_a_cached_block_behind_a_miss_is_not_served():
    m = lab.KVCacheManager(num_blocks=6, block_size=4, max_model_len=64)
    a = make_request("a", list(range(9)), 4)
    schedule_prompt(m, a)
    first, second = table(m, a)[:2]
    m.free(a)
    # Drop block 0 of the chain from the index (what eviction does); block 1 stays cached.
    assert m.block_pool._maybe_evict_cached_block(first)
    assert second.block_hash is not None
    b = make_request("b", list(range(9)), 4)
    hit, n = m.get_computed_blocks(b)
    assert n == 0 and hit.get_block_ids() == ([],)


def test_free_returns_blocks_tail_first():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    r = make_request("r", range(14), 4)
    schedule_prompt(m, r)
    assert m.get_block_ids("r") == ([1, 2, 3, 4],)
    m.free(r)
    assert free_ids(m) == [5, 6, 7, 4, 3, 2, 1]
    assert m.get_block_ids("r") == ([],)
    m.free(r)  # unknown request: nothing happens
    assert free_ids(m) == [5, 6, 7, 4, 3, 2, 1]


def test_lookahead_slots_are_allocated_but_not_cached_and_delay_skips_caching():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = make_request("r", range(6), 4)
    new = m.allocate_slots(r, 6, num_lookahead_tokens=4)
    assert len(new.blocks[0]) == 3  # 10 slots
    assert [b.block_hash is not None for b in table(m, r)] == [True, False, False]

    d = make_request("d", range(100, 108), 4)
    new = m.allocate_slots(d, 8, delay_cache_blocks=True)
    assert len(new.blocks[0]) == 2 and all(b.block_hash is None for b in new.blocks[0])
    m.cache_blocks(d, 8)  # later, once the KV really arrived
    assert [b.block_hash for b in table(m, d)] == [keyed(h) for h in d.block_hashes]

    capped = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=8)
    c = make_request("c", range(6), 4)
    assert len(capped.allocate_slots(c, 6, num_lookahead_tokens=8).blocks[0]) == 2


def test_num_common_prefix_blocks_and_usage():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    a = make_request("a", list(range(10)), 4)
    b = make_request("b", list(range(4)) + [50, 51, 52, 53, 54, 55, 56], 4)
    for r in (a, b):
        schedule_prompt(m, r)
        r.status = lab.RequestStatus.RUNNING
    assert m.get_num_common_prefix_blocks(a, 2) == [1]  # b shares only block 0 with a
    assert m.get_num_common_prefix_blocks(a, 3) == [0]
    assert m.usage == pytest.approx(5 / 10)
    a.status = lab.RequestStatus.WAITING
    with pytest.raises(ValueError):
        m.get_num_common_prefix_blocks(a, 2)


def test_bad_input_is_rejected_and_changes_nothing():
    m = lab.KVCacheManager(num_blocks=6, block_size=4, max_model_len=12)
    warm = make_request("warm", range(9), 4)
    schedule_prompt(m, warm)
    req = make_request("r", range(9), 4)
    hit, n = m.get_computed_blocks(req)
    assert n == 8
    before = snapshot(m)
    bad_calls = [
        lambda: m.allocate_slots(req, 0),
        lambda: m.allocate_slots(req, 1, 4, hit),  # 4 tokens claimed for 2 hit blocks
        lambda: m.allocate_slots(req, 5, n, hit),  # 8 + 5 > max_model_len 12
        lambda: m.allocate_slots(req, 1, 0, None, -1),
        lambda: m.allocate_slots(warm, 1, n, hit),  # warm already holds blocks
        lambda: m.allocate_slots(lab.Request("x", [1] * 5, lab.SamplingParams(), EOS), 5),
        lambda: m.cache_blocks(req, 8),  # req holds no blocks yet
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
        assert snapshot(m) == before


# --------------------------------------------------------------------------- 5. state machine

BLOCK_SIZE = 4
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12)


class CacheManagerMachine(RuleBasedStateMachine):
    """Requests arrive (sharing prefixes), decode, are preempted when memory runs out, finish."""

    def __init__(self):
        super().__init__()
        self.m = lab.KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, max_model_len=24)
        self.running: dict[str, tuple] = {}  # id -> (request, salt, lora_id)
        self.next_id = 0

    def _held(self):
        return [r for r, _, _ in self.running.values()]

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        cut=st.integers(0, 12),
        tail=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from([None, "s"]),
        lora_id=st.sampled_from([None, 3]),
    )
    def add_request(self, prefix, cut, tail, salt, lora_id):
        tokens = PREFIXES[prefix][:cut] + tail or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_request(rid, tokens, BLOCK_SIZE, salt=salt, lora_id=lora_id)
        hit, n = self.m.get_computed_blocks(req)
        assert n % BLOCK_SIZE == 0 and n < req.num_tokens
        assert n == len(hit.blocks[0]) * BLOCK_SIZE
        want = expected_hashes(tokens, BLOCK_SIZE, salt=salt, lora_id=lora_id)
        for blk, h in zip(hit.blocks[0], want):
            assert blk.block_hash == keyed(h), "a hit block holds other tokens than asked for"
        before = snapshot(self.m)
        new = self.m.allocate_slots(req, req.num_tokens - n, n, hit)
        if new is None:
            assert snapshot(self.m) == before
            return
        req.num_computed_tokens = req.num_tokens
        self.running[rid] = (req, salt, lora_id)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 3))
    def decode_one(self, pick, token):
        rid = sorted(self.running)[pick % len(self.running)]
        req = self.running[rid][0]
        if req.num_tokens >= self.m.max_model_len:
            self.finish(pick)
            return
        req.append_output_token_ids(token)
        before = snapshot(self.m)
        new = self.m.allocate_slots(req, 1)
        if new is None:
            assert snapshot(self.m) == before
            self.m.free(req)  # preempted: gives its blocks back
            del self.running[rid]
            return
        req.num_computed_tokens = req.num_tokens

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        rid = sorted(self.running)[pick % len(self.running)]
        self.m.free(self.running.pop(rid)[0])

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self):
        pool = self.m.block_pool
        ids = free_ids(self.m)
        assert len(ids) == len(set(ids)) == pool.free_block_queue.num_free_blocks
        holders = Counter(b.block_id for r in self._held() for b in table(self.m, r))
        assert 0 not in holders and 0 not in ids, "the null block was handed out or freed"
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt == holders[blk.block_id]
            assert (blk.block_id in ids) == (blk.ref_cnt == 0)
        assert len(ids) + len(holders) == pool.num_gpu_blocks - 1
        assert set(self.m.req_to_blocks) == set(self.running)

    @invariant()
    def every_held_block_has_the_hash_its_tokens_imply(self):
        for req, salt, lora_id in self.running.values():
            want = expected_hashes(list(req.all_token_ids), BLOCK_SIZE, salt=salt, lora_id=lora_id)
            assert req.block_hashes == want
            blocks = table(self.m, req)
            assert len(blocks) == -(-req.num_tokens // BLOCK_SIZE)
            for i, blk in enumerate(blocks):
                expected = keyed(want[i]) if i < len(want) else None
                assert blk.block_hash == expected, f"{req.request_id} block {i}"
                if expected is not None:
                    found = self.m.block_pool.get_cached_block(want[i], [0])
                    assert found is not None and found[0].block_hash == expected


TestCacheManagerMachine = CacheManagerMachine.TestCase
