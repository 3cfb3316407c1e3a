"""Graded tests for lab 02-05: sharing blocks with fork and copy-on-write.

Two yardsticks. The first is a token-level model of the KV cache (``Sim``): every write puts a
token id into ``store[block][offset]``, every ``(src, dst)`` copy the manager returns is applied
to the store, and after every step each live request must read back exactly its own tokens
through its block table, no request may write a block that another table holds, and every
block's ``ref_cnt`` must equal the number of tables that list it. The second is numeric: paged
attention over forked sequences, run on real cache tensors with ``copy_blocks``, must equal
plain attention over each sequence's own keys and values.

Task by task: the tests of ``fork`` use only ``fork`` (and the given manager); those of
``_get_blocks_to_copy_on_write`` and ``_copy_on_write`` call them directly after a fork; the
rest go through ``append_slots`` (`python scripts/task_by_task.py 02-05` checks it).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from course.labs.student_process import beside_the_student, read
from mini_vllm.attention.reference import ref_attention

lab = load_lab(__file__)

BS = 4  # block size of every test: small, so prompts span several blocks and end mid-block


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_manager(num_blocks: int = 16, *, caching: bool = True, max_model_len: int = 256):
    return lab.KVCacheManager(num_blocks, BS, max_model_len, enable_caching=caching)


def make_request(request_id: str, prompt: list[int]):
    return lab.Request(
        request_id, list(prompt), lab.SamplingParams(), eos_token_id=None,
        block_hasher=lab.get_request_block_hasher(BS, lab.sha256),
    )


def request_maker():
    """``make_request`` with the lab's names looked up once: where the lab has its own process,
    each lookup and call is a round trip, and a simulation makes hundreds of requests (the
    hasher reads the request it hashes and keeps nothing, so one serves them all)."""
    request, params = lab.Request, lab.SamplingParams()
    hasher = lab.get_request_block_hasher(BS, lab.sha256)
    return lambda request_id, prompt: request(request_id, list(prompt), params,
                                              eos_token_id=None, block_hasher=hasher)


def make_child(parent, child_id: str, next_token: int):
    """A copy of ``parent`` up to its computed tokens, which then sampled ``next_token``."""
    n = parent.num_computed_tokens
    tokens = list(parent.all_token_ids[:n])
    child = make_request(child_id, tokens[: parent.num_prompt_tokens])
    child.append_output_token_ids(tokens[parent.num_prompt_tokens :] + [next_token])
    child.num_computed_tokens = n
    return child


@beside_the_student
def same_table_object(mgr, a: str, b: str) -> bool:
    """Whether two requests' req_to_blocks entries are one list object: asked where the manager
    runs (a list read from there is a copy, never the same object as another)."""
    return mgr.req_to_blocks[a] is mgr.req_to_blocks[b]


def table(mgr, request_id: str) -> list[int]:
    return list(mgr.get_block_ids(request_id)[0])


def snapshot(mgr):
    """Everything a failed call must leave unchanged."""
    m = read(mgr)  # the whole manager in one read, where the lab has its process
    return (
        {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()},
        dict(m.num_cached_block),
        [b.ref_cnt for b in m.block_pool.blocks],
        m.block_pool.free_block_queue.num_free_blocks,
    )


SNAPSHOT_PARTS = ("block tables", "num_cached_block", "ref_cnt of every block", "free blocks")


def assert_unchanged(mgr, before, call: str) -> None:
    """``call`` (refused, or raising) left the manager as ``before``: names what it changed."""
    now = snapshot(mgr)
    for part, old, new in zip(SNAPSHOT_PARTS, before, now):
        assert old == new, (
            f"{call} must change nothing, but it changed the {part}: before {old}, after {new}"
        )


def ref_counts(mgr, block_ids) -> list[int]:
    return [mgr.block_pool.blocks[b].ref_cnt for b in block_ids]


class Sim:
    """A KV cache manager, its live requests, and a token-level model of the cache contents.

    The requests' tokens and computed counts are kept here too (as the scheduler knows them), and
    the manager is read whole once a step (`read`): where the lab has its own process, each
    attribute of the manager or a request asked one by one would be a round trip."""

    def __init__(self, num_blocks: int = 16, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.mgr = make_manager(num_blocks, caching=caching)
        self.live: dict[str, object] = {}
        self.rid: dict[int, str] = {}  # id(request) -> its request id
        self.prompt_len: dict[str, int] = {}  # every live request's prompt length,
        self.tokens: dict[str, list[int]] = {}  # its tokens
        self.computed: dict[str, int] = {}  # and how many of them are computed
        self.store: dict[int, list[int | None]] = {}
        self.next_id = 0
        self.make_request = request_maker()

    def fresh_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def tables(self) -> dict[str, list[int]]:
        """Every live request's block ids, from one read of the manager."""
        held = read(self.mgr).req_to_blocks
        return {rid: [b.block_id for b in held[rid]] for rid in self.live}

    def write(self, rid: str, start: int, end: int) -> None:
        """The model writes the KV of tokens [start, end) of ``rid`` through its block table."""
        tables = self.tables()
        ids = tables[rid]
        for pos in range(start, end):
            block = ids[pos // BS]
            holders = [other for other, held in tables.items() if block in held]
            assert holders == [rid], (
                f"{rid} writes token {pos} into block {block}, which is also held by "
                f"{[h for h in holders if h != rid]}: that block needed copy-on-write"
            )
            self.store.setdefault(block, [None] * BS)[pos % BS] = self.tokens[rid][pos]

    def apply_copies(self, copies) -> None:
        """What the runner's copy_blocks does to the cache, on the token model."""
        for src, dst in copies:
            self.store[dst] = list(self.store.get(src, [None] * BS))

    def _sampled(self, req, rid: str, next_token: int) -> None:
        req.append_output_token_ids(next_token)
        self.tokens[rid].append(next_token)

    def admit(self, prompt: list[int], next_token: int):
        rid = self.fresh_id()
        req = self.make_request(rid, prompt)
        hit_blocks, num_hit = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, len(prompt) - num_hit, num_hit, hit_blocks) is None:
            return None
        self.live[rid], self.rid[id(req)] = req, rid
        self.tokens[rid], self.prompt_len[rid] = list(prompt), len(prompt)
        req.num_computed_tokens = self.computed[rid] = len(prompt)
        self._sampled(req, rid, next_token)
        # Written after the request's own updates, which leave the manager as it is: the read
        # of the manager this takes then serves the step's checks too (see `step`).
        self.write(rid, num_hit, len(prompt))
        return req

    def fork(self, parent, next_token: int):
        rid, pid = self.fresh_id(), self.rid[id(parent)]
        # make_child, from what is kept here: a copy of the parent up to its computed tokens
        tokens, n = self.tokens[pid][: self.computed[pid]], self.computed[pid]
        child = self.make_request(rid, tokens[: self.prompt_len[pid]])
        child.append_output_token_ids(tokens[self.prompt_len[pid] :] + [next_token])
        child.num_computed_tokens = n
        self.mgr.fork(parent, child)
        self.live[rid], self.rid[id(child)] = child, rid
        self.tokens[rid], self.prompt_len[rid] = tokens + [next_token], self.prompt_len[pid]
        self.computed[rid] = n
        return child

    def needed(self, rid: str, num_new_tokens: int = 1) -> int:
        """Blocks append_slots must take, counted here: copies of shared blocks from the one
        the step writes first, plus new blocks."""
        m = read(self.mgr)
        held = m.req_to_blocks[rid]
        first = self.computed[rid] // BS
        shared = sum(1 for b in held[first:] if b.ref_cnt > 1)
        slots = min(self.computed[rid] + num_new_tokens, m.max_model_len)
        return shared + max(0, -(-slots // BS) - len(held))

    def step(self, req, next_token: int):
        """One decode step: make room (copying shared blocks), write the token, sample."""
        rid = self.rid[id(req)]
        before = snapshot(self.mgr)
        need, free = self.needed(rid), before[-1]
        copies = self.mgr.append_slots(req, 1)
        if copies is None:
            assert need > free, f"append_slots refused although {need} block(s) of {free} free"
            assert snapshot(self.mgr) == before, "a refused append_slots changed something"
            return None
        assert need <= free, f"append_slots succeeded although {need} block(s) of {free} free"
        self.apply_copies(copies)
        pos = self.computed[rid]
        req.num_computed_tokens = self.computed[rid] = pos + 1
        self._sampled(req, rid, next_token)
        # After the request's updates: the manager is read once, here, and that read serves
        # the checks after this step and the snapshot before the next (nothing asked between).
        self.write(rid, pos, pos + 1)
        return copies

    def finish(self, req) -> None:
        self.mgr.free(req)
        rid = self.rid.pop(id(req))
        del self.live[rid], self.tokens[rid], self.computed[rid], self.prompt_len[rid]

    # -- checks ---------------------------------------------------------------------------

    def check_reads(self) -> None:
        for rid, ids in self.tables().items():
            tokens = self.tokens[rid]
            for pos in range(self.computed[rid]):
                got = self.store.get(ids[pos // BS], [None] * BS)[pos % BS]
                assert got == tokens[pos], (
                    f"{rid} reads token {pos} from block {ids[pos // BS]} and finds {got}, not "
                    f"its own token {tokens[pos]}: a shared block was overwritten or "
                    f"a copy went the wrong way"
                )

    def check_counts(self) -> None:
        held = Counter(b for ids in self.tables().values() for b in ids)
        for block in read(self.mgr).block_pool.blocks[1:]:
            assert block.ref_cnt == held[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {held[block.block_id]} "
                f"block table(s) list it"
            )
        free = read(self.mgr).block_pool.free_block_queue.num_free_blocks
        assert free == self.num_blocks - 1 - len(held), (
            f"{free} blocks are free, but {len(held)} of {self.num_blocks - 1} are held"
        )


# ---------------------------------------------------------------------------------------------
# task 1: fork
# ---------------------------------------------------------------------------------------------


def test_fork_shares_every_block_and_counts_it():
    mgr = make_manager()
    parent = make_request("p", list(range(10)))  # 10 tokens: blocks of 4, 4, 2
    assert mgr.allocate_slots(parent, 10) is not None, "the given allocate_slots refused 10 tokens"
    parent.num_computed_tokens = 10
    parent.append_output_token_ids(7)
    free_before = mgr.block_pool.get_num_free_blocks()

    child = make_child(parent, "c", 8)
    mgr.fork(parent, child)

    assert table(mgr, "c") == table(mgr, "p"), (
        f"fork: the child's table {table(mgr, 'c')} must list the parent's blocks "
        f"{table(mgr, 'p')}, in order"
    )
    counts = ref_counts(mgr, table(mgr, "p"))
    assert counts == [2, 2, 2], (
        f"fork: each shared block is held by 2 tables (parent, child), so its ref_cnt is 2; "
        f"got {counts} (touch the parent's blocks)"
    )
    free = mgr.block_pool.get_num_free_blocks()
    assert free == free_before, f"fork must not take blocks: {free_before} free, then {free}"
    assert mgr.num_cached_block["c"] == mgr.num_cached_block["p"], (
        f"fork: the child has the parent's cached blocks, num_cached_block "
        f"{mgr.num_cached_block['p']}; got {mgr.num_cached_block['c']}"
    )
    # The child's table is its own list: replacing an entry of one never changes the other.
    assert not same_table_object(mgr, "c", "p", beside=lab), (
        "fork: the child's req_to_blocks entry is the parent's list object; give it a copy "
        "(copy-on-write later replaces entries of one table only)"
    )


def test_fork_of_a_fork_counts_three_holders():
    sim = Sim()
    parent = sim.admit([1, 2, 3, 4, 5, 6], 9)
    child = sim.fork(parent, 10)
    grandchild = sim.fork(child, 11)
    assert table(sim.mgr, grandchild.request_id) == table(sim.mgr, parent.request_id), (
        "fork of a fork: the grandchild's table must list the same blocks as the parent's"
    )
    sim.check_counts()
    counts = ref_counts(sim.mgr, table(sim.mgr, parent.request_id))
    assert set(counts) == {3}, f"fork of a fork: 3 tables hold each block, ref_cnts are {counts}"


def _prefilled(mgr, prompt, *, lookahead=0, salt=None):
    req = lab.Request(
        f"p{len(mgr.req_to_blocks)}", list(prompt), lab.SamplingParams(), eos_token_id=None,
        cache_salt=salt, block_hasher=lab.get_request_block_hasher(BS, lab.sha256),
    )
    assert mgr.allocate_slots(req, len(prompt), num_lookahead_tokens=lookahead) is not None, (
        f"the given allocate_slots refused a prompt of {len(prompt)} tokens"
    )
    req.num_computed_tokens = len(prompt)
    req.append_output_token_ids(9)
    return req


def test_fork_refuses_a_parent_whose_cached_blocks_run_ahead():
    mgr = make_manager()
    parent = make_request("p", list(range(8)))
    # caches 2 blocks; computed still 0
    assert mgr.allocate_slots(parent, 8) is not None, "the given allocate_slots refused 8 tokens"
    assert (mgr.num_cached_block["p"], parent.num_computed_tokens) == (2, 0), (
        "set-up: the given allocate_slots caches 2 full blocks before any is computed"
    )
    child = make_request("c", list(range(8)))  # the same tokens, 0 of them computed
    before = snapshot(mgr)
    with pytest.raises(ValueError):
        mgr.fork(parent, child)
    assert_unchanged(mgr, before, "fork of a parent with 8 cached tokens and 0 computed")
    parent.num_computed_tokens = child.num_computed_tokens = 4  # half-way: 8 cached, 4 computed
    with pytest.raises(ValueError):
        mgr.fork(parent, child)
    assert_unchanged(mgr, before, "fork of a parent with 8 cached tokens and 4 computed")
    parent.num_computed_tokens = child.num_computed_tokens = 8  # after the step: fine
    mgr.fork(parent, child)
    assert table(mgr, "c") == table(mgr, "p"), (
        "fork after the step that computed the cached blocks must share the parent's table"
    )


@pytest.mark.parametrize("caching", [True, False])
def test_fork_compares_block_hashes_only_with_caching_on(caching):
    mgr = make_manager(caching=caching)
    parent = _prefilled(mgr, list(range(10)))
    child = lab.Request(
        "salted", list(range(10)), lab.SamplingParams(), eos_token_id=None, cache_salt="other",
        block_hasher=lab.get_request_block_hasher(BS, lab.sha256),
    )
    child.append_output_token_ids(9)
    child.num_computed_tokens = 10
    before = snapshot(mgr)
    if caching:
        with pytest.raises(ValueError):
            mgr.fork(parent, child)
        assert_unchanged(mgr, before, "fork of a child whose block hashes differ")
    else:
        mgr.fork(parent, child)
        assert table(mgr, "salted") == table(mgr, parent.request_id), (
            "fork without prefix caching ignores block hashes: the child shares the table"
        )


# ---------------------------------------------------------------------------------------------
# task 2: which positions need a copy
# ---------------------------------------------------------------------------------------------


def test_positions_to_copy_after_a_fork():
    mgr = make_manager()
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6])  # [1 2 3 4] [5 6 . .]
    assert mgr._get_blocks_to_copy_on_write(parent) == [], "nothing is shared yet"
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    before = snapshot(mgr)
    assert mgr._get_blocks_to_copy_on_write(child) == [1], (
        "6 computed tokens: the next write lands in block 1 (6 // 4), the partial block the "
        "child shares with its parent, so position 1 needs a copy"
    )
    assert mgr._get_blocks_to_copy_on_write(parent) == [1], (
        "the parent's partial block is shared with the child too: position 1 needs a copy"
    )
    assert_unchanged(mgr, before, "_get_blocks_to_copy_on_write (it only looks)")
    boundary = _prefilled(mgr, [7, 7, 7, 7, 8, 8, 8, 8])
    mgr.fork(boundary, make_child(boundary, "b", 1))
    assert mgr._get_blocks_to_copy_on_write(boundary) == [], "full blocks are never written"


def test_positions_to_copy_include_shared_lookahead_blocks():
    mgr = make_manager()
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6], lookahead=6)  # 3 blocks for 12 slots
    assert len(table(mgr, parent.request_id)) == 3, "set-up: 6 tokens + 6 lookahead = 3 blocks"
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    assert mgr._get_blocks_to_copy_on_write(child) == [1, 2], (
        "6 computed tokens: the next write lands in block 1; block 2 (lookahead) is written "
        "later and is shared too, so both positions need a copy"
    )
    child.num_computed_tokens = 8  # as if it had written tokens 6 and 7 in place
    assert mgr._get_blocks_to_copy_on_write(child) == [2], (
        "8 computed tokens: the next write starts at block 2 (8 // 4); block 1 is full"
    )


