"""Graded tests for lab 04-07: a cache-aware router.

Everything runs on token ids, blocks of 4 tokens. The hashes a router must produce are the
engine's own (a ``Request`` hashed by the engine's block hasher, here); the routing decisions are
compared with a model of the policy written out below from the contract (never from the lab's
code), on worked scenarios and on drawn streams of requests and completions.

Groups: task 1 (the chain of a prompt's full blocks), task 2 (the router's picture of a cache:
the leading match, the LRU order and bound), task 3 (the choice: affinity, the least loaded
when nobody matches, the load-balance threshold, and the chain rather than equal blocks).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.student_process import read
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens, sha256
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

lab = load_lab(__file__)

BS = 4


def engine_hashes(tokens: list[int]) -> list[bytes]:
    """The hashes the engine's prefix cache gives the prompt's full blocks."""
    if not tokens:
        return []
    request = Request("r", tokens, SamplingParams(), eos_token_id=None,
                      block_hasher=get_request_block_hasher(BS, sha256))
    return list(request.block_hashes)


def blocks(*fills: int) -> list[int]:
    """A prompt of whole blocks, block ``i`` made of token ``fills[i]``."""
    return [f for f in fills for _ in range(BS)]


def router(engines: int = 2, num_blocks: int = 64, threshold: int = 8):
    return lab.PrefixRouter(engines, block_size=BS, num_blocks=num_blocks,
                            balance_abs_threshold=threshold)


def cache_of(r, engine: int) -> list[bytes]:
    """The engine's remembered hashes, least recent first."""
    return list(read(r).caches[engine])


# ------------------------------------------------------------------------------------------
# A model of the policy, written from the contract
# ------------------------------------------------------------------------------------------


class Model:
    def __init__(self, engines: int, num_blocks: int, threshold: int):
        self.loads = [0] * engines
        self.caches = [OrderedDict() for _ in range(engines)]
        self.num_blocks, self.threshold = num_blocks, threshold

    def route(self, tokens: list[int]) -> int:
        hashes = engine_hashes(tokens)
        matched = []
        for cache in self.caches:
            n = 0
            while n < len(hashes) and hashes[n] in cache:
                n += 1
            matched.append(n)
        order = range(len(self.loads))
        best = sorted(order, key=lambda e: (-matched[e], self.loads[e], len(self.caches[e]), e))[0]
        least = sorted(order, key=lambda e: (self.loads[e], len(self.caches[e]), e))[0]
        if matched[best] == 0 or self.loads[best] - self.loads[least] > self.threshold:
            best = least
        cache = self.caches[best]
        for h in reversed(hashes):
            cache.pop(h, None)
            cache[h] = None
        while len(cache) > self.num_blocks:
            cache.popitem(last=False)
        self.loads[best] += 1
        return best

    def finished(self, engine: int) -> None:
        self.loads[engine] -= 1


# ------------------------------------------------------------------------------------------
# Task 1: the chain
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 9), max_size=23))
def test_the_hashes_are_the_engine_caches_names(tokens):
    got = lab.prompt_block_hashes(tokens, BS)
    want = engine_hashes(tokens)
    differ = " that differ" if len(got) == len(want) else ""
    assert list(got) == want, (
        f"a {len(tokens)}-token prompt: expected the {len(want)} hashes of its full blocks as the "
        f"engine names them, got {len(got)} hash(es){differ}")


@pytest.mark.points(1)
def test_equal_blocks_after_different_prefixes_hash_differently():
    first = lab.prompt_block_hashes(blocks(1, 7), BS)
    second = lab.prompt_block_hashes(blocks(2, 7), BS)
    assert first[1] != second[1], (
        "block 1 holds the same tokens in both prompts, but its KV depends on block 0: its hash "
        "must name its parent (the chain), not its tokens alone")
    assert first[1] == hash_block_tokens(sha256, first[0], blocks(7)), (
        "block 1's hash is hash_block_tokens(sha256, block 0's hash, its tokens)")


# ------------------------------------------------------------------------------------------
# Task 2: the router's picture of a cache
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_a_match_is_the_leading_run_of_the_chain():
    r = router()
    held = engine_hashes(blocks(1, 2, 3))
    r.remember(0, held)
    for prompt, want in [(blocks(1, 2, 3, 4), 3), (blocks(1, 2, 5), 2), (blocks(1), 1),
                         (blocks(9, 2, 3), 0), ([1, 1], 0)]:
        got = r.matched_blocks(0, engine_hashes(prompt))
        assert got == want, (f"engine 0 holds blocks 1, 2, 3; the prompt's blocks "
                             f"{prompt[::BS]}: expected a leading run of {want}, got {got}")
    assert r.matched_blocks(1, engine_hashes(blocks(1, 2, 3))) == 0, "engine 1 holds nothing"
    r.remember(1, [held[0], held[2]])  # a picture holding blocks 0 and 2 of the chain, not 1
    got = r.matched_blocks(1, held)
    assert got == 1, (f"engine 1 holds blocks 0 and 2 of the chain but not block 1: the run "
                      f"stops at the miss, 1 block; got {got}")


