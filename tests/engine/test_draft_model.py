"""The draft-model proposer: its config, the lookahead slots it needs, and its own KV cache.

Greedy equality in every engine configuration, with a draft identical to the target (every
draft accepted), is in ``test_engine_correctness.py``; the distribution under sampling in
``test_speculative.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mini_vllm.config import EngineConfig, SchedulerConfig, SpeculativeConfig, kv_block_bytes
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.loader import DRAFT_CHECKPOINT, load_draft_model
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.draft_model import DraftModelProposer

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_the_config_needs_exactly_one_draft_and_counts_lookahead_slots():
    with pytest.raises(ValueError, match="needs a draft"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig(method="draft_model", model="x", num_draft_layers=2)
    with pytest.raises(ValueError, match="for method 'draft_model', not 'ngram'"):
        SpeculativeConfig(method="ngram", num_draft_layers=2)
    with pytest.raises(ValueError, match="num_draft_layers must be an int >= 1"):
        SpeculativeConfig(method="draft_model", num_draft_layers=0)
    with pytest.raises(ValueError, match="draft_sample_method must be one of"):
        SpeculativeConfig(method="draft_model", num_draft_layers=1, draft_sample_method="top")
    with pytest.raises(ValueError, match="are for method 'draft_model'"):
        SpeculativeConfig(method="ngram", draft_sample_method="probabilistic")
    assert SpeculativeConfig(method="draft_model", num_draft_layers=1,
                             num_speculative_tokens=3).num_lookahead_tokens == 3
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).num_lookahead_tokens == 0


def test_a_kv_cache_budget_pays_for_the_draft_cache_too(tiny_model):
    draft = tiny_model.first_layers(1)
    spec = {"method": "draft_model", "num_draft_layers": 1, "num_speculative_tokens": 2}
    per_block = kv_block_bytes(tiny_model, 16) + kv_block_bytes(draft, 16)
    config = EngineConfig(kv_cache_memory=10 * per_block, speculative_config=spec)
    scheduler_config = config.scheduler_config(tiny_model, draft)
    assert scheduler_config.num_gpu_blocks == 10
    assert scheduler_config.num_lookahead_tokens == 2
    assert EngineConfig().scheduler_config(tiny_model).num_lookahead_tokens == 0


def test_a_running_request_claims_lookahead_slots_for_its_drafts():
    """After its prefill, each decode step claims blocks for the step's tokens plus
    ``num_lookahead_tokens`` more: room for the draft the model writes past the last token."""
    block = 4
    scheduler = Scheduler(SchedulerConfig(block_size=block, num_gpu_blocks=32,
                                          max_num_batched_tokens=64, max_model_len=64,
                                          num_lookahead_tokens=3))
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=20),
                      eos_token_id=None, block_hasher=get_request_block_hasher(block, sha256))
    scheduler.add_request(request)
    out = scheduler.schedule()
    # Admission claims no lookahead (as upstream: a new request has not drafted yet).
    assert len(out.scheduled_new_reqs[0].block_ids[0]) == 2
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], {"r": 0}, [[9]]))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 1}
    held = scheduler.kv_cache_manager.get_block_ids("r")[0]
    # Position 8 is computed now; positions 9, 10, 11 are the lookahead: 12 slots, 3 blocks.
    assert len(held) * block >= 8 + 1 + 3 and len(held) == 3


def test_the_draft_is_loaded_by_name_and_must_share_the_vocabulary(tiny_model):
    shipped = LLM().model
    draft = load_draft_model(SpeculativeConfig(method="draft_model",
                                               model="tiny_shakespeare_draft"), shipped)
    assert draft.config.vocab_size == shipped.config.vocab_size
    assert draft.config.num_hidden_layers < shipped.config.num_hidden_layers
    assert DRAFT_CHECKPOINT.with_suffix(".safetensors").exists()
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        load_draft_model(SpeculativeConfig(method="draft_model", model=tiny_model), shipped)
    layers = tiny_model.config.num_hidden_layers
    with pytest.raises(ValueError, match="must be shallower than the target"):
        load_draft_model(SpeculativeConfig(method="draft_model", num_draft_layers=layers),
                         tiny_model)


def test_a_self_speculative_draft_shares_the_targets_weights(tiny_model):
    draft = tiny_model.first_layers(1)
    assert draft.config.num_hidden_layers == 1
    assert draft.model.layers[0] is tiny_model.model.layers[0]
    assert draft.lm_head.weight.data_ptr() == tiny_model.lm_head.weight.data_ptr()
    assert draft.model.embed_tokens is tiny_model.model.embed_tokens
    with pytest.raises(ValueError, match="num_layers must be in"):
        tiny_model.first_layers(0)


def _model(vocab: int = 64) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=64, max_position_embeddings=64))
    init_weights(model, seed=3)
    return model.eval()


def test_the_proposer_writes_only_through_the_block_table_and_stays_inside_it():
    """Drafts are capped where the block table ends (its lookahead slots) and by
    ``max_model_len``; the draft cache is written only in the blocks the tables name."""
    drafter = DraftModelProposer(_model(), num_speculative_tokens=4, block_size=4,
                                 num_blocks=8, max_model_len=20)
    # r0: 6 tokens in blocks [3, 5] (8 slots): drafts read off positions 5, 6, 7, 8 need the
    # feed-back writes of positions 6, 7, 8: slot 8 is past the table, so 3 drafts.
    # r1: 17 tokens, 5 blocks (20 slots) but max_model_len 20: positions 17, 18, 19 only.
    drafts = drafter.propose(["r0", "r1"], [[1, 2, 3, 4, 5, 6], list(range(17))],
                             [[3, 5], [1, 2, 4, 6, 7]], [4, 4])
    assert [len(d) for d in drafts] == [3, 3]
    assert drafter.num_computed == {"r0": 6, "r1": 17}
    untouched = [0]  # the null block; every other block is in one of the tables
    for key_cache, value_cache in drafter.kv_caches:
        assert not key_cache[untouched].any() and not value_cache[untouched].any()
        assert key_cache[[3, 5, 1, 2, 4, 6, 7]].any()
    assert drafter.propose(["r0"], [[1, 2, 3, 4, 5, 6, 7]], [[3, 5]], [0]) == [[]]


def test_the_proposer_starts_a_request_over_when_its_blocks_move():
    drafter = DraftModelProposer(_model(), num_speculative_tokens=2, block_size=4,
                                 num_blocks=8, max_model_len=64)
    tokens = [5, 6, 7, 8, 9]
    first = drafter.propose(["r"], [tokens], [[1, 2]], [2])
    drafter.invalidate_blocks([2])
    assert "r" not in drafter.num_computed
    # The same tokens in other blocks: recomputed from position 0, the same drafts.
    assert drafter.propose(["r"], [tokens], [[4, 6]], [2]) == first
    assert drafter.propose(["r"], [tokens + [1]], [[3, 6]], [2]) == drafter.propose(
        ["s"], [tokens + [1]], [[5, 7]], [2]), "a changed table must start the request over"


def test_greedy_with_the_shipped_draft_is_the_plain_output_and_often_accepted():
    prompts = ["KING.\n", "HAMLET.\nTo be, or not to be", "Enter Horatio and Marcellus.\n"]
    plain = LLM().generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(speculative_config={"method": "draft_model", "model": "tiny_shakespeare_draft",
                                  "num_speculative_tokens": 4, "draft_policy": "always"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    spec = llm.last_stats.spec_decoding
    # The draft was trained on the same text as the target: more than a third of its guesses
    # are the target's own (0.54 when this was written).
    assert spec.num_draft_tokens > 0 and spec.acceptance_rate > 0.35, spec


def test_the_cli_speculates_with_a_draft_model():
    run = [sys.executable, "-m", "mini_vllm", "generate", "--max-tokens", "20", "KING.\\n"]
    plain = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    spec = '{"method": "draft_model", "model": "tiny_shakespeare_draft"}'
    drafted = subprocess.run([*run, "--speculative-config", spec], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    text = [run.stdout.split("=" * 72)[1] for run in (plain, drafted)]
    assert text[0] == text[1] and "[finish: length, 20 tokens]" in text[0]
    assert "speculative decoding: " in drafted.stdout
    bad = subprocess.run([*run, "--speculative-config", '{"method": "draft_model"}'], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "needs a draft" in bad.stderr


def test_the_draft_cache_is_written_only_in_blocks_its_requests_hold(tiny_model, prompts):
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=12,
              speculative_config={"method": "draft_model", "num_draft_layers": 1,
                                  "num_speculative_tokens": 3, "draft_policy": "always"})
    drafter = llm.engine.model_runner.drafter
    assert isinstance(drafter, DraftModelProposer)
    held: set[int] = set()
    propose = drafter.propose

    def spy(req_ids, token_ids, block_ids, *rest):
        held.update(b for table in block_ids for b in table)
        return propose(req_ids, token_ids, block_ids, *rest)

    drafter.propose = spy
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    written = {b for b in range(64) if any(k[b].any() or v[b].any() for k, v in drafter.kv_caches)}
    assert written, "the draft wrote nothing"
    assert written <= held, f"blocks {sorted(written - held)} were written but never held"
    assert 0 not in held


def test_the_runner_tells_the_draft_which_requests_lost_their_draft_kv():
    """Finished and resumed requests are forgotten, and so are those holding a block a step
    swaps out, swaps in or copies into (the draft's K/V does not travel with the target's). The
    proposer also starts over on a changed block table; this covers the same block ids coming
    back after a preemption."""
    from mini_vllm.core.sched.output import CachedRequestData, SchedulerOutput
    from mini_vllm.worker.drafter import sync_draft_cache

    drafter = DraftModelProposer(_model(), num_speculative_tokens=2, block_size=4,
                                 num_blocks=16, max_model_len=64)
    tables = {"done": [1], "resumed": [2], "kept": [3], "out": [4], "in": [5], "copied": [6]}
    drafter.propose(list(tables), [[1, 2]] * len(tables), list(tables.values()),
                    [1] * len(tables))
    cached = CachedRequestData(req_ids=["resumed", "kept"], resumed_from_preemption=[True, False],
                               new_token_ids=[], new_block_ids=[None, None],
                               num_computed_tokens=[0, 2])
    step = SchedulerOutput([], cached, {}, 0, [], finished_req_ids={"done"},
                           blocks_to_swap_out=[(4, 1)], blocks_to_swap_in=[(2, 5)],
                           blocks_to_copy=[(9, 6)])
    sync_draft_cache(drafter, step)
    assert set(drafter.num_computed) == {"kept"}
    sync_draft_cache(None, step)  # no proposer: nothing to do


def test_sampled_drafts_come_with_their_distribution_and_follow_the_seed():
    """With a temperature, a request's drafts are draws from the draft's distribution at that
    temperature (kept for the rejection sampler, one row per draft); a greedy request's are the
    argmax, with no distribution. The same generator state gives the same drafts."""
    def propose(seed):
        drafter = DraftModelProposer(_model(), num_speculative_tokens=3, block_size=4,
                                     num_blocks=8, max_model_len=64)
        gen = torch.Generator().manual_seed(seed)
        drafts = drafter.propose(["hot", "cold"], [[1, 2, 3], [1, 2, 3]], [[1, 2], [3, 4]],
                                 [3, 3], temperatures=[2.0, 0.0], generators=[gen, None])
        return drafts, drafter.take_draft_probs(), drafter

    (hot, cold), probs, drafter = propose(0)
    assert set(probs) == {"hot"} and probs["hot"].shape == (3, 64)
    assert torch.allclose(probs["hot"].sum(-1), torch.ones(3, dtype=probs["hot"].dtype))
    assert all(probs["hot"][i, t] > 0 for i, t in enumerate(hot))
    assert drafter.take_draft_probs() == {}, "taken once"
    greedy = DraftModelProposer(_model(), num_speculative_tokens=3, block_size=4, num_blocks=8,
                                max_model_len=64).propose(["cold"], [[1, 2, 3]], [[3, 4]], [3])
    assert [cold] == greedy
    assert propose(0)[0] == [hot, cold]
    assert any(propose(seed)[0][0] != hot for seed in range(1, 6)), "draws depend on the seed"
