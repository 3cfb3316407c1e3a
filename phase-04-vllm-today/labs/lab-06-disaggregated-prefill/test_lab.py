"""Graded tests for lab 04-06: disaggregated prefill and a KV connector.

No engine and no second process of the course's: each test drives one half of your connector as
the scheduler or the runner would, on small blocks (4 tokens), and checks what it returns or
writes against expectations computed here, from the request's hash chain and the caches'
contents (never from the lab's code).

Groups: task 1 (the consumer's hit: the leading run of the chain past the local hit, never the
last token's block), task 2 (the plan: loads into this engine's block ids after the local hit,
saves of the prompt blocks a step fills), task 3 (the copies between blobs and the paged cache,
layer by layer), task 4 (the hooks' order around a layer's attention: load, attend, save).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course.labs.loader import load_lab
from course.labs.student_process import read
from mini_vllm.config import KVTransferConfig
from mini_vllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from mini_vllm.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from mini_vllm.core.sched.output import CachedRequestData, SchedulerOutput
from mini_vllm.distributed.kv_transfer import (
    BlockStoreConnector as ReferenceConnector,
)
from mini_vllm.distributed.kv_transfer import (
    BlockStoreConnectorMetadata,
    KVConnectorRole,
    LoadSpec,
    MemoryBlockStore,
    SaveSpec,
)
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.kv_connector_model_runner_mixin import layer_name

lab = load_lab(__file__)

BS = 4
SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
# The cache layout of mini_vllm: keys [blocks, heads, head_size / x, block, x], values
# [blocks, heads, head_size, block]; here 2 layers, 2 heads of 8, x = 4, 8 blocks.
LAYERS, HEADS, HEAD, X, BLOCKS = 2, 2, 8, 4, 8
PER_BLOCK = HEADS * HEAD * BS


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


def config(role: str) -> KVTransferConfig:
    return KVTransferConfig(kv_role=role, kv_transport="shm", kv_store="lab_04_06")


def connector(role: KVConnectorRole, kv_role: str, store=None):
    return lab.BlockStoreConnector(role, config(kv_role), BS, store=store)


def request(num_tokens: int, rid: str = "r", seed: int = 0) -> Request:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 250, (num_tokens,), generator=g).tolist()
    return Request(rid, prompt, SamplingParams(max_tokens=4), eos_token_id=None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, PER_BLOCK, generator=g).numpy().tobytes()


def store_holding(req: Request, stored: set[int]) -> MemoryBlockStore:
    """A store with the blobs of ``req``'s full blocks numbered in ``stored``."""
    store = MemoryBlockStore()
    for i, key in enumerate(req.block_hashes):
        if i in stored:
            store.put(key, blob(100 + i))
    return store


def expected_hit(num_tokens: int, local_blocks: int, stored: set[int]) -> int:
    """Blocks from the local hit on, while stored, stopping before the last token's block."""
    last = (num_tokens - 1) // BS
    n = 0
    for i in range(local_blocks, last):
        if i not in stored:
            break
        n += 1
    return n * BS


def step_output(num_scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        num_common_prefix_blocks=[0], finished_req_ids=set())