def test_positions_to_copy_follow_the_reference_counts():
    mgr = make_manager()
    parent = _prefilled(mgr, [1, 2, 3, 4, 5])
    kids = [make_child(parent, f"k{i}", i) for i in range(2)]
    for kid in kids:
        mgr.fork(parent, kid)
    positions = [mgr._get_blocks_to_copy_on_write(r) for r in (parent, *kids)]
    assert positions == [[1], [1], [1]], (
        f"3 tables hold the partial block 1: parent and both children must copy it; got "
        f"{positions} for (parent, child 0, child 1)"
    )
    mgr.free(kids[0])
    mgr.free(kids[1])
    assert mgr._get_blocks_to_copy_on_write(parent) == [], "the last holder writes in place"


# ---------------------------------------------------------------------------------------------
# task 3: the copy itself
# ---------------------------------------------------------------------------------------------


def test_copy_on_write_replaces_only_the_writers_block():
    mgr = make_manager()
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6])
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    shared = table(mgr, "c")[1]
    front = mgr.block_pool.free_block_queue.get_all_free_blocks()[0].block_id
    free_before = mgr.block_pool.get_num_free_blocks()
    before = snapshot(mgr)
    copies = mgr._copy_on_write("c", [])
    assert copies == [], f"_copy_on_write of no positions copies nothing, got {copies}"
    assert_unchanged(mgr, before, "_copy_on_write of no positions")
    copies = mgr._copy_on_write("c", [1])
    assert copies == [(shared, front)], (
        f"one (src, dst) pair: the shared block {shared} into the free queue's front block "
        f"{front}; got {copies}"
    )
    expected = [table(mgr, parent.request_id)[0], front]
    assert table(mgr, "c") == expected, (
        f"the writer's table must get the fresh block at position 1: expected {expected}, "
        f"got {table(mgr, 'c')}"
    )
    assert table(mgr, parent.request_id)[1] == shared, (
        f"the other holder keeps block {shared}; the parent's table is now "
        f"{table(mgr, parent.request_id)}"
    )
    blocks = mgr.block_pool.blocks
    assert (blocks[shared].ref_cnt, blocks[front].ref_cnt) == (1, 1), (
        f"after the copy the shared block {shared} has one holder fewer (the parent only: "
        f"ref_cnt 1) and the fresh block {front} one holder (ref_cnt 1); got ref_cnt "
        f"{blocks[shared].ref_cnt} and {blocks[front].ref_cnt} (free the writer's reference "
        f"to the shared block)"
    )
    assert blocks[table(mgr, "c")[0]].ref_cnt == 2, "unwritten positions stay shared"
    free = mgr.block_pool.get_num_free_blocks()
    assert free == free_before - 1, (
        f"one copy takes exactly one free block: {free_before} free before, {free} after"
    )


