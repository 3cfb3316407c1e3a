"""Graded tests of lab 02-03: the request block hasher, the KV cache manager, prefix caching.

The tests reach the implementation only through the course loader (``lab.<name>``). The hash
values they expect are computed here, independently, from ``sha256`` and ``NONE_HASH`` of the
block-allocator lab, so a hasher that drops the parent, the LoRA id or the salt cannot agree.

Task by task: every test uses only the task it is about and the tasks before it, so a student
sees tests pass after each task (`python scripts/task_by_task.py 02-03` checks it). State that a
later task would build is built by hand with the complete block pool of lab 02-01 (cached
blocks, a tracked request's table); allocation tests before task 5 run with caching off or
``delay_cache_blocks=True``, where ``allocate_slots`` caches nothing.

Groups, in task order:
  1. the request block hasher
  2. the lookup (``get_computed_blocks``) on a cache filled by hand
  3. the capacity count (``_get_num_blocks_to_allocate``)
  4. allocation without caching: exact fits, hits claimed first, chunks, refusals, bad input
  5. ``cache_blocks`` and allocation with caching (the worked example, upstream's decode test)
  6. ``free``: tail first, forgotten, freed and allocated again; upstream's tests with frees
  7. ``reset_prefix_cache``, ``get_num_common_prefix_blocks``
  8. a Hypothesis state machine over whole request lives (chunked prefill, decode, preemption
     and re-admission, abort at any point, reset), checking M1-M4 and every refusal both ways
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mini_vllm.core.kv_cache_utils as kcu
from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student, read

lab = load_lab(__file__)

EOS = 100


# --------------------------------------------------------------------------- helpers


def make_request(rid, tokens, block_size, *, salt=None, lora_id=None, own_hasher=False):
    """A request whose block hashes come from the reference hasher, or from the lab's own
    (task 1) when ``own_hasher``: the manager's tests do not depend on task 1."""
    lora = lab.LoRARequest(f"adapter-{lora_id}", lora_id) if lora_id is not None else None
    if own_hasher:
        hasher = lab.get_request_block_hasher(block_size, lab.sha256)
    else:
        hasher = reference_hasher(block_size, lab.sha256, beside=lab)
    return lab.Request(
        rid,
        list(tokens),
        lab.SamplingParams(max_tokens=17),
        EOS,
        lora_request=lora,
        cache_salt=salt,
        block_hasher=hasher,
    )


@beside_the_student
def reference_hasher(block_size, hash_fn):
    """The reference's hasher, made where the request lives: it hashes on every append, and
    each call from the student's process to the test's would be a round trip. (The tests check
    its hashes against their own, computed here.)"""
    return kcu.get_request_block_hasher(block_size, hash_fn)


