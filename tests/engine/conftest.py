"""Shared fixtures of the engine tests: a tiny randomly initialised model and its references.

The model is small enough that a whole engine run takes seconds on a CPU, and initialised with
a large weight scale so that its logits are well separated: greedy choices then do not hinge on
float rounding, and "the engine picks exactly the reference's tokens" is a fair demand.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import random

import pytest
import torch

from mini_vllm.model_executor.models.llama import (
    LlamaForCausalLM,
    ModelConfig,
    greedy_reference,
    init_weights,
)

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
)
MAX_TOKENS = 10


def make_tiny_model(seed: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    init_weights(model, seed=seed, std=0.5)
    return model.eval().requires_grad_(False)


def make_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts of different lengths, two of them sharing a 20-token prefix with a third."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(n)] for n in (5, 17, 33, 2, 41)]
    prompts.append(prompts[2][:20] + [1, 2, 3])
    prompts.append(prompts[2][:24] + [4])
    return prompts


def counting(monkeypatch, owner, name) -> list[str]:
    """Wrap ``owner.name`` (a module's function, or a class's method) so that every call is
    recorded in the returned list, then runs the original; undone with the test."""
    calls = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return make_tiny_model()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def reference_outputs(tiny_model, prompts) -> list[list[int]]:
    """Greedy continuations by full recomputation, no cache: the oracle."""
    return [greedy_reference(tiny_model, p, MAX_TOKENS) for p in prompts]


# The tests that start processes of their own (tensor-parallel workers, engine cores of a
# disaggregated pair or of routed engines) or shared-memory stores.
_LEAVE_NOTHING = ("test_tensor_parallel", "test_disaggregated", "test_router")


@pytest.fixture(autouse=True)
def _nothing_left_behind(request):
    """After each test of the modules above: no child process of this worker still runs, and no
    KV-store segment named for this worker (DisaggregatedLLM's default prefix holds its pid) is
    left in /dev/shm."""
    yield
    if request.module.__name__.rpartition(".")[2] not in _LEAVE_NOTHING:
        return
    children = [p.name for p in mp.active_children()]
    segments = glob.glob(f"/dev/shm/mini_vllm_kv_{os.getpid()}_*")
    assert not children and not segments, (
        f"left behind by this test: processes {children}, shared-memory segments {segments}")