def test_copy_on_write_of_several_positions_pairs_them_in_order():
    mgr = make_manager()
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6], lookahead=6)
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    shared = table(mgr, "c")[1:]
    front = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()[:2]]
    copies = mgr._copy_on_write("c", [1, 2])
    assert copies == list(zip(shared, front)), (
        f"positions [1, 2] pair with the free queue's first two blocks in order: expected "
        f"{list(zip(shared, front))}, got {copies}"
    )
    assert table(mgr, "c")[1:] == front, f"the child's table must end in {front}: {table(mgr, 'c')}"
    assert table(mgr, parent.request_id)[1:] == shared, (
        f"the parent's table must still end in {shared}: {table(mgr, parent.request_id)}"
    )
    counts = ref_counts(mgr, shared + front)
    assert counts == [1, 1, 1, 1], (
        f"after both copies each old and each fresh block has one holder; ref_cnt of "
        f"{shared + front} is {counts}"
    )


# ---------------------------------------------------------------------------------------------
# task 4: copy-on-write through append_slots
# ---------------------------------------------------------------------------------------------


def test_writing_into_a_shared_partial_block_copies_it():
    sim = Sim()
    parent = sim.admit([1, 2, 3, 4, 5, 6], 9)  # blocks: [1 2 3 4] [5 6 . .]
    child = sim.fork(parent, 10)
    shared_tail = table(sim.mgr, parent.request_id)[-1]
    free_before = sim.mgr.block_pool.get_num_free_blocks()

    copies = sim.step(child, 20)

    assert copies is not None and len(copies) == 1, (
        f"append_slots into the shared partial block {shared_tail} must return one "
        f"(src, dst) copy; got {copies}"
    )
    src, dst = copies[0]
    assert src == shared_tail, f"the source of the copy is the shared block {shared_tail}: {src}"
    child_table = table(sim.mgr, child.request_id)
    assert dst != shared_tail and child_table[-1] == dst, (
        f"the copy's destination {dst} must be a fresh block, now last in the child's table "
        f"{child_table}"
    )
    assert table(sim.mgr, parent.request_id)[-1] == shared_tail, "the parent keeps its block"
    assert sim.mgr.block_pool.blocks[shared_tail].ref_cnt == 1, "the old block lost one holder"
    assert sim.mgr.block_pool.blocks[dst].ref_cnt == 1, (
        f"the fresh block {dst} has one holder, ref_cnt {sim.mgr.block_pool.blocks[dst].ref_cnt}"
    )
    free = sim.mgr.block_pool.get_num_free_blocks()
    assert free == free_before - 1, (
        f"one copy takes exactly one free block: {free_before} free before, {free} after"
    )
    # The first full block is still shared: it is never written again.
    assert child_table[0] == table(sim.mgr, parent.request_id)[0], (
        "the first (full) block is never written again, so it stays shared, not copied"
    )
    # The parent is now the block's only holder: it writes in place, no copy.
    copies = sim.step(parent, 21)
    assert copies == [], f"the block's last holder writes in place (no copy); got {copies}"
    sim.check_reads()
    sim.check_counts()