def expected_hashes(tokens, block_size, *, salt=None, lora_id=None, hash_fn=None, parent=None):
    """The chained hashes of the full blocks of ``tokens``, computed independently."""
    hash_fn = hash_fn or kcu.sha256
    out, parent = [], parent or kcu.NONE_HASH
    for i in range(len(tokens) // block_size):
        extra = ([lora_id] if lora_id is not None else []) + ([salt] if salt and i == 0 else [])
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hash_fn((parent, block, tuple(extra) if extra else None))
        out.append(parent)
    return out


def keyed(block_hash):
    """What a cached block stores: its hash packed with KV-cache group id 0."""
    return kcu.make_block_hash_with_group_id(block_hash, 0)


@beside_the_student
def free_ids(manager):
    """The free queue's block ids, in order (asked where the manager runs, in one request)."""
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


@beside_the_student
def indexed_hashes(manager, block_hashes):
    """For each hash, the hash of the block the prefix-cache index finds under it (or None);
    asked where the manager runs, in one request."""
    pool = manager.block_pool
    found = [pool.get_cached_block(h, [0]) for h in block_hashes]
    return [None if f is None else f[0].block_hash for f in found]


def stats_of(manager):
    s = manager.prefix_cache_stats
    return None if s is None else (s.requests, s.queries, s.hits, s.reset)


def snapshot(manager):
    """Everything a refused or rejected call must leave untouched."""
    free = free_ids(manager)
    m = read(manager)  # the whole manager in one read, where the lab has its process
    pool = m.block_pool
    return (
        free,
        pool.free_block_queue.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {r: [b.block_id for b in bl] for r, bl in m.req_to_blocks.items()},
        dict(m.num_cached_block),
        stats_of(m),
    )


def granted(new):
    """What allocate_slots returned where the test leaves room for it: None (a refusal) fails
    here with the cause, not later as an AttributeError on None."""
    assert new is not None, (
        "allocate_slots returned None (refused) where the blocks fit: count only what it must take "
        "beyond the blocks the request holds (new blocks, and hit blocks it claims from the free "
        "queue) against the free ones")
    return new


def table(manager, req):
    return manager.req_to_blocks[req.request_id]


def ids(blocks):
    return [b.block_id for b in blocks]


_seeds = iter(range(10**6))


def seed_cache(manager, tokens, *, hold=False, salt=None, lora_id=None):
    """Cache the full blocks of ``tokens`` in the manager's pool by hand (the complete pool of
    lab 02-01), as an earlier request would have; unless ``hold``, free them again (tail first)
    so that they sit in the free queue as eviction candidates. Returns the blocks."""
    pool = manager.block_pool
    req = make_request(f"seed-{next(_seeds)}", tokens, manager.block_size, salt=salt,
                       lora_id=lora_id)
    n = len(req.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, manager.block_size, 0)
    if not hold:
        pool.free_blocks(reversed(blocks))
    return blocks


@beside_the_student
def set_table(manager, request_id, blocks, num_cached):
    """Give a request a table by hand. It runs where the manager runs (its dicts are read there
    as copies: a write to a copy would change nothing)."""
    manager.req_to_blocks[request_id] = list(blocks)
    manager.num_cached_block[request_id] = num_cached


def track(manager, req, num_blocks, num_cached=0):
    """Make ``req`` a tracked request by hand: a table of new blocks from the pool."""
    blocks = manager.block_pool.get_new_blocks(num_blocks)
    set_table(manager, req.request_id, blocks, num_cached)
    return blocks


def computed_blocks(manager, req):
    """get_computed_blocks(req), its shape checked first: a wrong shape fails here with what
    came back, not later as an AttributeError on it."""
    got = manager.get_computed_blocks(req)
    assert isinstance(got, tuple) and len(got) == 2, (
        "get_computed_blocks returns a pair (the hit blocks as KVCacheBlocks, the number of hit "
        f"tokens); got {got!r:.120}")
    hit, num_hit = got
    assert isinstance(hit, lab.KVCacheBlocks), (
        "get_computed_blocks returns the hit blocks as KVCacheBlocks (wrap the list: "
        f"KVCacheBlocks((blocks,))), got {hit!r:.120}")
    assert isinstance(num_hit, int) and not isinstance(num_hit, bool), (
        f"get_computed_blocks returns the number of hit tokens as an int, got {num_hit!r}")
    return got


def schedule_prompt(manager, req):
    """What the scheduler does for a new request: look up the cache, allocate the rest."""
    hit, num_hit = computed_blocks(manager, req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, num_hit, new


def assert_cached_exactly(manager, req, num_full):
    """The first ``num_full`` blocks of the table are cached under the request's hashes, and
    indexed; the others have no hash."""
    r = read(req)
    assert_cached(read(manager), r, num_full)
    assert_indexed(manager, r.block_hashes[:num_full])


def assert_cached(m, r, num_full):
    """assert_cached_exactly but the index, on a manager and a request as read."""
    want = r.block_hashes
    for i, blk in enumerate(m.req_to_blocks[r.request_id]):
        if i < num_full:
            assert blk.block_hash == keyed(want[i]), f"block {i} is not cached under its hash"
        else:
            assert blk.block_hash is None, f"block {i} is cached but is not full and computed"
    cached = m.num_cached_block[r.request_id]
    assert cached == num_full, (
        f"num_cached_block[{r.request_id!r}] is {cached}, but {num_full} full block(s) are "
        f"computed and cached"
    )


def assert_indexed(manager, block_hashes):
    """The prefix-cache index finds a block cached under each of these hashes."""
    for i, (h, found) in enumerate(zip(block_hashes, indexed_hashes(manager, block_hashes))):
        assert found == keyed(h), (
            f"block {i} has its hash but the prefix-cache index does not find it under it"
        )


def message_names(exc_info, *values):
    text = str(exc_info.value)
    for v in values:
        assert re.search(rf"(?<![\w-]){re.escape(str(v))}(?![\w])", text), (
            f"the error message should give {v!r}: {text!r}"
        )


COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16


# --------------------------------------------------------------------------- 1. the hasher


def test_hasher_hashes_full_blocks_only_and_keeps_up_with_appends():
    tokens = list(range(10))
    req = make_request("r", tokens, 4, own_hasher=True)
    assert req.block_hashes == expected_hashes(tokens, 4), (  # 2 full blocks, 2 tokens left over
        f"10 tokens in blocks of 4: the hashes of the 2 full blocks, chained; got "
        f"{len(req.block_hashes)} hash(es), not those of the chain"
    )
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2, "a block with 3 of 4 tokens must not be hashed"
    for appended, total in (([11], 12), ([12, 13, 14, 15, 16], 17)):
        req.append_output_token_ids(appended)
        want = expected_hashes(list(range(total)), 4)
        assert req.block_hashes == want, (
            f"after appending up to {total} tokens: {len(want)} full blocks hashed, each with "
            f"its parent's hash; got {len(req.block_hashes)} hash(es), not those of the chain"
        )


def test_hasher_chains_parents():
    a = make_request("a", [1, 2, 3, 4, 9, 9, 9, 9], 4, own_hasher=True)
    b = make_request("b", [5, 6, 7, 8, 9, 9, 9, 9], 4, own_hasher=True)
    assert a.block_hashes[1] != b.block_hashes[1], "same tokens under different parents collided"
    assert a.block_hashes == expected_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4), (
        "the 2 hashes of [1, 2, 3, 4 | 9, 9, 9, 9] must be the chain (block 1's parent is block "
        f"0's hash); got {len(a.block_hashes)} hash(es), not those"
    )


def test_hasher_extra_keys_lora_on_every_block_salt_on_the_first():
    tokens = list(range(12))
    plain = make_request("p", tokens, 4, own_hasher=True)
    for rid, salt, lora_id, keys in (
        ("r", "s1", 7, "LoRA id 7 on every block, then salt 's1' on block 0 only"),
        ("s", "s1", None, "salt 's1' on block 0 only"),
        ("l", None, 7, "LoRA id 7 on every block"),
        ("p", None, None, "no extra keys (None, not an empty tuple)"),
    ):
        req = make_request(rid, tokens, 4, salt=salt, lora_id=lora_id, own_hasher=True)
        want = expected_hashes(tokens, 4, salt=salt, lora_id=lora_id)
        wrong = [i for i, (a, b) in enumerate(zip(req.block_hashes, want)) if a != b]
        assert req.block_hashes == want, (
            f"extra keys: {keys}; the hashes of block(s) {wrong or 'count'} differ "
            f"({len(req.block_hashes)} hashes, {len(want)} expected)"
        )
    salted = make_request("s2", tokens, 4, salt="s1", own_hasher=True)
    # The salt enters block 0 only, but the chain carries it into every later block.
    assert all(x != y for x, y in zip(salted.block_hashes, plain.block_hashes)), (
        "a salted request's blocks must all differ from the unsalted ones (through the chain)"
    )
    # An empty salt is no salt.
    empty = make_request("e", tokens, 4, salt="", own_hasher=True).block_hashes
    assert empty == plain.block_hashes, "an empty cache salt is no salt: the hashes must match"


def test_hasher_uses_the_given_hash_function_once_per_block():
    calls = []

    def blake(obj):
        calls.append(obj)
        return hashlib.blake2b(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    hasher = lab.get_request_block_hasher(4, blake)
    req = lab.Request("r", list(range(9)), lab.SamplingParams(), EOS, block_hasher=hasher)
    for t in range(9, 20):
        req.append_output_token_ids(t)
    ran = len(calls)
    assert req.block_hashes == expected_hashes(list(range(20)), 4, hash_fn=blake), (
        "20 tokens in blocks of 4: 5 chained hashes made with the given caching_hash_fn (not "
        f"sha256); got {len(req.block_hashes)} hash(es), not those"
    )
    assert ran == 5, f"5 blocks filled, but the hash function ran {ran} times"


def test_hasher_starts_after_the_known_hashes_and_does_not_modify_the_request():
    """The hasher continues from ``block_hashes`` as the request holds them (it chains onto the
    last one, whatever it is), returns only the new ones and changes nothing."""
    planted = b"\x07" * 32
    fake = SimpleNamespace(
        all_token_ids=list(range(12)),
        num_tokens=12,
        block_hashes=[planted],
        lora_request=None,
        cache_salt="salt",
    )
    hasher = lab.get_request_block_hasher(4, lab.sha256)
    got = hasher(fake)
    assert got == expected_hashes(list(range(4, 12)), 4, parent=planted), (
        "the request holds 1 hash: the hasher returns blocks 1 and 2 only, chained onto that hash "
        "(no salt: that is block 0's); got "
        f"{len(got) if isinstance(got, list) else repr(got)[:40]} hash(es), not those"
    )
    assert fake.block_hashes == [planted] and fake.all_token_ids == list(range(12)), (
        "the hasher must not modify the request (block_hashes, all_token_ids): it returns the new "
        "hashes and the Request appends them"
    )
    fake.block_hashes = [planted, *got]
    assert hasher(fake) == [], "no new full block: nothing to return"


def test_hasher_with_blocks_of_one_token():
    req = make_request("r", [5, 6, 7], 1, own_hasher=True)
    assert req.block_hashes == expected_hashes([5, 6, 7], 1), (
        "block_size 1: each of the 3 tokens is a full block, 3 chained hashes; got "
        f"{len(req.block_hashes)} hash(es), not those"
    )


def test_hasher_rejects_a_bad_block_size():
    for bad in (0, -4):
        with pytest.raises(ValueError) as exc:
            lab.get_request_block_hasher(bad, lab.sha256)
        message_names(exc, bad)


# --------------------------------------------------------------------------- 2. the lookup


def test_lookup_finds_the_longest_cached_prefix_and_claims_nothing():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    cached = seed_cache(m, list(range(14)))  # 3 full blocks, in the free queue
    req = make_request("r", list(range(8)) + [50, 51, 52, 53, 54], 4)
    before = snapshot(m)
    hit, n = computed_blocks(m, req)
    assert isinstance(hit, lab.KVCacheBlocks) and n == 8, (
        "tokens 0..7 (2 blocks) are cached: expected a KVCacheBlocks and 8 hit tokens, got "
        f"{'a KVCacheBlocks' if isinstance(hit, lab.KVCacheBlocks) else type(hit).__name__} and "
        f"{n!r}"
    )
    assert hit.blocks[0] == cached[:2], "the hit must be the cached blocks, front first"
    assert snapshot(m) == before, "a lookup claims nothing: no count or queue position changes"
    held = seed_cache(m, [7] * 9, hold=True)  # blocks somebody holds hit too
    hit, n = computed_blocks(m, make_request("h", [7] * 12 + [1], 4))
    assert hit.blocks[0] == held and n == 8, (
        f"cached blocks another request holds hit too: expected blocks {ids(held)} and 8 tokens, "
        f"got {ids(hit.blocks[0])} and {n}"
    )
    assert [b.ref_cnt for b in held] == [1, 1], (
        "a lookup claims nothing: the held hit blocks keep ref_cnt [1, 1], got "
        f"{[b.ref_cnt for b in held]}: get_computed_blocks must not touch them"
    )


def test_lookup_stops_at_the_first_miss():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    first, second, third = seed_cache(m, list(range(13)))
    # Drop block 1 of the chain from the index (what eviction does); blocks 0 and 2 stay.
    assert m.block_pool._maybe_evict_cached_block(second), "set-up: block 1 evicted"
    assert third.block_hash is not None, "set-up: block 2 stays cached"
    hit, n = computed_blocks(m, make_request("r", list(range(13)), 4))
    assert hit.get_block_ids() == ([first.block_id],) and n == 4, (
        f"blocks 0 and 2 of the prompt are cached, block 1 is not: the hit is block 0 alone "
        f"(a hit is a prefix: stop at the first miss); got {hit.get_block_ids()}, {n} tokens"
    )
    assert m.block_pool._maybe_evict_cached_block(first), "set-up: block 0 evicted"
    hit, n = computed_blocks(m, make_request("s", list(range(13)), 4))
    assert hit.get_block_ids() == ([],) and n == 0, "a cached block behind a miss was served"


@pytest.mark.parametrize("prompt_len, expect_hit", [(48, 32), (49, 48), (47, 32), (1, 0), (16, 0)])
def test_a_fully_cached_prompt_still_computes_its_last_token(prompt_len, expect_hit):
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    seed_cache(m, list(range(64)))
    req = make_request("r", list(range(prompt_len)), 16)
    hit, n = computed_blocks(m, req)
    assert n == expect_hit and len(hit.blocks[0]) * 16 == n, (
        f"a prompt of {prompt_len} cached tokens hits {expect_hit} (whole blocks, and never the "
        f"last token, which must be computed for its logits); got {n} tokens in "
        f"{len(hit.blocks[0])} block(s)"
    )


def test_find_longest_cache_hit_respects_max_length():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    cached = seed_cache(m, list(range(16)))
    hashes = make_request("r", list(range(16)), 4).block_hashes
    for max_length, k in [(0, 0), (3, 0), (4, 1), (11, 2), (16, 4), (100, 4)]:
        assert m._find_longest_cache_hit(hashes, max_length) == cached[:k], max_length
    assert m._find_longest_cache_hit([], 100) == [], (
        "no hashes: _find_longest_cache_hit([], 100) finds no block and returns []"
    )


def test_lookup_with_caching_off_is_an_empty_block_list_and_counts_nothing():
    m = lab.KVCacheManager(num_blocks=5, block_size=4, max_model_len=64, enable_caching=False,
                           log_stats=True)
    hit, n = computed_blocks(m, make_request("r", range(9), 4))
    assert isinstance(hit, lab.KVCacheBlocks), "an empty KVCacheBlocks, not a list"
    assert hit.blocks == ([],) and n == 0, (
        "caching off: no hit blocks (blocks == ([],)) and 0 tokens, got "
        f"{[len(g) for g in hit.blocks]} block(s) per group and {n} tokens"
    )
    assert stats_of(m) == (0, 0, 0, False), (
        "caching off: the lookup counts nothing, (requests, queries, hits, reset) = (0, 0, 0, "
        f"False), got {stats_of(m)}"
    )


def test_lookup_counts_requests_queries_and_hits():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64, log_stats=True)
    seed_cache(m, list(range(8)))
    computed_blocks(m, make_request("a", list(range(11)), 4))  # 11 queried, 8 hit
    computed_blocks(m, make_request("b", [9] * 6, 4))  # 6 queried, 0 hit
    stats = m.make_prefix_cache_stats()
    got = (stats.requests, stats.queries, stats.hits)
    assert got == (2, 17, 8), (
        f"two lookups (11 tokens queried, 8 hit; 6 queried, 0 hit) add up to (requests, "
        f"queries, hits) = (2, 17, 8), got {got}: add to the counts, do not overwrite them"
    )
    off = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    computed_blocks(off, make_request("c", list(range(11)), 4))
    assert off.prefix_cache_stats is None and off.make_prefix_cache_stats() is None, (
        "without log_stats there are no prefix-cache stats (None)"
    )


def test_lookup_rejects_a_request_without_matching_hashes_before_counting():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64, log_stats=True)
    seed_cache(m, list(range(8)))
    bare = lab.Request("bare", list(range(9)), lab.SamplingParams(), EOS)  # no hasher
    before = snapshot(m)
    with pytest.raises(ValueError):
        computed_blocks(m, bare)
    assert snapshot(m) == before, (
        "get_computed_blocks raised ValueError but changed the manager first (its stats or "
        "blocks): check the block hashes before counting"
    )