@pytest.mark.points(2)
def test_the_picture_is_an_lru_bounded_by_the_engines_blocks():
    r = router(num_blocks=4)
    a, b = engine_hashes(blocks(1, 2, 3)), engine_hashes(blocks(1, 5))
    r.remember(0, a)
    assert cache_of(r, 0) == [a[2], a[1], a[0]], (
        "the prompt's hashes go in from the last to the first: its first block is the most "
        "recent (least recent first: block 2, block 1, block 0)")
    r.remember(0, b)  # block 0 is shared: it moves; block "5" is new; 4 entries
    assert cache_of(r, 0) == [a[2], a[1], b[1], b[0]], (
        "a hash remembered again moves to the most recent end")
    c = engine_hashes(blocks(6, 7))
    r.remember(0, c)  # 6 entries for 4 places: the two least recent go
    assert cache_of(r, 0) == [b[1], b[0], c[1], c[0]], (
        "past num_blocks the least recent entries are dropped, down to num_blocks")
    assert cache_of(r, 1) == [], "engine 1's picture is untouched"


# ------------------------------------------------------------------------------------------
# Task 3: the choice
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_prompts_sharing_a_system_prompt_stay_together_and_new_ones_spread():
    r = router()
    first = r.route(blocks(1, 2, 9))  # nobody matches: the least loaded, the lower index
    other = r.route(blocks(5, 6, 7))  # nobody matches: engine 1 is less loaded now
    again = r.route(blocks(1, 2, 8))  # matches engine 0's first two blocks
    assert (first, other, again) == (0, 1, 0), (
        f"expected engines (0, 1, 0): a new prompt to the least loaded, a prompt sharing a "
        f"system prompt to where it is; got {(first, other, again)}")
    assert list(read(r).loads) == [2, 1], "each routed request counts on its engine"


@pytest.mark.points(2)
def test_the_least_loaded_takes_over_past_the_threshold():
    r = router(threshold=2)
    assert r.route(blocks(1, 2)) == 0, "nobody matches: the least loaded, the lower index"
    for _ in range(2):  # engine 0 holds the prefix and takes these while within the threshold
        assert r.route(blocks(1, 2, 3)) == 0, (
            "engine 0 holds the prefix and is at most 2 requests busier than engine 1")
    # engine 0 has 3 outstanding, engine 1 none: 3 - 0 > 2, so engine 1 takes it.
    assert r.route(blocks(1, 2, 4)) == 1, "past the threshold the least loaded engine takes it"
    r.finished(0)  # engine 0: 2 outstanding, engine 1: 1: within the threshold
    assert r.route(blocks(1, 2, 5)) == 1, (
        "both engines now hold the prefix (two blocks each): the tie goes to the less loaded, "
        "engine 1")
    r.finished(0)
    r.finished(0)  # engine 0: none outstanding, engine 1: 2
    assert r.route(blocks(1, 2, 6)) == 0, (
        "both engines hold the prefix; the tie goes to the less loaded, engine 0")


@pytest.mark.points(1)
def test_a_full_tie_goes_to_the_lower_index():
    r = router(threshold=0)
    prompt = blocks(3, 4, 5)
    got = [r.route(prompt), r.route(prompt)]  # the second: engine 0 is busier by 1 > 0
    assert got == [0, 1], f"set-up: expected engines [0, 1]; got {got}"
    got = r.route(prompt)
    assert got == 0, (
        "both engines hold the prompt, have one request each and remember as many blocks: the "
        f"lower index takes it; got engine {got}")


@pytest.mark.points(2)
def test_equal_blocks_after_another_prefix_are_no_match():
    """Engine 0 holds blocks (1, 7), and (5, 9) as a chain; the last prompt is (5, 7): its block
    "7" follows "5" here, not "1", so engine 0 matches one block, as engine 1 does, and the tie
    goes to engine 1 (fewer remembered blocks). A router hashing each block's tokens alone would
    see two matching blocks on engine 0."""
    r = router(threshold=0)
    route = [r.route(blocks(1, 7)), r.route(blocks(5, 8)), r.route(blocks(5, 6)),
             r.route(blocks(5, 9))]
    assert route == [0, 1, 1, 0], (
        f"set-up: expected engines [0, 1, 1, 0] (the last one past the threshold of 0); got "
        f"{route}")
    got = r.route(blocks(5, 7))
    assert got == 1, (
        "blocks (5, 7): engine 0 holds '7' only after '1', which is no match past block 0; both "
        "engines match one block, and the tie goes to engine 1 (same load, fewer blocks); got "
        f"engine {got}")


@pytest.mark.points(3)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_drawn_stream_of_requests_and_completions(data):
    engines = data.draw(st.integers(2, 3), label="engines")
    num_blocks = data.draw(st.integers(2, 8), label="num_blocks")
    threshold = data.draw(st.integers(0, 3), label="threshold")
    r, model = router(engines, num_blocks, threshold), Model(engines, num_blocks, threshold)
    prefix = st.lists(st.integers(0, 3), min_size=0, max_size=4)
    for step in range(data.draw(st.integers(1, 25), label="events")):
        busy = [e for e in range(engines) if model.loads[e]]
        if busy and data.draw(st.booleans(), label="a completion"):
            e = data.draw(st.sampled_from(busy), label="engine")
            r.finished(e)
            model.finished(e)
            continue
        prompt = blocks(*data.draw(prefix, label="blocks")) + data.draw(
            st.lists(st.integers(0, 3), max_size=3), label="tail")
        want, got = model.route(prompt), r.route(prompt)
        assert got == want, (f"event {step}: the prompt with blocks {prompt[::BS]} went to "
                             f"engine {got}; the policy sends it to {want} (loads before: "
                             f"{[x - (i == want) for i, x in enumerate(model.loads)]})")
    assert list(read(r).loads) == model.loads, "the outstanding requests per engine"