def blocks_with_ids(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


# ------------------------------------------------------------------------------------------
# Task 1: the consumer's hit
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("num_tokens, local_blocks, stored", [
    (14, 0, {0, 1, 2}),  # 3 full blocks, the last token in block 3: all three
    (12, 0, {0, 1, 2}),  # 3 full blocks, the last token in block 2: two
    (12, 1, {0, 1, 2}),  # a local hit of one block: block 1 only
    (14, 0, {0, 2}),  # block 1 missing: the chain stops at block 0
    (14, 0, {1, 2}),  # block 0 missing: nothing, whatever follows
    (14, 1, {1, 2}),  # past a local hit, the store may lack what the engine has
    (3, 0, set()),  # no full block
    (5, 0, {0}),  # one full block, the last token in the next: it moves
    (4, 0, {0}),  # exactly one block: its last token is computed here, nothing moves
])
def test_the_hit_is_the_leading_run_of_the_chain_past_the_local_hit(num_tokens, local_blocks,
                                                                     stored):
    req = request(num_tokens)
    conn = connector(SCHEDULER, "kv_consumer", store_holding(req, stored))
    got = conn.get_num_new_matched_tokens(req, local_blocks * BS)
    assert tuple(got) == (expected_hit(num_tokens, local_blocks, stored), False), (
        f"a {num_tokens}-token prompt, a local hit of {local_blocks} block(s), the store holding "
        f"blocks {sorted(stored)}: expected {expected_hit(num_tokens, local_blocks, stored)} "
        f"tokens, got {got}")


@pytest.mark.points(1)
@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 40), data=st.data())
def test_the_hit_on_drawn_prompts_and_stores(num_tokens, data):
    full = num_tokens // BS
    local = data.draw(st.integers(0, max(0, (num_tokens - 1) // BS)), label="local blocks")
    stored = data.draw(st.sets(st.integers(0, max(0, full - 1)), max_size=full), label="stored")
    req = request(num_tokens, seed=num_tokens)
    conn = connector(SCHEDULER, "kv_consumer", store_holding(req, stored))
    got = conn.get_num_new_matched_tokens(req, local * BS)
    want = expected_hit(num_tokens, local, stored)
    assert tuple(got) == (want, False), (
        f"a {num_tokens}-token prompt, a local hit of {local} block(s), the store holding blocks "
        f"{sorted(stored)}: expected ({want}, False), got {got}")


@pytest.mark.points(1)
def test_a_producer_or_an_unaligned_hit_matches_nothing():
    req = request(14)
    producer = connector(SCHEDULER, "kv_producer", store_holding(req, {0, 1, 2}))
    got = producer.get_num_new_matched_tokens(req, 0)
    assert tuple(got) == (0, False), f"a producer loads nothing; got {got}"
    consumer = connector(SCHEDULER, "kv_consumer", store_holding(req, {0, 1, 2}))
    got = consumer.get_num_new_matched_tokens(req, 6)
    assert tuple(got) == (0, False), (
        f"a local hit of 6 tokens ends inside a block: nothing to load; got {got}")


# ------------------------------------------------------------------------------------------
# Task 2: the plan of a step
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("local_blocks", [0, 1])
def test_loads_land_in_this_engines_blocks_after_the_local_hit(local_blocks):
    """The consumer's pool gave the request blocks 9, 4, 7, 2 (not 0, 1, 2, 3, the positions,
    nor the producer's ids, which never cross): the blobs go to the blocks after the hit."""
    req = request(14)
    conn = connector(SCHEDULER, "kv_consumer", store_holding(req, {0, 1, 2}))
    n, _ = conn.get_num_new_matched_tokens(req, local_blocks * BS)
    ids = [9, 4, 7, 2]
    conn.update_state_after_alloc(req, blocks_with_ids(ids), n)
    meta = read(conn.build_connector_meta(step_output({"r": 14 - local_blocks * BS - n})))
    moved = n // BS
    want = LoadSpec("r", ids[local_blocks:local_blocks + moved],
                    [blob(100 + i) for i in range(local_blocks, local_blocks + moved)])
    loads = [(s.request_id, list(s.block_ids), list(s.blobs)) for s in meta.loads]
    assert loads == [(want.request_id, want.block_ids, want.blobs)], (
        f"blocks {ids} given, a local hit of {local_blocks} block(s), {moved} block(s) fetched: "
        f"one LoadSpec into blocks {want.block_ids} with the fetched blobs in order; got "
        f"{[(r, b, len(x)) for r, b, x in loads]} (request, block ids, number of blobs)")
    assert list(meta.saves) == [], f"a consumer saves nothing; got {meta.saves}"
    again = read(conn.build_connector_meta(step_output({"r": 1})))
    assert list(again.loads) == [], "a step's loads are planned once"


@pytest.mark.points(1)
def test_nothing_to_load_plans_no_load():
    req = request(14)
    conn = connector(SCHEDULER, "kv_consumer", store_holding(req, set()))
    n, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, blocks_with_ids([3, 5, 6, 1]), n)
    meta = read(conn.build_connector_meta(step_output({"r": 14})))
    assert (list(meta.loads), list(meta.saves)) == ([], []), (
        f"nothing fetched: no load and no save; got {meta.loads}, {meta.saves}")


def _admitted(manager: KVCacheManager, req: Request, ids_before: int = 0) -> KVCacheBlocks:
    """``req``'s blocks for its whole prompt, after ``ids_before`` blocks went to another."""
    if ids_before:
        other = request(ids_before * BS, rid="other", seed=99)
        manager.allocate_slots(other, ids_before * BS)
    return manager.allocate_slots(req, req.num_tokens)


@pytest.mark.points(2)
def test_saves_are_the_prompt_blocks_each_step_fills():
    """A 14-token prompt computed in chunks of 6, 6 and 2 tokens, then decoded: block 0 is
    filled by the first step, blocks 1 and 2 by the second, none by the third (its tokens are in
    block 3, which the prompt does not fill), and none by the decode that fills block 3 with
    generated tokens (the producer's store is for prompts)."""
    manager = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64, enable_caching=False)
    req = request(14)
    blocks = _admitted(manager, req, ids_before=2)
    ids = list(blocks.get_block_ids()[0])
    conn = connector(SCHEDULER, "kv_producer")
    conn.bind_kv_cache_manager(manager)
    conn.update_state_after_alloc(req, blocks, 0)
    plan = []
    for num_computed, num_new in [(0, 6), (6, 6), (12, 2), (15, 1)]:
        if num_computed == 15:  # two tokens generated: block 3 is full, and hashed
            req.append_output_token_ids([7, 8])
        req.num_computed_tokens = num_computed + num_new  # the step is planned: advanced
        meta = read(conn.build_connector_meta(step_output({"r": num_new})))
        plan.append([(s.request_id, list(s.block_ids), list(s.keys)) for s in meta.saves])
        assert list(meta.loads) == [], f"a producer loads nothing; got {meta.loads}"
    keys = list(req.block_hashes)
    assert plan == [[("r", ids[0:1], keys[0:1])], [("r", ids[1:3], keys[1:3])], [], []], (
        "the SaveSpecs of the four steps, as (request, block ids, keys)")


@pytest.mark.points(1)
def test_only_the_requests_a_producer_remembers_are_saved():
    manager = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64, enable_caching=False)
    kept, other = request(8, "kept"), request(8, "other", seed=3)
    conn = connector(SCHEDULER, "kv_producer")
    conn.bind_kv_cache_manager(manager)
    conn.update_state_after_alloc(kept, manager.allocate_slots(kept, 8), 0)
    manager.allocate_slots(other, 8)
    meta = read(conn.build_connector_meta(step_output({"other": 8, "kept": 8})))
    saved = [s.request_id for s in meta.saves]
    assert saved == ["kept"], (
        f"only the request update_state_after_alloc remembered is saved; got {saved}")
    consumer = connector(SCHEDULER, "kv_consumer", MemoryBlockStore())
    consumer.bind_kv_cache_manager(manager)
    consumer.update_state_after_alloc(kept, manager.get_blocks("kept"), 0)
    assert list(read(consumer.build_connector_meta(step_output({"kept": 8}))).saves) == [], (
        "a consumer saves nothing")