def test_lookup_salt_and_lora_change_the_whole_chain():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    seed_cache(m, list(range(12)), salt="salt1")
    tokens = list(range(12)) + [1]
    assert computed_blocks(m, make_request("same", tokens, 4, salt="salt1"))[1] == 12, (
        "blocks 0-2 were cached with salt 'salt1': the same tokens and salt hit 12 tokens (3 "
        "blocks)"
    )
    assert computed_blocks(m, make_request("other", tokens, 4, salt="salt2"))[1] == 0, (
        "another salt ('salt2') must miss blocks cached with 'salt1': 0 hit tokens"
    )
    assert computed_blocks(m, make_request("none", tokens, 4))[1] == 0, (
        "an unsalted request must miss blocks cached with salt 'salt1': 0 hit tokens"
    )
    seed_cache(m, list(range(12)), lora_id=3)
    assert computed_blocks(m, make_request("l3", tokens, 4, lora_id=3))[1] == 12, (
        "blocks 0-2 were cached under LoRA id 3: the same tokens with LoRA 3 hit 12 tokens"
    )
    assert computed_blocks(m, make_request("l4", tokens, 4, lora_id=4))[1] == 0, (
        "LoRA id 4 must miss blocks cached under LoRA id 3: 0 hit tokens"
    )


# --------------------------------------------------------------------------- 3. capacity


def test_blocks_to_allocate_for_a_new_request():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    free_hits = seed_cache(m, list(range(8)))  # ref_cnt 0, in the free queue
    held_hits = seed_cache(m, [5] * 8, hold=True)  # ref_cnt 1
    before = snapshot(m)
    cases = [  # (tokens, hit blocks, what they are, blocks taken from the free queue)
        (9, [], "no hits", 3),
        (8, [], "no hits, exactly two blocks", 2),
        (1, [], "no hits", 1),
        # Held hit blocks cost nothing; free ones leave the free queue like new blocks.
        (9, held_hits, "2 held hits (ref_cnt 1)", 1),
        (9, free_hits, "2 free hits (ref_cnt 0, in the free queue)", 3),
        (9, [held_hits[0], free_hits[1]], "1 held and 1 free hit", 2),
        # The null block is never an eviction candidate.
        (4, [m.block_pool.null_block], "the null block", 0),
    ]
    for tokens, hits, what, want in cases:
        got = m._get_num_blocks_to_allocate("new", tokens, hits)
        assert got == want, (
            f"a new request of {tokens} tokens with {what}: {want} block(s) leave the free "
            f"queue (new blocks plus hits revived from the queue), got {got}"
        )
    assert snapshot(m) == before, "counting must not create a table entry or change anything"
    assert "new" not in m.req_to_blocks and "new" not in m.num_cached_block, (
        "counting blocks for a new request must not start tracking it"
    )


def test_blocks_to_allocate_for_a_tracked_request():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    req = make_request("r", range(8), 4)
    track(m, req, 2)
    before = snapshot(m)
    for tokens, want in ((9, 1), (8, 0), (17, 3)):
        got = m._get_num_blocks_to_allocate("r", tokens, [])
        assert got == want, (
            f"a request holding 2 blocks of 4 needs {want} more for {tokens} tokens (count the "
            f"blocks it holds), got {got}"
        )
    # Holding more than it needs (lookahead slots from an earlier step): nothing to take.
    got = m._get_num_blocks_to_allocate("r", 3, [])
    assert got <= 0, f"2 blocks held, 3 tokens need 1: nothing to take, got {got}"
    assert snapshot(m) == before, "counting blocks must change nothing"


# --------------------------------------------------------------------------- 4. allocation


def test_allocate_a_new_request_without_caching():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64, enable_caching=False)
    req = make_request("r", range(10), 4)
    new = m.allocate_slots(req, 10)
    assert isinstance(new, lab.KVCacheBlocks) and new.get_block_ids() == ([1, 2, 3],), (
        "caching off, 10 tokens in blocks of 4: a KVCacheBlocks of the 3 new blocks [1, 2, 3], "
        f"got {new.get_block_ids() if isinstance(new, lab.KVCacheBlocks) else new!r:.60}"
    )
    assert table(m, req) == new.blocks[0], (
        f"the table must be the 3 new blocks, {ids(new.blocks[0])}; req_to_blocks['r'] is "
        f"{ids(table(m, req))}"
    )
    assert m.num_cached_block["r"] == 0, (
        f"caching off: num_cached_block['r'] is 0, got {m.num_cached_block['r']}"
    )
    assert [b.ref_cnt for b in new.blocks[0]] == [1, 1, 1], (
        "each new block is held by the request once (ref_cnt 1), got "
        f"{[b.ref_cnt for b in new.blocks[0]]}"
    )
    assert all(b.block_hash is None for b in m.block_pool.blocks), (
        "caching off: no block may be cached, but block(s) "
        f"{[b.block_id for b in m.block_pool.blocks if b.block_hash is not None][:8]} have a hash"
    )
    assert free_ids(m) == [4, 5, 6, 7], (
        f"blocks 1-3 taken from the front: the free queue is [4, 5, 6, 7], got {free_ids(m)}"
    )
    bare = lab.Request("bare", list(range(5)), lab.SamplingParams(), EOS)  # no block hashes
    assert granted(m.allocate_slots(bare, 5)).get_block_ids() == ([4, 5],), (
        "no hash check, caching off")


def test_decode_takes_a_block_only_when_the_last_one_is_full():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64, enable_caching=False)
    req = make_request("r", range(6), 4)
    first = granted(m.allocate_slots(req, 6)).blocks[0]
    req.num_computed_tokens = 6
    for t in range(6, 8):
        req.append_output_token_ids(t)
        assert granted(m.allocate_slots(req, 1)).get_block_ids() == ([],), (
            f"decoding token {t}: {t + 1} slots fit the 2 blocks the request holds, so no new "
            "block (the table grows only to cdiv(slots, block_size) blocks)"
        )
        req.num_computed_tokens += 1
    req.append_output_token_ids(8)
    new = m.allocate_slots(req, 1)
    assert new.get_block_ids() == ([3],), (
        f"token 8 is the 9th slot: one new block, 3; got {new.get_block_ids()}"
    )
    assert table(m, req) == first + new.blocks[0], "blocks are appended, never replaced"


def test_a_chunk_shorter_than_the_rest_of_the_prompt():
    """Chunked prefill: slots are counted from the tokens computed so far, not the prompt."""
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64, enable_caching=False)
    req = make_request("r", range(10), 4)
    for computed, chunk, new_block in ((0, 3, 1), (3, 5, 2), (8, 2, 3)):
        req.num_computed_tokens = computed
        new = granted(m.allocate_slots(req, chunk)).get_block_ids()
        assert new == ([new_block],), (
            f"{computed} tokens computed, a chunk of {chunk}: {computed + chunk} slots need "
            f"block {new_block} as the one new block; allocate_slots returned {new}"
        )
    assert m.get_block_ids("r") == ([1, 2, 3],), f"the table after 3 chunks: {m.get_block_ids('r')}"


def test_an_allocation_that_fits_exactly_succeeds():
    m = lab.KVCacheManager(num_blocks=6, block_size=4, max_model_len=64, enable_caching=False)
    req = make_request("r", range(20), 4)
    assert m.block_pool.get_num_free_blocks() == 5, (
        "test premise: 6 blocks minus the null block leave 5 free"
    )
    assert len(granted(m.allocate_slots(req, 20)).blocks[0]) == 5, (
        "20 tokens in blocks of 4 take exactly the 5 free blocks: an exact fit must succeed with "
        "5 new blocks"
    )
    assert m.block_pool.get_num_free_blocks() == 0, (
        f"the exact fit takes every free block, but {m.block_pool.get_num_free_blocks()} are left"
    )
    other = make_request("o", range(3), 4)
    before = snapshot(m)
    assert m.allocate_slots(other, 3) is None, (
        "no free block is left: allocate_slots must refuse a request needing 1 block (None)"
    )
    assert snapshot(m) == before, (
        "a refused allocation (None) must change nothing: check capacity before claiming or "
        "taking blocks"
    )


def test_a_tracked_request_that_fits_exactly():
    """Forgetting the blocks a request holds makes the capacity check too strict."""
    m = lab.KVCacheManager(num_blocks=6, block_size=4, max_model_len=64, enable_caching=False)
    req = make_request("r", range(8), 4)
    m.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    req.append_output_token_ids(list(range(8, 20)))
    assert m.block_pool.get_num_free_blocks() == 3, (
        f"8 tokens take 2 of the 5 free blocks: 3 left, got {m.block_pool.get_num_free_blocks()}"
    )
    assert len(granted(m.allocate_slots(req, 12)).blocks[0]) == 3, (
        "the request holds 2 blocks; 20 tokens need 5: 3 new blocks, exactly the free ones"
    )
    assert m.block_pool.get_num_free_blocks() == 0, (
        f"the exact fit takes every free block, but {m.block_pool.get_num_free_blocks()} are left"
    )


@pytest.mark.parametrize("hold", [False, True], ids=["free-hits", "held-hits"])
def test_hits_are_claimed_and_fit_exactly(hold):
    """Hit blocks in the free queue use up free capacity; hit blocks held by another request do
    not. With exactly enough room the allocation succeeds; with one block less it is refused
    and nothing changes."""
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    hits = seed_cache(m, list(range(8)), hold=hold)
    spare = 5 if hold else 7  # free blocks, hit blocks included when they are free
    assert m.block_pool.get_num_free_blocks() == spare, (
        f"test premise: seed_cache leaves {spare} free blocks"
    )
    too_big = make_request("big", list(range(8)) + [9] * (4 * (spare - (0 if hold else 2)) + 1), 4)
    hit, n = computed_blocks(m, too_big)
    assert n == 8, f"tokens 0..7 are cached (2 blocks): the lookup hits 8 tokens, got {n}"
    before = snapshot(m)
    assert m.allocate_slots(too_big, too_big.num_tokens - n, n, hit,
                            delay_cache_blocks=True) is None, (
        f"the request needs one block more than the {spare} free ones (free hit blocks count, "
        "held ones do not): allocate_slots must refuse (None)"
    )
    assert snapshot(m) == before, "a refused allocation changed something"

    req = make_request("r", list(range(8)) + [9] * (4 * (spare - (0 if hold else 2)) - 1), 4)
    hit, n = computed_blocks(m, req)
    new = m.allocate_slots(req, req.num_tokens - n, n, hit, delay_cache_blocks=True)
    assert new is not None, "an allocation that fits exactly was refused"
    assert m.block_pool.get_num_free_blocks() == 0, (
        f"the exact fit takes every free block, but {m.block_pool.get_num_free_blocks()} are left"
    )
    assert table(m, req) == hits + new.blocks[0], "the table is the hits, then the new blocks"
    assert not set(ids(hits)) & set(new.get_block_ids()[0]), "hit blocks returned as new"
    assert [b.ref_cnt for b in hits] == ([2, 2] if hold else [1, 1]), (
        f"claimed hit blocks get one more holder: ref_cnt {[2, 2] if hold else [1, 1]}, got "
        f"{[b.ref_cnt for b in hits]}"
    )
    assert all(b.block_hash is not None for b in hits), "a claimed hit block lost its hash"
    assert m.num_cached_block["r"] == 2, (
        "the 2 hit blocks are cached already: num_cached_block['r'] is 2, got "
        f"{m.num_cached_block['r']}"
    )