def test_copy_on_write_with_three_holders():
    sim = Sim()
    parent = sim.admit([1, 2, 3, 4, 5], 9)
    kids = [sim.fork(parent, 10 + i) for i in range(2)]
    tail = table(sim.mgr, parent.request_id)[-1]
    assert sim.mgr.block_pool.blocks[tail].ref_cnt == 3, "fork: 3 tables hold the tail block"
    for expected_count, req in ((2, kids[0]), (1, kids[1])):
        copies = sim.step(req, 30)
        assert copies is not None and [c[0] for c in copies] == [tail], (
            f"{req.request_id} writes into the tail block {tail} that others hold: one copy "
            f"from it; got {copies}"
        )
        count = sim.mgr.block_pool.blocks[tail].ref_cnt
        assert count == expected_count, (
            f"each copy drops one holder of block {tail}: ref_cnt {expected_count} expected "
            f"after {req.request_id}'s copy, got {count}"
        )
    assert sim.step(parent, 31) == [], "the last holder writes in place"
    sim.check_reads()
    sim.check_counts()


def test_no_copy_at_a_block_boundary():
    sim = Sim()
    parent = sim.admit([1, 2, 3, 4, 5, 6, 7, 8], 9)  # two full blocks: nothing partial to share
    child = sim.fork(parent, 10)
    free_before = sim.mgr.block_pool.get_num_free_blocks()
    copies = sim.step(child, 11)
    assert copies == [], (
        f"after two full blocks the next token starts a new block: no shared block is written, "
        f"no copy; got {copies}"
    )
    assert sim.mgr.block_pool.get_num_free_blocks() == free_before - 1, "one new block, no copy"
    assert table(sim.mgr, child.request_id)[:2] == table(sim.mgr, parent.request_id)[:2], (
        "full blocks stay shared"
    )
    sim.check_reads()
    sim.check_counts()