# ------------------------------------------------------------------------------------------
# Task 3: the copies, layer by layer
# ------------------------------------------------------------------------------------------


def caches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BLOCKS, HEADS, HEAD // X, BS, X, generator=g),
             torch.randn(BLOCKS, HEADS, HEAD, BS, generator=g)) for _ in range(LAYERS)]


def worker(kv_role: str, kv, store=None):
    conn = connector(WORKER, kv_role, store)
    conn.register_kv_caches({layer_name(i): pair for i, pair in enumerate(kv)})
    return conn


def as_blocks(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(LAYERS, 2, PER_BLOCK)


@pytest.mark.points(2)
def test_a_layer_load_writes_its_blobs_into_their_blocks_once():
    kv = caches()
    before = [(k.clone(), v.clone()) for k, v in kv]
    conn = worker("kv_consumer", kv)
    targets, blobs = [6, 1], [blob(7), blob(8)]
    conn.bind_connector_metadata(BlockStoreConnectorMetadata(loads=[LoadSpec("r", targets,
                                                                             blobs)]))
    conn.start_load_kv()
    conn.wait_for_layer_load(layer_name(1))
    expect = [(k.clone(), v.clone()) for k, v in before]
    for block, data in zip(targets, blobs):
        whole = as_blocks(data)
        expect[1][0][block] = whole[1, 0].view(HEADS, HEAD // X, BS, X)
        expect[1][1][block] = whole[1, 1].view(HEADS, HEAD, BS)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][0], expect[layer][0]) and torch.equal(  # noqa: PT018
            kv[layer][1], expect[layer][1]), (
            f"after wait_for_layer_load(layer 1): layer {layer}'s cache; layer 1's blocks "
            f"{targets} hold the blobs, everything else is as it was")
    kv[1][0][6].zero_()  # the layer is done: a second wait must not write it again
    conn.wait_for_layer_load(layer_name(1))
    assert torch.equal(kv[1][0][6], torch.zeros_like(kv[1][0][6])), (
        "a second wait_for_layer_load for layer 1 wrote its blocks again; once is enough")
    conn.wait_for_layer_load(layer_name(0))
    for block, data in zip(targets, blobs):
        whole = as_blocks(data)
        assert torch.equal(kv[0][0][block].flatten(), whole[0, 0]) and torch.equal(  # noqa: PT018
            kv[0][1][block].flatten(), whole[0, 1]), (
            f"after wait_for_layer_load(layer 0): block {block} holds layer 0's part of its blob")
    conn.wait_for_save()  # every layer loaded: the step ends cleanly