def test_hits_are_claimed_before_new_blocks_are_taken():
    """The free hit blocks stand at the front of the free queue: taking the new blocks first
    would evict them and hand them out twice."""
    m = lab.KVCacheManager(num_blocks=5, block_size=4, max_model_len=64)
    pool = m.block_pool
    hits = seed_cache(m, list(range(8)), hold=True)  # blocks 1, 2
    others = pool.get_new_blocks(2)  # blocks 3, 4
    pool.free_blocks(reversed(hits))
    pool.free_blocks(others)
    assert free_ids(m) == [2, 1, 3, 4], f"set-up: the free queue {free_ids(m)}"
    req = make_request("r", list(range(8)) + [5] * 7, 4)
    hit, n = computed_blocks(m, req)
    new = m.allocate_slots(req, req.num_tokens - n, n, hit, delay_cache_blocks=True)
    assert new.get_block_ids() == ([3, 4],), (
        f"the hit blocks 1, 2 are claimed (touched) first, so the new blocks are 3, 4 from the "
        f"queue; allocate_slots returned {new.get_block_ids()}"
    )
    assert m.get_block_ids("r") == ([1, 2, 3, 4],), f"the table: {m.get_block_ids('r')}"
    assert [b.block_hash for b in hits] == [keyed(h) for h in req.block_hashes[:2]], (
        "the claimed hit blocks keep their hashes (they were not evicted as new blocks)"
    )


def test_lookahead_slots_and_the_model_length_cap():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64, enable_caching=False)
    r = make_request("r", range(6), 4)
    new = granted(m.allocate_slots(r, 6, num_lookahead_tokens=4))  # 10 slots
    assert len(new.blocks[0]) == 3, (
        "6 tokens + 4 lookahead slots = 10 slots: 3 blocks of 4"
    )
    r.num_computed_tokens = 6
    r.append_output_token_ids(6)
    assert granted(m.allocate_slots(r, 1)).get_block_ids() == ([],), "the table never shrinks"
    assert len(table(m, r)) == 3, (
        f"the table never shrinks: it keeps its 3 blocks, got {len(table(m, r))}"
    )
    capped = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=8,
                                enable_caching=False)
    c = make_request("c", range(6), 4)
    assert len(granted(capped.allocate_slots(c, 6, num_lookahead_tokens=8)).blocks[0]) == 2, (
        "max_model_len 8 caps the slots: 6 tokens + 8 lookahead = 14, capped to 8: 2 blocks"
    )


def test_delay_cache_blocks_caches_nothing_and_skips_the_hash_check():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    d = make_request("d", range(100, 108), 4)
    new = m.allocate_slots(d, 8, delay_cache_blocks=True)
    assert len(new.blocks[0]) == 2 and all(b.block_hash is None for b in new.blocks[0]), (
        f"delay_cache_blocks: 2 new blocks and none cached; got {len(new.blocks[0])} block(s), "
        f"cached: {[b.block_id for b in new.blocks[0] if b.block_hash is not None]}"
    )
    assert m.num_cached_block["d"] == 0, (
        "delay_cache_blocks caches nothing: num_cached_block['d'] is 0, got "
        f"{m.num_cached_block['d']}"
    )
    bare = lab.Request("bare", list(range(9)), lab.SamplingParams(), EOS)  # no hashes
    assert len(granted(m.allocate_slots(bare, 9, delay_cache_blocks=True)).blocks[0]) == 3, (
        "delay_cache_blocks skips the hash check: a request without block hashes gets its 3 blocks"
    )


@beside_the_student
def save_then_append(manager, request_id, blocks, extra):
    """Save a list of the caller's as a request's hits, then append to that list; whether the
    table is that very list. It runs where the manager runs: only there is the list the manager
    was given the caller's own."""
    given = list(blocks)
    manager._save_new_computed_blocks(request_id, given)
    kept = manager.req_to_blocks[request_id] is given
    given.append(extra)
    return kept


def test_save_new_computed_blocks_only_the_first_time():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    hits = seed_cache(m, list(range(8)), hold=True)
    kept = save_then_append(m, "r", hits, m.block_pool.blocks[5])
    assert not kept, "the table must be the manager's own list, not the one it was given"
    assert m.req_to_blocks["r"] == hits and m.num_cached_block["r"] == 2, (
        f"_save_new_computed_blocks: the table is the 2 hit blocks {ids(hits)} and "
        f"num_cached_block 2; got {ids(m.req_to_blocks['r'])} and {m.num_cached_block.get('r')}"
    )
    assert [b.ref_cnt for b in hits] == [1, 1], "claiming is allocate_slots' job"
    m._save_new_computed_blocks("r", [m.block_pool.blocks[6]])
    assert m.req_to_blocks["r"] == hits and m.num_cached_block["r"] == 2, (
        "a second _save_new_computed_blocks for a tracked request changes nothing; got "
        f"{ids(m.req_to_blocks['r'])} and {m.num_cached_block.get('r')}"
    )
    m._save_new_computed_blocks("empty", [])
    assert m.req_to_blocks["empty"] == [] and m.num_cached_block["empty"] == 0, (
        "saving no hits still starts tracking: an empty table and num_cached_block 0; got "
        f"{len(m.req_to_blocks['empty'])} block(s) and {m.num_cached_block.get('empty')}"
    )


def test_allocate_new_blocks_grows_a_table_from_the_front_of_the_queue():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    req = make_request("r", range(8), 4)
    held = list(track(m, req, 1))
    m.block_pool.free_blocks([m.block_pool.get_new_blocks(1)[0]])  # queue: 3, ..., 9, 2
    new = m._allocate_new_blocks("r", 9)
    assert ids(new) == [3, 4], (
        f"growing 1 block to 3 takes 2 from the front of the free queue, [3, 4]; got {ids(new)}"
    )
    assert table(m, req) == held + new, (
        f"the new blocks are appended: the table is {ids(held) + ids(new)}, got "
        f"{ids(table(m, req))}"
    )
    assert m._allocate_new_blocks("r", 12) == [] and m._allocate_new_blocks("r", 2) == [], (
        "a table of 3 blocks is long enough for 12 or 2 tokens: no new block ([]), never shrink"
    )
    assert len(table(m, req)) == 3, f"the table keeps its 3 blocks, got {len(table(m, req))}"


def test_bad_input_is_rejected_and_changes_nothing():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=13)
    seed_cache(m, range(9))
    warm = make_request("warm", range(8), 4)
    assert m.allocate_slots(warm, 8, delay_cache_blocks=True) is not None, (
        "'warm' (8 tokens, 2 blocks) must fit: 7 blocks are free"
    )
    req = make_request("fresh", range(9), 4)
    hit, n = computed_blocks(m, req)
    assert n == 8, f"tokens 0..7 are cached (2 blocks): the lookup hits 8 tokens, got {n}"
    before = snapshot(m)
    bad_calls = [
        (lambda: m.allocate_slots(req, 0), [0]),
        (lambda: m.allocate_slots(req, -3), [-3]),
        (lambda: m.allocate_slots(req, 1, 0, None, -2), [-2]),
        (lambda: m.allocate_slots(req, 1, 7, hit), [7]),  # 7 tokens claimed for 2 hit blocks
        (lambda: m.allocate_slots(req, 1, 0, hit), []),  # hit blocks, but 0 hit tokens
        (lambda: m.allocate_slots(req, 6, n, hit), [13]),  # 8 + 6 > max_model_len 13
        (lambda: m.allocate_slots(warm, 1, n, hit), ["warm"]),  # warm is tracked already
        (lambda: m.allocate_slots(lab.Request("bare", [1] * 5, lab.SamplingParams(), EOS), 5), []),
    ]
    for call, named in bad_calls:
        with pytest.raises(ValueError) as exc:
            call()
        message_names(exc, *named)
        assert snapshot(m) == before, (
            f"allocate_slots raised ValueError ({str(exc.value)[:50]!r}) but changed the manager "
            "first: check every argument before claiming or taking blocks"
        )
    assert m.allocate_slots(req, 5, n, hit, delay_cache_blocks=True) is not None, (  # 13: fits
        "8 hit + 5 new tokens = 13 = max_model_len: this must fit (refuse only beyond "
        "max_model_len)"
    )

    off = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64, enable_caching=False)
    stray = seed_cache(m, [3] * 4)
    with pytest.raises(ValueError):
        off.allocate_slots(make_request("x", range(9), 4), 5, 4, lab.KVCacheBlocks((stray,)))
    assert off.req_to_blocks == {} and off.block_pool.get_num_free_blocks() == 7, (
        "caching off with hit blocks: ValueError and nothing changed; tracked "
        f"{sorted(off.req_to_blocks)}, {off.block_pool.get_num_free_blocks()} free (7 before)"
    )


# --------------------------------------------------------------------------- 5. caching


def test_cache_blocks_caches_the_full_blocks_once():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    req = make_request("r", range(10), 4)
    track(m, req, 3)
    m.cache_blocks(req, 10)
    assert_cached_exactly(m, req, 2)
    before = snapshot(m)
    m.cache_blocks(req, 10)  # nothing new: no "already cached" error, no change
    m.cache_blocks(req, 5)  # fewer tokens than are cached: no change
    m.cache_blocks(req, 0)
    assert snapshot(m) == before, (
        "cache_blocks for tokens already cached (10, 5, 0) must change nothing: only blocks "
        "beyond num_cached_block are new"
    )
    req.append_output_token_ids([10, 11, 12])
    m.cache_blocks(req, 12)  # only block 2 is new
    assert_cached_exactly(m, req, 3)


