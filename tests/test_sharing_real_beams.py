"""benchmarks/sharing.py --real-beams counts a beam tree three ways; each count is checked here on
a tiny hand-made tree (block size 4) whose blocks can be counted by hand, and on a real search of
a tiny model: no sharing is the sum of every beam's blocks, fork + copy-on-write (lab 02-05's
manager replaying the tree) holds the tree's distinct blocks, and the engine's in-step counter
(prefix caching) equals the beams' distinct full-block prefixes plus one partial block per beam.
A replay that forgets to free a dead beam, or skips copy-on-write, must give other numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from course.labs.loader import load_script
from mini_vllm.core.block_sharing import SharingKVCacheManager
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.sampling_params import BeamSearchParams, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
BS = 4
P = [1, 2, 3, 4, 5]  # one full block and one token of a partial one
# The live beams after each step (BeamSearchOutput.beam_history). Step 1: the prompt has three
# children, which share its partial block. Step 2: beam 11 dies, beam 10 has two children. Step
# 3: the two children of 10 fill block 1 (8 tokens). Step 4: 10-20-30 has two children, which
# share its now full block 1; 10-20-31 dies. The last entry is never run through the model.
HISTORY = [
    [P + [10], P + [11], P + [12]],
    [P + [10, 20], P + [10, 21], P + [12, 22]],
    [P + [10, 20, 30], P + [10, 20, 31], P + [12, 22, 32]],
    [P + [10, 20, 30, 40], P + [10, 20, 30, 41], P + [12, 22, 32, 42]],
    [P + [10, 20, 30, 40, 50], P + [12, 22, 32, 42, 51]],
]
# Counted by hand, step by step (steps 0-4 run the prompt, then HISTORY[0..3]):
UNSHARED = [2, 6, 6, 6, 9]  # 1, 3, 3, 3, 3 beams of 2, 2, 2, 2, 3 blocks
TREE = [2, 4, 4, 4, 6]  # block 0 once; block 1 per beam (2 at step 4: A and B share it); block 2
COPIES = 2 + 1 + 1 + 0  # the shared partial block: 3 holders, then 2, 2; a full one is not copied


@pytest.fixture(scope="module")
def bench():
    return load_script("sharing_benchmark", REPO_ROOT / "benchmarks" / "sharing.py")


def _manager(cls=SharingKVCacheManager):
    return cls(64, BS, 256, enable_caching=False)


def test_the_closed_forms_count_the_hand_made_tree(bench):
    steps = bench.search_steps(P, HISTORY)
    assert steps[0] == [P] and steps[1:] == HISTORY[:-1]
    assert [bench.unshared_blocks(b, BS) for b in steps] == UNSHARED
    assert [bench.tree_blocks(b, BS) for b in steps] == TREE
    # Distinct beams of equal length: each has its own partial block under both designs.
    assert [bench.prefix_cached_blocks(b, BS) for b in steps] == TREE


def test_the_fork_cow_replay_holds_the_trees_distinct_blocks_and_frees_them_all(bench):
    mgr = _manager()
    replay = bench.replay_fork_cow(mgr, P, HISTORY)
    assert replay.unshared == sum(UNSHARED)
    assert replay.held == sum(TREE)
    assert replay.peak == max(TREE)
    assert replay.copies == COPIES
    assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_gpu_blocks - 1
    with pytest.raises(ValueError, match="parent was not live"):
        bench.replay_fork_cow(_manager(), P, [HISTORY[0], [P + [13, 20]], []])


class _ForgetsDeadBeams(SharingKVCacheManager):
    def free(self, request):  # planted: a pruned beam keeps its blocks
        if len(self.req_to_blocks) > 1:
            return
        super().free(request)


class _NoCopyOnWrite(SharingKVCacheManager):
    def _get_blocks_to_copy_on_write(self, request):  # planted: writes into shared blocks
        return []


@pytest.mark.parametrize("planted", [_ForgetsDeadBeams, _NoCopyOnWrite])
def test_a_planted_bug_changes_the_replays_numbers(bench, planted):
    replay = bench.replay_fork_cow(_manager(planted), P, HISTORY)
    assert (replay.held, replay.copies) != (sum(TREE), COPIES)


@pytest.fixture(scope="module")
def tiny_llm():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=3, std=0.5)
    return LLM(model, block_size=BS, num_gpu_blocks=256)


def test_the_engine_counts_prefix_cached_blocks_inside_the_step(bench, tiny_llm):
    """Each step's beams as one-token requests, as beam search submits them: the engine's count
    inside the step is the beams' full-block prefixes plus their partial blocks; after the step
    every request has finished and freed its blocks, so the after-step peak sees nothing."""
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    for beams in bench.search_steps(P, HISTORY):
        tiny_llm.generate(beams, one_token)
        stats = tiny_llm.last_stats
        assert stats.num_steps == 1
        assert stats.num_kv_block_steps == stats.peak_kv_blocks_in_step
        assert stats.num_kv_block_steps == bench.prefix_cached_blocks(beams, BS)
        assert stats.peak_kv_blocks_in_use == 0


def test_a_real_search_is_counted_alike_by_the_engine_and_from_its_beams(bench, tiny_llm):
    row = bench.measure_real_beams(tiny_llm, "tiny", [[7, 3, 9, 1, 4, 4]], width=3, max_tokens=7)
    assert row.mean_steps == 7
    assert row.prefix_caching == row.prefix_caching_from_beams == row.fork_cow
    assert 0 < row.fork_cow < row.no_sharing
    assert row.saved_prefix_caching == pytest.approx(1 - row.prefix_caching / row.no_sharing)
    out = tiny_llm.beam_search([[7, 3, 9, 1, 4, 4]], BeamSearchParams(beam_width=3, max_tokens=7))
    steps = bench.search_steps([7, 3, 9, 1, 4, 4], out[0].beam_history)
    assert row.no_sharing == sum(bench.unshared_blocks(b, BS) for b in steps)
    assert row.fork_cow == sum(bench.tree_blocks(b, BS) for b in steps)