@pytest.mark.points(2)
def test_saved_blocks_reach_the_store_with_every_layer():
    kv = caches(seed=1)
    store = MemoryBlockStore()
    conn = worker("kv_producer", kv, store)
    sources, keys = [3, 5], [b"key-a", b"key-b"]
    conn.bind_connector_metadata(BlockStoreConnectorMetadata(saves=[SaveSpec("r", sources,
                                                                             keys)]))
    conn.start_load_kv()
    for layer in range(LAYERS):
        conn.save_kv_layer(layer_name(layer), kv[layer], None)
    conn.wait_for_save()
    held = read(store).blobs
    for block, key in zip(sources, keys):
        want = torch.stack([torch.stack([kv[layer][0][block].flatten(),
                                         kv[layer][1][block].flatten()])
                            for layer in range(LAYERS)])
        assert key in held, f"block {block} was not handed to the store under its key"
        assert torch.equal(as_blocks(held[key]), want), (
            f"the blob of block {block}: [layer, K or V, elements] from the caches")


@pytest.mark.points(1)
def test_a_layer_saves_its_own_part_only():
    kv = caches(seed=2)
    conn = worker("kv_producer", kv, MemoryBlockStore())
    conn.bind_connector_metadata(BlockStoreConnectorMetadata(saves=[SaveSpec("r", [2], [b"k"])]))
    conn.start_load_kv()
    conn.save_kv_layer(layer_name(1), kv[1], None)
    state = read(conn)
    assert set(state._saved_layers) == {1}, (
        f"save_kv_layer(layer 1) marks layer 1 saved, and only it; got {set(state._saved_layers)}")
    ids, buffer = state._saving
    assert torch.equal(buffer[0, 1, 0], kv[1][0][2].flatten()) and torch.equal(  # noqa: PT018
        buffer[0, 1, 1], kv[1][1][2].flatten()), (
        "buffer[0, 1] holds layer 1's keys and values of block 2, flattened")
    with pytest.raises(RuntimeError, match="never saved"):
        conn.wait_for_save()  # layer 0 never saved: the given check refuses the step