def test_cache_blocks_reports_stored_blocks_with_their_block_size():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64,
                           enable_kv_cache_events=True)
    req = make_request("r", range(10), 4, lora_id=5)
    m.allocate_slots(req, 10)
    (event,) = m.take_events()
    assert (event.block_hashes, event.token_ids) == (req.block_hashes, list(range(8))), (
        "one BlockStored for blocks 0-1: their 2 hashes and tokens 0..7; got "
        f"{len(event.block_hashes)} hash(es), {len(event.token_ids)} token(s)"
    )
    assert (event.parent_block_hash, event.block_size, event.lora_id) == (None, 4, 5), (
        "BlockStored: parent None, block_size 4 (the manager's), lora_id 5; got "
        f"({event.parent_block_hash!r:.20}, {event.block_size}, {event.lora_id})"
    )


def test_cache_blocks_resumes_after_the_cached_blocks():
    """Blocks the table starts with that are cached already (hits) are not passed again."""
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    hits = seed_cache(m, range(8), hold=True)
    req = make_request("r", range(13), 4)
    set_table(m, "r", hits + m.block_pool.get_new_blocks(2), 2)
    m.cache_blocks(req, 13)
    assert_cached_exactly(m, req, 3)


def test_cache_blocks_rejects_bad_calls_and_changes_nothing():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    req = make_request("unknown-req", range(10), 4)
    before = snapshot(m)
    with pytest.raises(ValueError) as exc:
        m.cache_blocks(req, 8)
    message_names(exc, "unknown-req")
    assert snapshot(m) == before, (
        "cache_blocks raised ValueError for an untracked request but changed the manager first"
    )
    held = make_request("held", range(11), 4)
    track(m, held, 2)
    before = snapshot(m)
    with pytest.raises(ValueError) as exc:
        m.cache_blocks(held, 11)  # 2 blocks hold 8 tokens
    message_names(exc, 11, 2)
    assert snapshot(m) == before, (
        "cache_blocks raised ValueError (11 tokens, 2 blocks) but changed the manager first"
    )
    bare = lab.Request("bare", list(range(8)), lab.SamplingParams(), EOS)
    track(m, bare, 2)
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.cache_blocks(bare, 8)
    assert snapshot(m) == before, (
        "cache_blocks raised ValueError (no block hashes) but changed the manager first"
    )
    off = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64,
                             enable_caching=False)
    off.cache_blocks(req, 8)  # caching off: nothing happens, not even the check
    assert off.req_to_blocks == {}, (
        "caching off: cache_blocks does nothing, but the manager tracks "
        f"{sorted(off.req_to_blocks)}"
    )


def test_seed_worked_example_block_size_4():
    """'The cat sat on the mat and then', then 'The cat sat on the rug': one block hit."""
    vocab: dict[str, int] = {}

    def tok(text):
        return [vocab.setdefault(w, len(vocab)) for w in text.split()]

    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    a = make_request("A", tok("The cat sat on the mat and then"), 4)
    hit, n, new = schedule_prompt(m, a)
    assert n == 0 and new.get_block_ids() == ([1, 2],), (
        f"A is the first request: no hit and the new blocks [1, 2]; got {n} hit tokens, new "
        f"{new.get_block_ids() if isinstance(new, lab.KVCacheBlocks) else new!r:.40}"
    )
    assert_cached_exactly(m, a, 2)

    b = make_request("B", tok("The cat sat on the rug"), 4)
    assert len(b.block_hashes) == 1, (  # "the rug" is a partial block: not hashed
        "test premise: 'The cat sat on the rug' is 6 tokens, 1 full block hashed"
    )
    hit, n, new = schedule_prompt(m, b)
    assert hit.get_block_ids() == ([1],) and n == 4, (  # prefill skips "The cat sat on"
        "B shares block 0 ('The cat sat on') with A: hit [1] and 4 tokens, got "
        f"{hit.get_block_ids()} and {n}"
    )
    assert new.get_block_ids() == ([3],), (
        f"B's partial block 'the rug' is one new block, 3; got {new.get_block_ids()}"
    )
    assert m.block_pool.blocks[1].ref_cnt == 2, (
        f"block 1 is held by A and B: ref_cnt 2, got {m.block_pool.blocks[1].ref_cnt}"
    )
    assert_cached_exactly(m, b, 1)
    assert m.get_block_ids("B") == ([1, 3],), (
        f"B's table is the hit block 1, then the new block 3; got {m.get_block_ids('B')}"
    )


def test_chunked_prefill_caches_each_block_when_its_chunk_completes_it():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    req = make_request("r", range(10), 4)
    m.allocate_slots(req, 3)
    assert_cached_exactly(m, req, 0)
    req.num_computed_tokens = 3
    m.allocate_slots(req, 5)  # tokens 3..7: blocks 0 and 1 are full and computed now
    assert_cached_exactly(m, req, 2)
    req.num_computed_tokens = 8
    assert granted(m.allocate_slots(req, 2)).get_block_ids() == ([3],), (
        "tokens 8..9 need a third block: one new block, 3"
    )
    assert_cached_exactly(m, req, 2)  # block 2 holds 2 of 4 tokens


def test_decode_allocates_only_when_a_block_fills():
    """Upstream test_decode."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    _, _, new = schedule_prompt(m, r0)
    assert new.get_block_ids() == ([1, 2, 3, 4],), (
        f"55 tokens in blocks of 16: the new blocks [1, 2, 3, 4], got {new.get_block_ids()}"
    )

    for _ in range(4):
        r0.append_output_token_ids(8)
    new = m.allocate_slots(r0, 4)  # 55 + 4 = 59 tokens still fit 4 blocks
    assert new is not None and new.get_block_ids() == ([],), (
        "55 + 4 = 59 tokens fit the 4 blocks held (64 slots): no new block; got "
        f"{new.get_block_ids() if new is not None else None}"
    )
    assert table(m, r0)[-1].block_hash is None, (
        "the last block is partial (59 of 64 slots filled): it must not be cached"
    )
    r0.num_computed_tokens = 59

    r0.append_output_token_ids([7] * 19)  # fills block 4, and 14 tokens into a fifth
    new = m.allocate_slots(r0, 19)
    assert new is not None and len(new.blocks[0]) == 1, (
        "78 tokens need 5 blocks, 4 held: one new block; got "
        f"{len(new.blocks[0]) if new is not None else None}"
    )
    assert_cached_exactly(m, r0, 4)


def test_lookahead_slots_are_never_cached_and_delayed_blocks_are_cached_later():
    m = lab.KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = make_request("r", range(6), 4)
    assert len(granted(m.allocate_slots(r, 6, num_lookahead_tokens=6)).blocks[0]) == 3, (
        "6 tokens + 6 lookahead slots = 12 slots: 3 blocks of 4"
    )
    assert_cached_exactly(m, r, 1)
    d = make_request("d", range(100, 108), 4)
    m.allocate_slots(d, 8, delay_cache_blocks=True)
    m.cache_blocks(d, 8)  # later, once the KV really arrived
    assert_cached_exactly(m, d, 2)


def test_salt_changes_the_whole_chain():
    """Upstream test_cache_key_salting."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    tokens = COMMON + [3] * 11
    r0 = make_request("0", tokens, 16, salt="salt1")
    hit, n, new = schedule_prompt(m, r0)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],), (
        f"r0 is the first request: no hit and the new blocks [1, 2, 3, 4]; got {n} hit tokens, new "
        f"{new.get_block_ids() if isinstance(new, lab.KVCacheBlocks) else new!r:.40}"
    )
    r0.append_output_token_ids([8] * 5)
    assert granted(m.allocate_slots(r0, 5)).get_block_ids() == ([],), (
        "59 + 5 = 64 tokens fill the 4 blocks held: no new block"
    )
    assert_cached_exactly(m, r0, 4)
    assert r0.block_hashes == expected_hashes(tokens + [8] * 5, 16, salt="salt1"), (
        "test premise: r0's hashes come from the given reference hasher (salt 'salt1' on block 0)"
    )

    same_salt = make_request("1", COMMON + [4] * 11, 16, salt="salt1")
    hit, n = computed_blocks(m, same_salt)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48, (
        f"same salt, same first 3 blocks: hit [1, 2, 3] and 48 tokens, got {hit.get_block_ids()} "
        f"and {n}"
    )
    other_salt = make_request("2", COMMON + [4] * 11, 16, salt="salt2")
    hit, n = computed_blocks(m, other_salt)
    assert hit.get_block_ids() == ([],) and n == 0, (
        f"another salt must miss: hit [] and 0 tokens, got {hit.get_block_ids()} and {n}"
    )
    no_salt = make_request("3", COMMON + [4] * 11, 16)
    assert computed_blocks(m, no_salt)[1] == 0, (
        "an unsalted request must miss blocks cached with salt 'salt1': 0 hit tokens"
    )


def test_prefix_cache_stats():
    """Upstream test_prefix_cache_stats_disabled, plus queries / hits / hit rate."""
    off = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    schedule_prompt(off, make_request("0", range(16), 16))
    assert off.prefix_cache_stats is None and off.make_prefix_cache_stats() is None, (
        "without log_stats there are no prefix-cache stats (None)"
    )
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192, log_stats=True)
    schedule_prompt(m, make_request("a", COMMON + [3] * 7, 16))  # 55 queried, 0 hit
    schedule_prompt(m, make_request("b", COMMON + [4] * 2, 16))  # 50 queried, 48 hit
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 105, 48), (
        "two lookups (55 queried, 0 hit; 50 queried, 48 hit): (requests, queries, hits) = (2, "
        f"105, 48), got {(stats.requests, stats.queries, stats.hits)}"
    )
    assert stats.hit_rate == pytest.approx(48 / 105), f"hit rate 48 / 105, got {stats.hit_rate}"
    fresh = m.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits, fresh.hit_rate) == (0, 0, 0, 0.0), (
        "make_prefix_cache_stats starts new stats: all zero, got "
        f"{(fresh.requests, fresh.queries, fresh.hits, fresh.hit_rate)}"
    )


# --------------------------------------------------------------------------- 6. free


