"""Weights moved onto huge pages (``mini_vllm.utils.huge_pages``): the same model, on other memory.

The move must keep every value, every name, every fusion (q/k/v and gate/up stay views of one
tensor) and every tie (the LM head that is the embedding), leave the tokens as they were, and
be skipped where the OS offers no huge pages.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import fused_weight
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.utils import huge_pages

from .conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not huge_pages.offered(),
                                reason="this OS offers no transparent huge pages")


def anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_the_move_keeps_values_fusions_and_ties():
    model = make_tiny_model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's head is
    model.fuse_projections()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    moved = model.move_weights_to_huge_pages()
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # One arena: every weight lies within `moved` bytes of the first.
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert max(ptrs) - min(ptrs) < moved
    assert fused_weight(attn._qkv_fused, (attn.q_proj, attn.k_proj, attn.v_proj)) is not None
    assert fused_weight(mlp._gate_up_fused, (mlp.gate_proj, mlp.up_proj)) is not None
    assert attn._qkv_fused[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_engine_s_weights_are_on_huge_pages_and_give_the_same_tokens(tiny_model, prompts,
                                                                        reference_outputs):
    big = make_tiny_model()
    big.lm_head = torch.nn.Linear(32, 64 * 1024, bias=False)  # 8 MB: room for huge pages
    before = anon_huge_kb()
    LLM(big, block_size=16, num_gpu_blocks=64)
    assert anon_huge_kb() - before >= 2048, "no 2 MB page backs the weights"
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] \
        == reference_outputs


def test_no_move_where_the_os_offers_no_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "offered", lambda: False)
    model = make_tiny_model()
    ptr = model.model.embed_tokens.weight.data_ptr()
    LLM(model, block_size=16, num_gpu_blocks=64)
    assert model.model.embed_tokens.weight.data_ptr() == ptr