# ------------------------------------------------------------------------------------------
# Task 4: the hooks around a layer's attention
# ------------------------------------------------------------------------------------------


class Attention:
    """A stand-in for the runner's attention backend: it writes the step's K into block 5 (the
    block the step fills), reads block 2 (a block loaded in this step) and returns a marker."""

    def __init__(self):
        self.seen_block_2: list[torch.Tensor] = []
        self.seen_meta: list[object] = []

    def __call__(self, query, key, value, key_cache, value_cache, meta, scale):
        self.seen_meta.append(meta)
        key_cache[5] = key
        value_cache[5] = value
        self.seen_block_2.append(key_cache[2].clone())
        return query * scale


@pytest.mark.points(2)
def test_attention_reads_loaded_blocks_and_the_save_holds_what_it_wrote():
    kv = caches(seed=3)
    loaded = blob(11)
    store = MemoryBlockStore()
    hooks = ReferenceConnector(WORKER, config("kv_both"), BS, store=store)
    hooks.register_kv_caches({layer_name(i): pair for i, pair in enumerate(kv)})
    hooks.bind_connector_metadata(BlockStoreConnectorMetadata(
        loads=[LoadSpec("a", [2], [loaded])], saves=[SaveSpec("b", [5], [b"filled"])]))
    hooks.start_load_kv()
    inner = Attention()
    attention = lab.ConnectorAttention(inner, hooks, kv)
    query = torch.randn(3, 4)
    new_k = torch.randn(HEADS, HEAD // X, BS, X)
    new_v = torch.randn(HEADS, HEAD, BS)
    step = {"step": 7}  # the step's attention metadata, as the runner hands it over
    outs = [attention(query, new_k + layer, new_v + layer, kv[layer][0], kv[layer][1], step, 0.5)
            for layer in range(LAYERS)]
    for out in outs:
        assert torch.equal(torch.as_tensor(out), query * 0.5), "the layer returns inner's result"
    assert inner.seen_meta == [step] * LAYERS, (
        f"inner gets the step's metadata as it came; got {inner.seen_meta}")
    whole = as_blocks(loaded)
    for layer in range(LAYERS):
        assert torch.equal(inner.seen_block_2[layer].flatten(), whole[layer, 0]), (
            f"layer {layer}'s attention read block 2 before its load was written")
    hooks.wait_for_save()
    saved = as_blocks(read(store).blobs[b"filled"])
    for layer in range(LAYERS):
        assert torch.equal(saved[layer, 0], (new_k + layer).flatten()), (
            f"layer {layer}'s saved block 5 holds stale keys: it was saved before the layer "
            "wrote the step's K/V")
        assert torch.equal(saved[layer, 1], (new_v + layer).flatten()), (
            f"layer {layer}'s saved block 5 holds stale values")


@pytest.mark.starter_ok
def test_blobs_of_another_engine_shape_are_refused():
    """Given (``start_load_kv``): a blob whose size is not this engine's block is refused with
    what to do."""
    kv = caches()
    conn = worker("kv_consumer", kv)
    conn.bind_connector_metadata(BlockStoreConnectorMetadata(loads=[LoadSpec("r", [1],
                                                                             [b"\0" * 12])]))
    with pytest.raises(ValueError, match="same model, block size and kv_cache_dtype"):
        conn.start_load_kv()