def test_free_returns_blocks_tail_first_and_forgets_the_request():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    r = make_request("r", range(14), 4)
    schedule_prompt(m, r)
    assert m.get_block_ids("r") == ([1, 2, 3, 4],), f"set-up: the table {m.get_block_ids('r')}"
    cached = [b.block_hash for b in table(m, r)]
    m.free(r)
    assert free_ids(m) == [5, 6, 7, 4, 3, 2, 1], (
        f"free returns the table tail first (4, 3, 2, 1) behind the free blocks, so the prefix "
        f"the next request most likely shares is evicted last; the free queue is {free_ids(m)}"
    )
    assert "r" not in m.req_to_blocks and "r" not in m.num_cached_block, (
        f"free forgets the request in both dicts: req_to_blocks has it: "
        f"{'r' in m.req_to_blocks}, num_cached_block has it: {'r' in m.num_cached_block}"
    )
    assert [b.block_hash for b in m.block_pool.blocks[1:5]] == cached, "freeing keeps hashes"
    before = snapshot(m)
    m.free(r)  # not tracked any more: nothing happens
    m.free(make_request("never", range(3), 4))
    assert snapshot(m) == before, "free of a request the manager does not track changes nothing"


def test_free_leaves_blocks_shared_with_others():
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    a = make_request("a", range(9), 4)
    b = make_request("b", list(range(8)) + [7, 7], 4)
    schedule_prompt(m, a)
    schedule_prompt(m, b)
    assert m.get_block_ids("b") == ([1, 2, 4],), (
        f"b shares a's 2 full blocks (1, 2) and takes block 4; got {m.get_block_ids('b')}"
    )
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1], (
        "after freeing a: blocks 1, 2 and 4 are b's (ref_cnt 1), block 3 is free (0); got "
        f"{[m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)]}"
    )
    assert free_ids(m) == [5, 6, 7, 3], (
        f"only a's own block 3 goes back to the free queue (behind 5, 6, 7); got {free_ids(m)}"
    )


def test_a_request_freed_and_allocated_again_starts_from_scratch():
    """Preemption by recompute: the same request is freed, then admitted again. Its new blocks
    must be cached as they fill: the manager must not remember what was cached before."""
    m = lab.KVCacheManager(num_blocks=7, block_size=4, max_model_len=64)
    req = make_request("r", range(13), 4)
    schedule_prompt(m, req)
    req.append_output_token_ids([13, 14, 15])
    m.allocate_slots(req, 3)
    req.num_computed_tokens = 16
    assert_cached_exactly(m, req, 4)
    m.free(req)
    assert "r" not in m.num_cached_block, "free must forget the cached-block count too"
    # Another request takes every free block: the freed request's blocks are all evicted.
    filler = make_request("filler", [9] * 24, 4)
    schedule_prompt(m, filler)
    m.free(filler)
    req.num_computed_tokens = 0
    hit, n, new = schedule_prompt(m, req)  # re-admitted: its KV is recomputed
    assert n == 0 and new is not None, (
        f"re-admitted after its blocks were evicted: no hit, and the allocation fits; got {n} hit "
        f"tokens, new is {'None' if new is None else 'not None'}"
    )
    assert_cached_exactly(m, req, 4)
    m.free(req)
    again_hit, n, _ = schedule_prompt(m, make_request("again", range(17), 4))
    assert n == 16, "the recomputed blocks must be found by the next request"


def test_a_request_freed_mid_prefill_keeps_only_its_completed_blocks_cached():
    """Abort in the middle of a chunked prefill."""
    m = lab.KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    req = make_request("r", range(14), 4)
    m.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == 7, (
        "freeing a request mid-prefill returns all its blocks: 7 free, got "
        f"{m.block_pool.get_num_free_blocks()}"
    )
    hit, n = computed_blocks(m, make_request("s", range(14), 4))
    assert n == 4, "only the block the first chunk completed is cached"


def test_prefill_partial_hit_and_free_queue_order():
    """Upstream test_prefill: hits while in use and after free, then LRU eviction order."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    hit, n, new = schedule_prompt(m, r0)
    assert n == 0 and hit.get_block_ids() == ([],), f"an empty cache: no hit, got {n} hit tokens"
    assert new.get_block_ids() == ([1, 2, 3, 4],), (
        f"55 tokens in blocks of 16: the new blocks [1, 2, 3, 4], got {new.get_block_ids()}"
    )
    for i, h in enumerate(expected_hashes(COMMON, 16)):
        assert m.block_pool.blocks[i + 1].block_hash == keyed(h), (
            f"block {i + 1} holds r0's full block {i}: it must be cached under that block's hash"
        )
        assert m.block_pool.blocks[i + 1].ref_cnt == 1, (
            f"block {i + 1} is held by r0 alone: ref_cnt 1, got "
            f"{m.block_pool.blocks[i + 1].ref_cnt}"
        )
    assert m.block_pool.blocks[4].block_hash is None and m.block_pool.blocks[4].ref_cnt == 1, (
        "block 4 holds r0's partial block (7 of 16 tokens): held (ref_cnt 1) and not cached; got "
        f"ref_cnt {m.block_pool.blocks[4].ref_cnt}, cached: "
        f"{m.block_pool.blocks[4].block_hash is not None}"
    )

    r1 = make_request("1", COMMON + [3] * 5, 16)
    hit, n, new = schedule_prompt(m, r1)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48, (
        f"r1 shares r0's 3 full blocks: hit [1, 2, 3] and 48 tokens, got {hit.get_block_ids()} and "
        f"{n}"
    )
    assert new.get_block_ids() == ([5],), (
        f"r1's partial block is one new block, 5; got {new.get_block_ids()}"
    )
    assert [b.ref_cnt for b in hit.blocks[0]] == [2, 2, 2], (
        "the hit blocks are held by r0 and r1: ref_cnt [2, 2, 2], got "
        f"{[b.ref_cnt for b in hit.blocks[0]]}"
    )
    assert m.block_pool.get_num_free_blocks() == 5, (
        f"5 of the 10 usable blocks are held: 5 free, got {m.block_pool.get_num_free_blocks()}"
    )

    m.free(r0)
    m.free(r1)
    # Never used first, then each request's tail, and the shared prefix last, deepest first.
    assert free_ids(m) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1], (
        "each table is freed tail first: the queue is [6, 7, 8, 9, 10, 4, 5, 3, 2, 1], got "
        f"{free_ids(m)}"
    )

    r2 = make_request("2", COMMON + [3] * 6, 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1, 2, 3],) and n == 48, (
        "r2 shares the 3 cached full blocks: hit [1, 2, 3] and 48 tokens, got "
        f"{hit.get_block_ids()} and {n}"
    )
    assert new.get_block_ids() == ([6],), (
        f"r2's new block comes from the front of the free queue, 6; got {new.get_block_ids()}"
    )
    assert m.block_pool.get_num_free_blocks() == 6, (
        f"4 of the 10 usable blocks are held: 6 free, got {m.block_pool.get_num_free_blocks()}"
    )
    assert all(b.ref_cnt == 0 for b in m.block_pool.free_block_queue.get_all_free_blocks()), (
        "every block in the free queue has ref_cnt 0, got "
        f"{[b.ref_cnt for b in m.block_pool.free_block_queue.get_all_free_blocks()]}"
    )
    m.free(r2)

    r3 = make_request("3", [99] * 160, 16)
    hit, n, new = schedule_prompt(m, r3)
    assert n == 0, f"r3 shares no block with the cache: 0 hit tokens, got {n}"
    assert new.get_block_ids() == ([7, 8, 9, 10, 4, 5, 6, 3, 2, 1],), (  # the eviction order
        "160 tokens take all 10 free blocks in free-queue order [7, 8, 9, 10, 4, 5, 6, 3, 2, 1]; "
        f"got {new.get_block_ids()}"
    )
    assert m.block_pool.get_num_free_blocks() == 0, (
        f"r3 takes every free block, but {m.block_pool.get_num_free_blocks()} are left"
    )


def test_lru_eviction_order_after_free():
    """Upstream test_evict."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    n0 = 5 * 16 + 7
    r0 = make_request("0", range(n0), 16)
    _, _, new = schedule_prompt(m, r0)
    assert len(new.blocks[0]) == 6, (
        f"87 tokens in blocks of 16 need 6 blocks, got {len(new.blocks[0])}"
    )
    r1 = make_request("1", range(n0, n0 + 48), 16)
    _, _, new = schedule_prompt(m, r1)
    assert len(new.blocks[0]) == 3, (
        f"48 tokens in blocks of 16 need 3 blocks, got {len(new.blocks[0])}"
    )
    assert m.block_pool.get_num_free_blocks() == 1, (
        f"9 of the 10 usable blocks are held: 1 free, got {m.block_pool.get_num_free_blocks()}"
    )

    m.free(r0)
    m.free(r1)
    assert m.block_pool.get_num_free_blocks() == 10, (
        f"freeing both requests returns all 10 blocks, got {m.block_pool.get_num_free_blocks()} "
        "free"
    )
    assert free_ids(m) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7], (
        "r0 then r1, each freed tail first: the queue is [10, 6, 5, 4, 3, 2, 1, 9, 8, 7], got "
        f"{free_ids(m)}"
    )

    r2 = make_request("2", range(2 * 16 + 3), 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1, 2],) and n == 32, (
        f"r2 shares r0's first 2 blocks: hit [1, 2] and 32 tokens, got {hit.get_block_ids()} and "
        f"{n}"
    )
    assert new.get_block_ids() == ([10],), (
        f"r2's new block comes from the front of the free queue, 10; got {new.get_block_ids()}"
    )
    assert m.block_pool.get_num_free_blocks() == 7, (
        f"3 of the 10 usable blocks are held: 7 free, got {m.block_pool.get_num_free_blocks()}"
    )


def test_reused_block_loses_its_old_hash():
    """Upstream test_hash_block_correct_reuse."""
    m = lab.KVCacheManager(num_blocks=2, block_size=16, max_model_len=8192)
    r0 = make_request("0", range(16), 16)
    _, _, new = schedule_prompt(m, r0)
    assert new.get_block_ids() == ([1],) and m.block_pool.blocks[1].block_hash is not None, (
        f"16 tokens fill block 1, which is then cached; got {new.get_block_ids()}, cached: "
        f"{m.block_pool.blocks[1].block_hash is not None}"
    )
    m.free(r0)
    r1 = make_request("1", range(15), 16)
    _, n, new = schedule_prompt(m, r1)
    assert n == 0 and new.get_block_ids() == ([1],), (
        f"15 tokens, no full block: no hit and block 1 reused; got {n} hit tokens, new "
        f"{new.get_block_ids() if isinstance(new, lab.KVCacheBlocks) else new!r:.40}"
    )
    assert m.block_pool.blocks[1].block_hash is None, (
        "block 1 was reused for r1's 15 tokens (a partial block): it must not be cached"
    )