def test_prefix_cache_sharing_never_copies():
    """Blocks shared through a prefix-cache hit are full and never written: no copy-on-write."""
    sim = Sim()
    a = sim.admit([1, 2, 3, 4, 5, 6, 7, 8, 9], 50)
    b = sim.admit([1, 2, 3, 4, 5, 6, 7, 8, 9], 51)
    assert table(sim.mgr, a.request_id)[:2] == table(sim.mgr, b.request_id)[:2], "a cache hit"
    for _ in range(6):
        for req, token in ((a, 52), (b, 53)):
            copies = sim.step(req, token)
            assert copies == [], (
                f"{req.request_id} shares only full cached blocks, which are never written: "
                f"no copy, got {copies}"
            )
    sim.check_reads()
    sim.check_counts()


def test_counts_return_to_zero_when_all_finish():
    rng = random.Random(5)
    sim = Sim(num_blocks=40)
    root = sim.admit([1, 2, 3, 4, 5, 6, 7], 0)
    family = [root]
    for step in range(12):
        for req in list(family):
            copies = sim.step(req, rng.randrange(100))
            assert copies is not None, (
                f"append_slots refused {req.request_id} at step {step} with "
                f"{sim.mgr.block_pool.get_num_free_blocks()} of 39 blocks free"
            )
        if step % 3 == 0:
            family.append(sim.fork(rng.choice(family), rng.randrange(100)))
        sim.check_reads()
        sim.check_counts()
    rng.shuffle(family)
    for req in family:  # any order: parents before children or after
        sim.finish(req)
        sim.check_reads()
        sim.check_counts()
    blocks = sim.mgr.block_pool.blocks
    held = {b.block_id: b.ref_cnt for b in blocks[1:] if b.ref_cnt}
    assert not held, f"every block must be back at ref_cnt 0 when all finish; still held: {held}"
    free = sim.mgr.block_pool.get_num_free_blocks()
    assert free == sim.num_blocks - 1, f"all {sim.num_blocks - 1} blocks free again, got {free}"
    assert sim.mgr.req_to_blocks == {}, (
        f"free() of every request leaves no block table; left: {sorted(sim.mgr.req_to_blocks)}"
    )


