"""Disaggregated prefill (``DisaggregatedLLM``): a prefill engine and a decode engine, each with
its engine core in a process of its own, joined by a KV connector over shared memory or TCP.

The pair's tokens equal one engine's (greedy), and the decode engine computed only each prompt's
last partial block (its output says how many prompt tokens it did not compute). In one process,
two ``LLM``s show the connector's contract: blocks land in the consumer's own block ids, and a
connector that saves a layer's blocks before the layer wrote them is caught by the same check.
Nothing outlives the pair: no process, no shared-memory segment, also after Ctrl-C or after the
prefill engine's process is killed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest

from mini_vllm.config import EngineConfig, KVTransferConfig
from mini_vllm.distributed.kv_transfer import SharedMemoryBlockStore, TcpBlockStore, block_connector
from mini_vllm.entrypoints.disagg import DisaggregatedLLM, free_tcp_port
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker import kv_connector_model_runner_mixin as runner_hooks

BLOCK = 16
PROMPTS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind",  # a prefix
    "ROMEO:",  # shorter than a block: nothing to move
    "x" * 32,  # exactly two blocks: one moves, the last token is computed here
    "First Citizen:\nBefore we proceed any further, hear me speak. " * 4,
]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "_"))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(num_gpu_blocks=128)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def _run(pair: DisaggregatedLLM, prompts: list[str]) -> list[tuple[list[int], int]]:
    async def one(prompt: str) -> tuple[list[int], int]:
        tokens, cached = [], 0
        async for out in pair.generate(prompt, GREEDY):
            tokens += out.outputs[0].token_ids
            cached = out.metrics.get("num_cached_tokens", cached)
        return tokens, cached

    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_pair_equals_one_engine_and_the_decode_engine_skips_the_prefill(reference,
                                                                              transport):
    pair = DisaggregatedLLM(kv_transport=transport, num_gpu_blocks=128)
    try:
        results = asyncio.run(_run(pair, PROMPTS))
    finally:
        pair.shutdown()
    assert [tokens for tokens, _ in results] == reference
    # Every full block but the one holding the last prompt token came from the prefill engine
    # (or the decode engine's own prefix cache, for the prompt it shares): nothing recomputed.
    ids = [pair.tokenizer.encode(p) for p in PROMPTS]
    assert [cached for _, cached in results] == [(len(t) - 1) // BLOCK * BLOCK for t in ids]
    assert mp.active_children() == []
    if transport == "shm":
        assert _segments(pair.kv_store) == []


def _in_process_pair(store: str) -> tuple[LLM, LLM]:
    make = lambda role: LLM(num_gpu_blocks=64, kv_transfer_config=KVTransferConfig(  # noqa: E731
        kv_role=role, kv_transport="shm", kv_store=store))
    return make("kv_producer"), make("kv_consumer")


def _prefill_then_decode(producer: LLM, consumer: LLM) -> list[list[int]]:
    producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return [list(o.outputs[0].token_ids)
            for o in consumer.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_blocks_land_in_the_consumers_own_block_ids(reference, monkeypatch):
    store = f"mvtest_remap_{os.getpid()}"
    producer, consumer = _in_process_pair(store)
    # The consumer's pool is in another state: an unrelated prompt took its first blocks.
    consumer.generate(["Enter GHOST. " * 6], GREEDY, use_tqdm=False)
    saved, loaded = [], []
    real = block_connector.BlockStoreConnector.build_connector_meta

    def spy(self, scheduler_output):
        meta = real(self, scheduler_output)
        saved.extend(b for s in meta.saves for b in s.block_ids)
        loaded.extend(b for s in meta.loads for b in s.block_ids)
        return meta

    monkeypatch.setattr(block_connector.BlockStoreConnector, "build_connector_meta", spy)
    try:
        assert _prefill_then_decode(producer, consumer) == reference
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
    assert saved and loaded and saved[:len(loaded)] != loaded
    assert _segments(store) == []


def test_saving_a_layer_before_it_wrote_its_cache_is_caught(reference, monkeypatch):
    """The planted bug of lab 04-06: the blocks go out before the prefill wrote them."""

    def save_first(self, query, key, value, key_cache, value_cache, meta, scale):
        name = self.layer_of(key_cache)
        self.connector.wait_for_layer_load(name)
        self.connector.save_kv_layer(name, (key_cache, value_cache), meta)
        return self.inner(query, key, value, key_cache, value_cache, meta, scale)

    monkeypatch.setattr(runner_hooks.ConnectorAttention, "__call__", save_first)
    store = f"mvtest_early_{os.getpid()}"
    producer, consumer = _in_process_pair(store)
    try:
        assert _prefill_then_decode(producer, consumer) != reference
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
    assert _segments(store) == []


def test_a_killed_prefill_engine_leaves_no_segment_or_process():
    pair = DisaggregatedLLM(kv_transport="shm", num_gpu_blocks=64)
    try:
        asyncio.run(_run(pair, PROMPTS[:1]))
        assert _segments(pair.kv_store), "the prefill engine saved nothing"
        os.kill(pair.prefill.core_client.process.pid, signal.SIGKILL)
        pair.prefill.core_client.process.join(timeout=10)
    finally:
        pair.shutdown()
    assert _segments(pair.kv_store) == []
    assert mp.active_children() == []


def test_ctrl_c_inside_the_pair_leaves_no_segment_or_process():
    with pytest.raises(KeyboardInterrupt):
        with DisaggregatedLLM(kv_transport="shm", num_gpu_blocks=64) as pair:
            asyncio.run(_run(pair, PROMPTS[:2]))
            assert _segments(pair.kv_store), "the prefill engine saved nothing"
            raise KeyboardInterrupt
    assert _segments(pair.kv_store) == []
    assert mp.active_children() == []


def test_a_half_written_block_is_not_read_and_the_oldest_go_first():
    prefix = f"mvtest_store_{os.getpid()}"
    producer, consumer = SharedMemoryBlockStore(prefix, capacity=2), SharedMemoryBlockStore(prefix)
    try:
        producer.put(b"a", b"\x01" * 8)
        producer.put(b"b", b"\x02" * 8)
        assert consumer.fetch_prefix([b"a", b"b", b"c"]) == [b"\x01" * 8, b"\x02" * 8]
        assert consumer.fetch_prefix([b"b"]) == [b"\x02" * 8]
        producer.put(b"c", b"\x03" * 8)  # over capacity: "a" goes
        assert consumer.fetch_prefix([b"a", b"b"]) == []
        assert consumer.fetch_prefix([b"b", b"c"]) == [b"\x02" * 8, b"\x03" * 8]
        # A segment whose length header is still 0 is being written: not a block yet.
        from multiprocessing.shared_memory import SharedMemory

        half = SharedMemory(f"{prefix}_{b'd'.hex()}", create=True, size=16)
        try:
            assert consumer.fetch_prefix([b"d"]) == []
        finally:
            half.close()
            half.unlink()
    finally:
        producer.close()
    assert _segments(prefix) == []


def test_a_silent_tcp_producer_counts_as_an_empty_store():
    """Nobody serves the address: the fetch gives up after its timeout, and stays quiet for a
    while instead of making every admission wait again (the consumer computes the prompt)."""
    store = TcpBlockStore(f"127.0.0.1:{free_tcp_port()}", serve=False, timeout_s=0.2,
                          retry_after_s=60)
    try:
        start = time.monotonic()
        assert store.fetch_prefix([b"k"]) == []
        assert store.fetch_prefix([b"k"]) == []
        assert time.monotonic() - start < 5
    finally:
        store.close()


def test_a_tcp_producer_serves_what_it_holds():
    address = f"127.0.0.1:{free_tcp_port()}"
    producer = TcpBlockStore(address, capacity=4, serve=True)
    consumer = TcpBlockStore(address, serve=False)
    try:
        producer.put(b"a", b"AAAA")
        producer.put(b"b", b"BB")
        assert consumer.fetch_prefix([b"a", b"b", b"z", b"a"]) == [b"AAAA", b"BB"]
        assert consumer.fetch_prefix([b"z", b"a"]) == []
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("fields, message", [
    (dict(kv_role="prefill"), "kv_role must be one of"),
    (dict(kv_role="kv_producer", kv_transport="rdma"), "kv_transport must be one of"),
    (dict(kv_role="kv_producer", kv_transport="tcp", kv_store="localhost"), "'host:port'"),
    (dict(kv_role="kv_producer", kv_store="../etc"), "name prefix"),
    (dict(kv_role="kv_producer", kv_buffer_blocks=0), "kv_buffer_blocks"),
])
def test_a_bad_kv_transfer_config_is_refused_with_its_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**fields)


def test_a_kv_connector_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="kv_transfer_config runs with the default engine"):
        EngineConfig(tensor_parallel_size=2, kv_transfer_config={"kv_role": "kv_both"})


def test_a_tcp_port_in_use_is_refused_with_what_to_do():
    address = f"127.0.0.1:{free_tcp_port()}"
    first = TcpBlockStore(address, serve=True)
    try:
        with pytest.raises(RuntimeError, match="pick a free port"):
            TcpBlockStore(address, serve=True)
    finally:
        first.close()