def test_hit_blocks_are_not_evicted_while_other_blocks_are_free():
    """Upstream test_computed_blocks_not_evicted."""
    m = lab.KVCacheManager(num_blocks=3, block_size=16, max_model_len=8192)
    r0 = make_request("0", range(16), 16)
    assert schedule_prompt(m, r0)[2].get_block_ids() == ([1],), "r0's 16 tokens take block 1"
    r1 = make_request("1", range(16, 32), 16)
    assert schedule_prompt(m, r1)[2].get_block_ids() == ([2],), "r1's 16 tokens take block 2"
    m.free(r0)
    m.free(r1)
    r2 = make_request("2", range(32), 16)
    hit, n, new = schedule_prompt(m, r2)
    assert hit.get_block_ids() == ([1],) and n == 16, (
        f"r2 shares r0's block 1: hit [1] and 16 tokens, got {hit.get_block_ids()} and {n}"
    )
    assert new.get_block_ids() == ([2],), (
        "the hit block 1 is claimed first, so the new block is the other free one, 2; got "
        f"{new.get_block_ids()}"
    )


def test_caching_disabled():
    """Upstream test_basic_prefix_caching_disabled."""
    m = lab.KVCacheManager(num_blocks=5, block_size=4, max_model_len=8192, enable_caching=False)
    r1 = make_request("1", range(10), 4)
    hit, n, new = schedule_prompt(m, r1)
    assert n == 0 and new is not None and len(new.blocks[0]) == 3, (
        f"caching off: no hit and 3 new blocks for 10 tokens; got {n} hit tokens, "
        f"{len(new.blocks[0]) if new is not None else None} new block(s)"
    )
    assert all(b.block_hash is None for b in m.block_pool.blocks), (
        "caching off: no block may be cached, but block(s) "
        f"{[b.block_id for b in m.block_pool.blocks if b.block_hash is not None][:8]} have a hash"
    )
    m.free(r1)
    r2 = make_request("2", range(16), 4)
    hit, n, new = schedule_prompt(m, r2)
    assert n == 0 and not hit.blocks[0] and new is not None and len(new.blocks[0]) == 4, (
        f"caching off: no hit and 4 new blocks for 16 tokens; got {n} hit tokens, "
        f"{len(new.blocks[0]) if new is not None else None} new block(s)"
    )
    r3 = make_request("3", range(4), 4)
    hit, n, new = schedule_prompt(m, r3)
    assert n == 0 and new is None, (  # all 4 usable blocks are held by r2
        f"all 4 usable blocks are held by r2: no hit and r3 refused (None); got {n} hit tokens, "
        f"new is {'None' if new is None else 'not None'}"
    )