def test_freeing_the_parent_first_keeps_the_children_going():
    sim = Sim()
    parent = sim.admit([1, 2, 3, 4, 5, 6], 9)
    kids = [sim.fork(parent, 10 + i) for i in range(2)]
    parent_blocks = table(sim.mgr, parent.request_id)
    sim.finish(parent)
    for b in parent_blocks:
        assert sim.mgr.block_pool.blocks[b].ref_cnt == 2, "the two children still hold it"
    sim.check_counts()
    for _ in range(5):
        for kid in kids:
            assert sim.step(kid, 40) is not None, (
                f"append_slots refused {kid.request_id} with "
                f"{sim.mgr.block_pool.get_num_free_blocks()} blocks free"
            )
    sim.check_reads()
    sim.check_counts()


# ---------------------------------------------------------------------------------------------
# bad input: a clear error, nothing changed
# ---------------------------------------------------------------------------------------------


def _forkable():
    mgr = make_manager()
    parent = make_request("p", [1, 2, 3, 4, 5, 6])
    assert mgr.allocate_slots(parent, 6) is not None, "the given allocate_slots refused 6 tokens"
    parent.num_computed_tokens = 6
    parent.append_output_token_ids(9)
    other = make_request("q", [7, 7, 7])
    assert mgr.allocate_slots(other, 3) is not None, "the given allocate_slots refused 3 tokens"
    other.num_computed_tokens = 3
    return mgr, parent


def test_fork_an_unknown_parent_is_an_error():
    mgr, _ = _forkable()
    stranger = make_request("x", [1, 2, 3])
    stranger.num_computed_tokens = 3
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="x"):
        mgr.fork(stranger, make_child(stranger, "c", 1))
    assert_unchanged(mgr, before, "fork of an unknown parent")


@pytest.mark.parametrize("child_id", ["q", "p"])
def test_fork_into_an_id_in_use_is_an_error(child_id):
    mgr, parent = _forkable()
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="already in use"):
        mgr.fork(parent, make_child(parent, child_id, 1))
    assert_unchanged(mgr, before, f"fork into the id {child_id!r} in use")


def test_fork_a_child_that_differs_is_an_error():
    mgr, parent = _forkable()
    before = snapshot(mgr)
    wrong_tokens = make_request("c", [1, 2, 3, 4, 5, 0])  # last computed token differs
    wrong_tokens.num_computed_tokens = 6
    behind = make_child(parent, "d", 1)
    behind.num_computed_tokens = 5
    for child in (wrong_tokens, behind):
        with pytest.raises(ValueError, match="fork"):
            mgr.fork(parent, child)
        assert_unchanged(mgr, before, f"fork of a child ({child.request_id}) that differs")