def test_failed_allocation_touches_nothing():
    """Upstream test_prefill_not_enough_free_blocks_with_computed_blocks."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    r0 = make_request("0", COMMON, 16)
    schedule_prompt(m, r0)
    part0 = list(table(m, r0))
    r1 = make_request("1", COMMON * 2, 16)
    hit, n = computed_blocks(m, r1)
    assert hit.blocks[0] == part0 and n == 48, (
        f"r1 hits r0's 3 cached blocks, 48 tokens; got {ids(hit.blocks[0])} and {n}"
    )
    m.allocate_slots(r1, 48, n, hit)
    part1 = list(table(m, r1))
    m.free(r1)
    assert [b.ref_cnt for b in part1] == [1, 1, 1, 0, 0, 0], (
        "after freeing r1: its 3 hit blocks stay r0's (ref_cnt 1), its own 3 are free; got "
        f"{[b.ref_cnt for b in part1]}"
    )

    r2 = make_request("2", [7] * 32, 16)
    schedule_prompt(m, r2)
    assert m.block_pool.get_num_free_blocks() == 5, (
        "5 of the 10 usable blocks are held (r0's 3, r2's 2): 5 free, got "
        f"{m.block_pool.get_num_free_blocks()}"
    )
    # r3 hits all six blocks of r1, three of them free (eviction candidates), and needs three
    # more: 3 + 3 > 5 free, so nothing may happen.
    r3 = make_request("3", COMMON * 3, 16)
    hit, n = computed_blocks(m, r3)
    assert hit.blocks[0] == part1 and n == 96, (
        f"r3 hits all 6 of r1's cached blocks, 96 tokens; got {ids(hit.blocks[0])} and {n}"
    )
    before = snapshot(m)
    assert m.allocate_slots(r3, 48, n, hit) is None, (
        "r3 needs 3 new blocks plus its 3 free hit blocks out of the queue: 6 > 5 free, so "
        "allocate_slots must refuse (None)"
    )
    assert snapshot(m) == before, (
        "a refused allocation must change nothing: check capacity before claiming the hits"
    )
    assert [b.ref_cnt for b in part1] == [1, 1, 1, 0, 0, 0], (
        "a refused allocation claims no hit block: ref_cnt [1, 1, 1, 0, 0, 0], got "
        f"{[b.ref_cnt for b in part1]}"
    )


def test_evicted_then_reused_block_is_never_served_for_its_old_hash():
    m = lab.KVCacheManager(num_blocks=3, block_size=4, max_model_len=64)
    old = make_request("old", [1, 2, 3, 4, 5], 4)
    schedule_prompt(m, old)
    assert m.get_block_ids("old") == ([1, 2],), (
        f"'old' (5 tokens) takes blocks [1, 2]; got {m.get_block_ids('old')}"
    )
    m.free(old)  # block 1 stays cached, as an eviction candidate
    new = make_request("new", [9, 9, 9, 9, 8, 8, 8, 8, 7], 4)
    assert m.allocate_slots(new, 9) is None, (  # needs 3 blocks, only 2 usable
        "9 tokens need 3 blocks but only 2 are usable: allocate_slots must refuse (None)"
    )
    new = make_request("new", [9, 9, 9, 9, 8, 8, 8, 8], 4)
    schedule_prompt(m, new)  # evicts and refills blocks 2 and 1
    assert sorted(m.get_block_ids("new")[0]) == [1, 2], (
        f"'new' takes both usable blocks, 1 and 2; got {m.get_block_ids('new')}"
    )
    m.free(new)

    again = make_request("again", [1, 2, 3, 4, 5], 4)
    hit, n = computed_blocks(m, again)
    assert n == 0, "a block reused for new content was served for its old hash"
    same_as_new = make_request("same", [9, 9, 9, 9, 8, 8, 8, 8, 1], 4)
    hit, n = computed_blocks(m, same_as_new)
    assert n == 8, f"'same' shares the 2 blocks 'new' cached: 8 hit tokens, got {n}"
    for blk, h in zip(hit.blocks[0], same_as_new.block_hashes):
        assert blk.block_hash == keyed(h), (
            f"a hit block must be cached under the hash asked for (block {blk.block_id})"
        )


# --------------------------------------------------------------------------- 7. reset, prefix


def test_reset_only_when_nothing_is_in_use():
    """Upstream test_reset_prefix_cache."""
    m = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192, log_stats=True)
    r0 = make_request("0", COMMON + [3] * 7, 16)
    assert granted(m.allocate_slots(r0, 55)).get_block_ids() == ([1, 2, 3, 4],), (
        "55 tokens in blocks of 16 take blocks [1, 2, 3, 4]"
    )
    r1 = make_request("1", COMMON + [4] * 7, 16)
    hit, n = computed_blocks(m, r1)
    assert len(hit.blocks[0]) == 3, (
        f"r1 shares r0's 3 full blocks: 3 hit blocks, got {len(hit.blocks[0])}"
    )
    assert granted(m.allocate_slots(r1, 7, n, hit)).get_block_ids() == ([5],), (
        "r1's 7 new tokens take one new block, 5"
    )

    before = snapshot(m)
    assert m.reset_prefix_cache() is False, (
        "blocks are in use: reset_prefix_cache must refuse (False)"
    )
    assert snapshot(m) == before, "a refused reset_prefix_cache must change nothing"
    assert m.make_prefix_cache_stats().reset is False, (
        "a refused reset_prefix_cache must not set prefix_cache_stats.reset"
    )

    m.free(r0)
    m.free(r1)
    assert m.reset_prefix_cache() is True, (
        "nothing is in use after both frees: reset_prefix_cache must succeed (True)"
    )
    assert all(b.block_hash is None for b in m.block_pool.blocks), (
        "after a reset no block is cached, but block(s) "
        f"{[b.block_id for b in m.block_pool.blocks if b.block_hash is not None][:8]} have a hash"
    )
    assert computed_blocks(m, make_request("2", COMMON + [3], 16))[1] == 0, (
        "after a reset nothing hits: 0 hit tokens"
    )
    assert m.make_prefix_cache_stats().reset is True, (
        "a successful reset_prefix_cache sets prefix_cache_stats.reset to True"
    )

    off = lab.KVCacheManager(num_blocks=11, block_size=16, max_model_len=8192)
    assert off.reset_prefix_cache() is True and off.prefix_cache_stats is None, (
        "without log_stats, reset_prefix_cache succeeds (True) and there are no stats (None)"
    )


def test_num_common_prefix_blocks():
    m = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    a = make_request("a", list(range(10)), 4)
    b = make_request("b", list(range(4)) + [50, 51, 52, 53, 54, 55, 56], 4)
    for r in (a, b):
        schedule_prompt(m, r)
        r.status = lab.RequestStatus.RUNNING
    assert m.get_num_common_prefix_blocks(a, 2) == [1], (  # b shares only block 0 with a
        "a and b (2 running) both hold block 0 only (ref_cnt 2): [1]"
    )
    assert m.get_num_common_prefix_blocks(a, 1) == [0], (
        "1 running request, but block 0 has ref_cnt 2: [0] (count blocks whose ref_cnt equals the "
        "number running)"
    )
    assert m.get_num_common_prefix_blocks(a, 3) == [0], (
        "3 running requests, but block 0 has ref_cnt 2: [0]"
    )
    assert m.get_num_common_prefix_blocks(b, 2) == [1], (
        "b shares block 0 with a (ref_cnt 2, 2 running): [1]"
    )
    c = make_request("c", list(range(10)), 4)
    schedule_prompt(m, c)
    c.status = lab.RequestStatus.RUNNING
    assert m.get_num_common_prefix_blocks(c, 3) == [1], (  # block 0: a, b, c; block 1: a, c
        "block 0 is held by a, b, c (ref_cnt 3), block 1 by a and c only: [1]"
    )
    assert m.usage == pytest.approx(6 / 10), (
        f"a, b and c hold 6 of the 10 usable blocks: usage 0.6, got {m.usage}"
    )
    d = make_request("d", list(range(8)) + [9], 4)
    schedule_prompt(m, d)
    d.status = lab.RequestStatus.RUNNING
    assert m.get_num_common_prefix_blocks(d, 4) == [1], (  # block 0: a, b, c, d
        "block 0 is held by all 4 running requests, block 1 by 3: [1]"
    )
    e = lab.KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    pair = [make_request(r, list(range(12)), 4) for r in ("x", "y")]
    for r in pair:
        schedule_prompt(e, r)
        r.status = lab.RequestStatus.RUNNING
    assert e.get_num_common_prefix_blocks(pair[0], 2) == [2], (  # two full blocks shared
        "x and y share their first 2 blocks (the hit stops before the last token): [2]"
    )
    lone = make_request("lone", [1], 4)
    lone.status = lab.RequestStatus.RUNNING
    assert m.get_num_common_prefix_blocks(lone, 1) == [0], "a request with no table: [0]"
    before = snapshot(m)
    a.status = lab.RequestStatus.WAITING
    with pytest.raises(ValueError) as exc:
        m.get_num_common_prefix_blocks(a, 2)
    message_names(exc, "WAITING")
    assert snapshot(m) == before, (
        "get_num_common_prefix_blocks raised ValueError but changed the manager: it changes nothing"
    )


# --------------------------------------------------------------------------- 8. state machine

BLOCK_SIZE = 4
MAX_LEN = 24
NUM_BLOCKS = 10
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12)


def cdiv(a, b):
    return -(a // -b)


class CacheManagerMachine(RuleBasedStateMachine):
    """Requests arrive (sharing prefixes) and are prefilled in chunks, decode (with lookahead
    slots), are preempted and admitted again, finish or are aborted at any point, and the cache
    is reset, as the scheduler drives the manager. After every step M1-M4 are checked, and every
    refusal both ways: ``allocate_slots`` returned ``None`` exactly when the blocks it needed
    (counted here, independently) were more than the free ones.

    Rules pick a request by index (``decode(i=1, ...)``), so a failing example prints as calls
    you can read and replay."""

    @initialize()
    def setup(self):
        self.m = lab.KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                    max_model_len=MAX_LEN)
        self.live: dict[str, SimpleNamespace] = {}  # tracked requests
        self.preempted: list[SimpleNamespace] = []  # freed, waiting to be admitted again
        self.next_id = 0

    def _allocate(self, seq, num_new, hit=None, num_hit=0, lookahead=0):
        """allocate_slots, checked against the independent count of blocks it needs."""
        req = seq.req
        before = snapshot(self.m)
        hits = read(hit).blocks[0] if hit is not None else []
        held = len(read(self.m).req_to_blocks.get(seq.id, []))
        slots = min(seq.computed + num_hit + num_new + lookahead, MAX_LEN)
        need = max(cdiv(slots, BLOCK_SIZE) - held - len(hits), 0)
        need += sum(1 for b in hits if b.ref_cnt == 0)
        free = before[1]  # the free queue's count
        new = self.m.allocate_slots(req, num_new, num_hit, hit, lookahead)
        if new is None:
            assert need > free, f"refused although {need} block(s) were needed and {free} free"
            assert snapshot(self.m) == before, "a refused allocation changed something"
            return False
        assert need <= free, f"allocated although {need} block(s) were needed and {free} free"
        now = ids(read(self.m).req_to_blocks[seq.id])
        assert now == seq.blocks + ids(hits) + ids(read(new).blocks[0]), (
            "the table is what it was (a new request's: its hits), then the new blocks"
        )
        seq.blocks = now
        seq.computed += num_hit + num_new
        req.num_computed_tokens = seq.computed
        return True

    def _admit(self, seq, chunk):
        req = seq.req
        hit, n = computed_blocks(self.m, req)
        assert n % BLOCK_SIZE == 0 and n < len(seq.tokens), (
            f"get_computed_blocks hit {n} tokens of {len(seq.tokens)}: a hit is whole blocks and "
            f"never the last token"
        )
        hits = read(hit).blocks[0]
        assert n == len(hits) * BLOCK_SIZE, (
            f"get_computed_blocks says {n} tokens hit but returns {len(hits)} block(s)"
        )
        for blk, h in zip(hits, seq.want()):
            assert blk.block_hash == keyed(h), "a hit block holds other tokens than asked for"
        seq.blocks = []
        if self._allocate(seq, min(chunk, len(seq.tokens) - n), hit, n):
            self.live[seq.id] = seq
            return True
        return False

    def _pick(self, i):
        return self.live[sorted(self.live)[i % len(self.live)]]

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        cut=st.integers(0, 12),
        tail=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from([None, "s"]),
        lora_id=st.sampled_from([None, 3]),
        chunk=st.sampled_from([3, 5, 64]),
    )
    def add_request(self, prefix, cut, tail, salt, lora_id, chunk):
        tokens = PREFIXES[prefix][:cut] + tail or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_request(rid, tokens, BLOCK_SIZE, salt=salt, lora_id=lora_id)
        # The request as the scheduler knows it (kept here: reading it back from the request
        # each time would cost a round trip where the lab has its process).
        seq = SimpleNamespace(req=req, id=rid, tokens=list(tokens), computed=0, salt=salt,
                              lora_id=lora_id, blocks=[])
        seq.want = lambda s=seq: expected_hashes(s.tokens, BLOCK_SIZE, salt=s.salt,
                                                 lora_id=s.lora_id)
        self._admit(seq, chunk)

    @precondition(lambda self: any(s.computed < len(s.tokens) for s in self.live.values()))
    @rule(i=st.integers(0, 7), chunk=st.integers(1, 6))
    def prefill_chunk(self, i, chunk):
        """The next chunk of a prompt that is not computed yet (it may end inside a block)."""
        todo = [s for s in self.live.values() if s.computed < len(s.tokens)]
        seq = todo[i % len(todo)]
        self._allocate(seq, min(chunk, len(seq.tokens) - seq.computed))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), token=st.integers(0, 3), lookahead=st.sampled_from([0, 0, 3]))
    def decode(self, i, token, lookahead):
        seq = self._pick(i)
        if seq.computed < len(seq.tokens) or len(seq.tokens) >= MAX_LEN:
            return
        seq.req.append_output_token_ids(token)
        seq.tokens.append(token)
        if not self._allocate(seq, 1, lookahead=lookahead):
            self._preempt(seq)

    def _preempt(self, seq):
        self.m.free(seq.req)
        del self.live[seq.id]
        seq.computed = seq.req.num_computed_tokens = 0
        seq.blocks = []
        self.preempted.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def preempt(self, i):
        self._preempt(self._pick(i))

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 7), chunk=st.sampled_from([5, 64]))
    def readmit(self, i, chunk):
        """A preempted request comes back with every token it has so far (recompute)."""
        seq = self.preempted[i % len(self.preempted)]
        if self._admit(seq, chunk):
            self.preempted.remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        """Finished or aborted, at any point of its prefill or decode."""
        seq = self._pick(i)
        self.m.free(seq.req)
        del self.live[seq.id]

    @rule()
    def reset(self):
        before = snapshot(self.m)
        done = self.m.reset_prefix_cache()
        assert done == (not self.live), "reset refused with nothing in use, or done while in use"
        if done:
            hashed = [b.block_id for b in read(self.m).block_pool.blocks
                      if b.block_hash is not None]
            assert not hashed, f"reset_prefix_cache succeeded but blocks {hashed} keep a hash"
        else:
            assert snapshot(self.m) == before, "a refused reset_prefix_cache changed the manager"

    @invariant()
    def m1_reference_counts_and_the_free_queue(self):
        if not hasattr(self, "m"):
            return
        free = free_ids(self.m)
        m = read(self.m)  # the whole manager in one read, where the lab has its process
        pool = m.block_pool
        assert len(free) == len(set(free)) == pool.free_block_queue.num_free_blocks, (
            f"the free queue holds {free} but num_free_blocks is "
            f"{pool.free_block_queue.num_free_blocks}"
        )
        holders = Counter(b for s in self.live.values() for b in s.blocks)
        assert 0 not in holders and 0 not in free, "the null block was handed out or freed"
        for blk in pool.blocks[1:]:
            assert blk.ref_cnt == holders[blk.block_id], f"block {blk.block_id}: wrong ref_cnt"
            assert (blk.block_id in free) == (blk.ref_cnt == 0), (
                f"block {blk.block_id} has ref_cnt {blk.ref_cnt} but is "
                f"{'in' if blk.block_id in free else 'not in'} the free queue"
            )
        assert set(m.req_to_blocks) == set(self.live), "tracked requests are the live ones"
        assert set(m.num_cached_block) == set(self.live), (
            f"num_cached_block tracks {sorted(m.num_cached_block)}, the live requests are "
            f"{sorted(self.live)}: free() must drop a request's entry"
        )

    @invariant()
    def m2_computed_full_blocks_are_cached_under_their_hashes(self):
        if not hasattr(self, "m"):
            return
        m = read(self.m)  # the manager and every live request read once, then the index
        seqs = list(self.live.values())
        indexed = []
        for seq, r in zip(seqs, read([s.req for s in seqs])):
            assert r.block_hashes == seq.want(), (
                f"{seq.id}'s block hashes are not the hash chain of its tokens"
            )
            assert ids(m.req_to_blocks[seq.id]) == seq.blocks, "a table changed outside allocate"
            assert len(seq.blocks) >= cdiv(seq.computed, BLOCK_SIZE), (
                f"{seq.id} computed {seq.computed} tokens but holds only "
                f"{len(seq.blocks)} block(s)"
            )
            assert_cached(m, r, seq.computed // BLOCK_SIZE)
            indexed += r.block_hashes[: seq.computed // BLOCK_SIZE]
        assert_indexed(self.m, indexed)


TestCacheManagerMachine = pytest.mark.points(3)(CacheManagerMachine.TestCase)