def test_append_slots_bad_input_is_an_error():
    mgr, parent = _forkable()
    mgr.fork(parent, make_child(parent, "c", 1))  # a shared tail: a copy would be due
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="holds no blocks"):
        mgr.append_slots(make_request("x", [1]), 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.append_slots(parent, 0)
    with pytest.raises(ValueError):
        mgr.append_slots(parent, 1, num_lookahead_tokens=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.append_slots(parent, 300)
    assert_unchanged(mgr, before, "append_slots with bad input")
    bare = lab.Request("bare", [1, 2, 3, 4, 5], lab.SamplingParams(), eos_token_id=None)
    # no hashes
    assert mgr.allocate_slots(bare, 5, delay_cache_blocks=True) is not None, (
        "the given allocate_slots refused 5 tokens"
    )
    bare.num_computed_tokens = 5
    twin = lab.Request("bare2", [1, 2, 3, 4, 5], lab.SamplingParams(), None)
    twin.num_computed_tokens = 5
    mgr.fork(bare, twin)
    before = snapshot(mgr)
    with pytest.raises(ValueError):
        mgr.append_slots(bare, 1)  # its hashes do not match its tokens: before any copy
    assert_unchanged(mgr, before, "append_slots of a request whose hashes do not match")


def test_append_slots_that_fits_exactly():
    sim = Sim(num_blocks=5)  # 4 usable blocks
    parent = sim.admit([1, 2, 3, 4, 5, 6], 9)  # 2 blocks, the second partial
    child = sim.fork(parent, 10)
    sim.mgr.block_pool.get_new_blocks(1)  # somebody else holds one: 1 free
    copies = sim.mgr.append_slots(child, 1)
    assert copies is not None and len(copies) == 1, (
        f"one copy, one free block: it fits, so append_slots returns one copy; got {copies}"
    )
    free = sim.mgr.block_pool.get_num_free_blocks()
    assert free == 0, f"the copy takes the one free block; {free} left"


def test_append_slots_up_to_exactly_max_model_len():
    mgr = make_manager(max_model_len=12)
    parent = _prefilled(mgr, list(range(10)))  # blocks of 4, 4, 2
    mgr.fork(parent, make_child(parent, "c", 1))
    copies = mgr.append_slots(parent, 2, num_lookahead_tokens=3)  # 12 tokens: exactly the limit
    assert copies is not None and len(copies) == 1, (
        f"12 tokens of max_model_len=12 fit: one copy of the shared tail expected, got {copies}"
    )
    held = table(mgr, parent.request_id)
    assert len(held) == 3, f"lookahead slots stop at max_model_len: 3 blocks, got {held}"


@pytest.mark.parametrize("num_blocks", [5, 6])
def test_append_slots_reserves_lookahead_slots(num_blocks):
    """With lookahead the step needs slots for num_computed + num_new + lookahead tokens: the
    refusal counts those blocks too (before any copy), and a success holds them."""
    mgr = make_manager(num_blocks=num_blocks)  # 4 or 5 usable blocks
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6])  # 2 blocks, the second shared after the fork
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    # 7 tokens + 6 lookahead = 13 slots = 4 blocks: 2 new blocks plus 1 copy = 3 blocks.
    before = snapshot(mgr)
    copies = mgr.append_slots(child, 1, num_lookahead_tokens=6)
    if num_blocks == 5:  # 2 free
        assert copies is None, (
            f"1 copy + 2 lookahead blocks need 3 free blocks, 2 are free: append_slots must "
            f"return None, got {copies}"
        )
        assert_unchanged(mgr, before, "a refused append_slots")
        # Without lookahead the same step fits: 1 copy, no new block, 2 free.
        copies = mgr.append_slots(child, 1)
        assert copies is not None and len(copies) == 1, (
            f"without lookahead the step needs 1 copy and 2 blocks are free: one copy "
            f"expected after the refusal, got {copies}"
        )
        assert table(mgr, "c")[1] != table(mgr, parent.request_id)[1], (
            f"after the copy the child writes its own block 1: tables {table(mgr, 'c')} "
            f"(child) and {table(mgr, parent.request_id)} (parent)"
        )
    else:  # 3 free: exactly enough
        assert copies is not None and len(copies) == 1, (
            f"1 copy + 2 lookahead blocks fit in 3 free blocks: one copy expected, got {copies}"
        )
        assert len(table(mgr, "c")) == 4, (
            f"the child's table must cover 13 slots (4 blocks), got {table(mgr, 'c')}"
        )
        free = mgr.block_pool.get_num_free_blocks()
        assert free == 0, f"the step takes all 3 free blocks; {free} left"


@pytest.mark.parametrize("num_free", [0, 1])
def test_append_slots_counts_lookahead_blocks_it_already_holds_as_no_new_blocks(num_free):
    """A request holding more blocks than its next tokens need (lookahead) needs no new block,
    but its shared lookahead blocks still need copies: with fewer free blocks than copies that
    is a refusal, not an error half-way.

    With one block free the count matters: the table holds one block more than 7 tokens need, so
    "blocks to allocate" is -1, and 2 copies - 1 = 1 "fits" in the one free block unless the
    new-block count is clamped at 0 (then 2 copies + 0 > 1: refused)."""
    mgr = make_manager(num_blocks=4 + num_free)  # 3 usable blocks, plus the free ones
    parent = _prefilled(mgr, [1, 2, 3, 4, 5, 6], lookahead=6)  # 3 blocks: 12 slots
    child = make_child(parent, "c", 10)
    mgr.fork(parent, child)
    assert mgr.block_pool.get_num_free_blocks() == num_free, f"set-up: {num_free} block(s) free"
    before = snapshot(mgr)
    try:
        copies = mgr.append_slots(child, 1)
    except ValueError as exc:
        raise AssertionError(
            f"append_slots raised where it must return None: the child shares blocks 1 and 2 "
            f"(2 copies) and already holds more blocks than 7 tokens need (0 new blocks, not "
            f"-1), {num_free} free; count the new blocks as max(0, ...). It raised: {exc}"
        ) from exc
    assert copies is None, (
        f"2 copies of shared blocks need 2 free blocks, {num_free} free: append_slots must "
        f"return None, got {copies}"
    )
    assert_unchanged(mgr, before, "a refused append_slots")
    # Once the parent is freed the child holds its blocks alone: the same step copies nothing.
    mgr.free(parent)
    copies = mgr.append_slots(child, 1)
    assert copies == [], (
        f"with the parent freed the child shares no block and holds enough of them: "
        f"append_slots must return [] (no copy), got {copies}"
    )


def test_append_slots_without_room_returns_none_and_changes_nothing():
    sim = Sim(num_blocks=4)  # 3 usable blocks
    parent = sim.admit([1, 2, 3, 4, 5, 6], 9)  # takes 2
    child = sim.fork(parent, 10)
    # copy-on-write takes the last free block
    assert sim.step(child, 11) is not None, "append_slots refused a copy into the last free block"
    before = snapshot(sim.mgr)
    copies = sim.mgr.append_slots(parent, 3)  # needs a new block: none left
    assert copies is None, f"3 more tokens need a new block and none is free; got {copies}"
    assert_unchanged(sim.mgr, before, "a refused append_slots (no block for new tokens)")
    grandchild = sim.fork(child, 12)
    before = snapshot(sim.mgr)
    copies = sim.mgr.append_slots(grandchild, 1)  # needs a copy: no block for it
    assert copies is None, f"the write needs a copy and no block is free; got {copies}"
    assert_unchanged(sim.mgr, before, "a refused append_slots (no block for the copy)")
    sim.check_reads()
    sim.check_counts()


# ---------------------------------------------------------------------------------------------
# random workloads, checked after every step
# ---------------------------------------------------------------------------------------------


class SharingMachine(RuleBasedStateMachine):
    """Requests arrive (with prefix-cache hits from a tiny vocabulary), fork, decode, finish."""

    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(num_blocks=24)

    def _pick(self, i: int):
        ids = sorted(self.sim.live)
        return self.sim.live[ids[i % len(ids)]]

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=11),
        next_token=st.integers(0, 2),
    )
    def arrive(self, prompt, next_token):
        self.sim.admit(prompt, next_token)

    @precondition(lambda self: self.sim.live)
    @rule(i=st.integers(0, 50), next_token=st.integers(0, 2))
    def fork(self, i, next_token):
        self.sim.fork(self._pick(i), next_token)

    @precondition(lambda self: self.sim.live)
    @rule(i=st.integers(0, 50), next_token=st.integers(0, 2), times=st.integers(1, 5))
    def decode(self, i, next_token, times):
        req = self._pick(i)
        tokens = self.sim.tokens[self.sim.rid[id(req)]]
        for _ in range(times):
            if len(tokens) >= 64 or self.sim.step(req, next_token) is None:
                break

    @precondition(lambda self: self.sim.live)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        self.sim.finish(self._pick(i))

    @invariant()
    def reads_and_counts(self):
        self.sim.check_reads()
        self.sim.check_counts()

    def teardown(self):
        for req in list(self.sim.live.values()):
            self.sim.finish(req)
        self.sim.check_counts()
        held = {b.block_id: b.ref_cnt for b in read(self.sim.mgr).block_pool.blocks[1:]
                if b.ref_cnt}
        assert not held, f"every request freed, yet blocks are still held (id: ref_cnt): {held}"


test_random_workloads_keep_every_sequence_isolated = SharingMachine.TestCase


# ---------------------------------------------------------------------------------------------
# the data plane: copy_blocks + paged attention over forked sequences
# ---------------------------------------------------------------------------------------------


def test_paged_attention_over_forked_sequences_equals_unshared_attention():
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, num_blocks = 4, 2, 16, 40
    x = 16 // 4  # fp32
    key_cache = torch.zeros(num_blocks, num_kv_heads, head_size // x, BS, x)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head_size, BS)
    mgr = make_manager(num_blocks)
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # each sequence's own K and V
    live: dict[str, object] = {}

    def write(req, k, v):
        start = req.num_computed_tokens
        ids = table(mgr, req.request_id)
        slots = torch.tensor(
            [ids[p // BS] * BS + p % BS for p in range(start, start + k.shape[0])]
        )
        lab.reshape_and_cache(k, v, key_cache, value_cache, slots)
        old_k, old_v = dense.get(req.request_id, (k[:0], v[:0]))
        dense[req.request_id] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
        req.num_computed_tokens = start + k.shape[0]

    def fork(parent, child_id, token):
        child = make_child(parent, child_id, token)
        mgr.fork(parent, child)
        live[child_id] = child
        dense[child_id] = tuple(t.clone() for t in dense[parent.request_id])

    def check_attention():
        ids = sorted(live)
        query = torch.randn(len(ids), num_heads, head_size)
        tables = [table(mgr, rid) for rid in ids]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq_lens = torch.tensor([live[rid].num_computed_tokens for rid in ids], dtype=torch.int32)
        out = torch.empty_like(query)
        scale = head_size**-0.5
        lab.paged_attention_v1(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            BS, int(seq_lens.max()),
        )
        for s, rid in enumerate(ids):
            k, v = dense[rid]
            expected = ref_attention(query[s : s + 1], k, v, scale=scale)
            assert_close(out[s : s + 1], expected, msg=f"sequence {rid}")

    parent = make_request("p", list(range(7)))  # 7 tokens: the second block is partly filled
    assert mgr.allocate_slots(parent, 7) is not None, "the given allocate_slots refused 7 tokens"
    live["p"] = parent
    prompt_k, prompt_v = torch.randn(2, 7, num_kv_heads, head_size)
    write(parent, prompt_k, prompt_v)
    parent.append_output_token_ids(100)
    for i in range(3):  # parallel sampling: n = 4
        fork(parent, f"s{i}", 101 + i)
    num_copies = 0
    for step in range(9):
        for rid in sorted(live):
            req = live[rid]
            copies = mgr.append_slots(req, 1)
            assert copies is not None, f"append_slots refused {rid} with 40 blocks in the cache"
            num_copies += len(copies)
            if copies:
                lab.copy_blocks([key_cache], [value_cache], torch.tensor(copies, dtype=torch.int64))
            new_k, new_v = torch.randn(2, 1, num_kv_heads, head_size)
            write(req, new_k, new_v)
            req.append_output_token_ids(200 + step)
        check_attention()
        if step == 2:  # beam-search style: a child forks mid-block, then its parent leaves
            fork(live["s1"], "s1b", 300)
        if step == 5:
            mgr.free(live.pop("p"))
            del dense["p"]
    assert num_copies >= 4, "every sequence but the last holder copies the shared tail block"
