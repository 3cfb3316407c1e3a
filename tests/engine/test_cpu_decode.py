"""The fused step (``mini_vllm.worker.cpu_decode``): a step of a few tokens as one compiled call.

It must compute what the model's modules compute op by op (hidden rows to fp32 rounding, the same
K/V in the cache), for decodes and for short prefill chunks alike, give the reference's tokens
with every weight format, refuse bad metadata before it writes anything, and step aside whenever
the op-by-op path is what must run: a student's piece in place (for a prefill, the lab 03-02
attention too), a forward hook, ``enforce_eager=True``, or more tokens than its products take.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.attention import backend, cpu_kernels, paged_attn
from mini_vllm.attention.metadata import build_attention_metadata
from mini_vllm.config import EngineConfig
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import greedy_reference
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.cpu_decode import FusedDecode

from .conftest import counting, make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason="no C compiler here: the engine uses the PyTorch ops")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("weight_dtype", ["auto", "bfloat16", "q4_1", "q8_0"])
def test_decode_steps_run_fused_and_give_the_reference_tokens(monkeypatch, prompts,
                                                              weight_dtype):
    if weight_dtype.startswith("q"):
        pytest.importorskip("gguf")  # quantizes the weights
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    eager_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    model = make_tiny_model()
    llm = LLM(model, weight_dtype=weight_dtype, block_size=16, num_gpu_blocks=64)
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]
    assert run(llm, prompts) == want
    assert fused_calls
    # The decode steps are all fused (at most 7 rows): the compiled op-by-op decode never runs.
    assert not eager_calls


def decode_batch(llm, context_lens, seed=0, query_lens=None):
    """A step of ``query_lens`` new tokens (default 1: a decode) after ``context_lens`` earlier
    ones each (caches filled with random K/V, each sequence in its own blocks, the null block
    NaN), and its metadata."""
    g = torch.Generator().manual_seed(seed)
    runner = llm.engine.model_runner
    for key_cache, value_cache in runner.kv_caches:
        key_cache.copy_(torch.randn(key_cache.shape, generator=g))
        value_cache.copy_(torch.randn(value_cache.shape, generator=g))
        key_cache[0].fill_(float("nan"))  # the null block: never read
        value_cache[0].fill_(float("nan"))
    ids = [f"r{i}" for i in range(len(context_lens))]
    query_lens = query_lens or [1] * len(ids)
    next_block, block_ids = 1, {}
    for req, n, q in zip(ids, context_lens, query_lens):
        used = (n + q - 1) // 16 + 1  # room for the new tokens
        block_ids[req] = list(range(next_block, next_block + used))
        next_block += used
    meta = build_attention_metadata(ids, dict(zip(ids, query_lens)),
                                    dict(zip(ids, context_lens)), block_ids, 16)
    input_ids = torch.randint(0, llm.model.config.vocab_size, (sum(query_lens),), generator=g)
    return runner, input_ids, meta


def caches_of(runner):
    return [tuple(t.clone() for t in layer) for layer in runner.kv_caches]


@pytest.mark.parametrize("weight_dtype, context_lens, query_lens", [
    ("auto", [0, 15, 16, 40], None),
    ("q4_1", [0, 15, 16, 40], None),
    # Two decodes, a chunk crossing a block boundary after 14 cached tokens, a whole prompt.
    ("auto", [30, 7, 14, 0], [1, 1, 3, 3]),
    ("q4_1", [30, 7, 14, 0], [1, 1, 3, 3]),
])
def test_a_fused_step_computes_what_the_modules_compute(weight_dtype, context_lens, query_lens):
    llm = LLM(make_tiny_model(), weight_dtype=weight_dtype, block_size=16, num_gpu_blocks=64)
    runner, input_ids, meta = decode_batch(llm, context_lens, query_lens=query_lens)
    assert runner.fused_decode.applies(meta.num_actual_tokens)
    before = caches_of(runner)
    eager = runner.model(input_ids, meta.positions, runner.kv_caches, meta, runner.attn_backend)
    eager_caches = caches_of(runner)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        k.copy_(k0)
        v.copy_(v0)
    fused = runner.fused_decode.step(input_ids, meta)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for (k, v), (ke, ve) in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(k, ke, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(v, ve, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_two_threads_give_one_thread_s_bits():
    llm = LLM(make_tiny_model(), block_size=16, num_gpu_blocks=64)
    runner, input_ids, meta = decode_batch(llm, [3, 30, 47])
    before = caches_of(runner)
    args = (input_ids, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = runner.fused_decode(*args)
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        torch.set_num_threads(2)
        two = runner.fused_decode(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("field, value, message", [
    ("slot_mapping", 64 * 16, r"^slot_mapping\[1\] is outside the cache$"),
    ("positions", 256, r"^positions\[1\] is beyond the model's max_position_embeddings$"),
    ("seq_lens", 0, r"^seq_lens\[1\] is not in 1 \.\. the tokens its block table row holds$"),
    ("block_tables", 64, r"^block_tables row 1 names a block outside the cache$"),
])
def test_bad_metadata_is_refused_before_anything_is_written(field, value, message):
    llm = LLM(make_tiny_model(), block_size=16, num_gpu_blocks=64)
    runner, input_ids, meta = decode_batch(llm, [3, 20, 5])
    tensors = {name: getattr(meta, name).clone()
               for name in ("positions", "slot_mapping", "block_tables", "seq_lens")}
    if field == "block_tables":
        tensors[field][1, 0] = value
    else:
        tensors[field][1] = value
    before = caches_of(runner)
    with pytest.raises(ValueError, match=message):
        runner.fused_decode(input_ids, tensors["positions"], tensors["slot_mapping"],
                            tensors["block_tables"], tensors["seq_lens"])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k.nan_to_num(), k0.nan_to_num())
        assert torch.equal(v.nan_to_num(), v0.nan_to_num())


def test_enforce_eager_runs_every_step_op_by_op(monkeypatch, tiny_model, prompts,
                                                reference_outputs):
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    eager_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64, enforce_eager=True)
    assert llm.engine.model_runner.fused_decode is None
    assert run(llm, prompts) == reference_outputs
    assert eager_calls and not fused_calls
    with pytest.raises(TypeError, match=r"^EngineConfig: enforce_eager must be True or False"):
        EngineConfig(enforce_eager="yes")


def test_a_student_piece_or_a_forward_hook_turns_the_fused_step_off(monkeypatch, prompts):
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    model = make_tiny_model()
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]
    # A stand-in for the student's piece.
    piece_calls = counting(monkeypatch, paged_attn, "forward_decode")
    assert not backend._reference_pieces_in_place()
    assert run(LLM(model, block_size=16, num_gpu_blocks=64), prompts) == want
    assert piece_calls and not fused_calls
    monkeypatch.undo()
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    rows = []
    # A hook on one layer's MLP: the fused step would never call it.
    model.model.layers[1].mlp.register_forward_hook(
        lambda module, args, out: rows.append(out.shape[0]))
    assert run(LLM(model, block_size=16, num_gpu_blocks=64), prompts) == want
    # The hook saw every decode step of the seven requests.
    assert not fused_calls and rows.count(len(prompts)) == GREEDY.max_tokens - 1


def test_a_short_prompt_s_prefill_is_fused_too(monkeypatch, tiny_model, prompts,
                                               reference_outputs):
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    eager_writes = counting(monkeypatch, cpu_kernels, "reshape_and_cache")
    short = [p for p in prompts if len(p) <= 8]
    want = [r for p, r in zip(prompts, reference_outputs) if len(p) <= 8]
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert [run(llm, [p])[0] for p in short] == want
    # Every step of every request, its prefill included, is one fused call.
    assert len(fused_calls) == len(short) * GREEDY.max_tokens and not eager_writes


def test_a_student_s_prefill_attention_keeps_prefill_steps_op_by_op(monkeypatch, tiny_model,
                                                                     prompts,
                                                                     reference_outputs):
    """A prompt short enough for the fused step still runs the student's lab 03-02 attention
    when it is in place; the decode steps, which do not call it, stay fused."""
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    # A stand-in for the student's piece, bound where the runner looks it up.
    piece_calls = counting(monkeypatch, backend, "chunked_prefill_attention")
    assert backend._reference_pieces_in_place()
    assert not backend._reference_pieces_in_place(prefill=True)
    short = [p for p in prompts if len(p) <= 8]
    want = [r for p, r in zip(prompts, reference_outputs) if len(p) <= 8]
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert [run(llm, [p])[0] for p in short] == want
    assert len(piece_calls) == len(short) * tiny_model.config.num_hidden_layers
    assert len(fused_calls) == len(short) * (GREEDY.max_tokens - 1)


def test_more_rows_than_the_products_take_run_op_by_op(monkeypatch):
    """fp32 products of more than 8 rows are PyTorch's GEMM: a 12-sequence decode is eager."""
    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    model = make_tiny_model()
    llm = LLM(model, block_size=16, num_gpu_blocks=64)
    assert llm.engine.model_runner.fused_decode.max_rows == 8
    prompts = [[i, i + 1, i + 2] for i in range(12)]
    want = [greedy_reference(model, p, 4) for p in prompts]
    assert run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=4)) == want
    assert not fused_calls


@pytest.mark.parametrize("flags, fused", [([], True), (["--enforce-eager"], False)])
def test_the_cli_s_enforce_eager_flag(monkeypatch, capsys, flags, fused):
    from mini_vllm.__main__ import main

    fused_calls = counting(monkeypatch, FusedDecode, "__call__")
    assert main(["generate", *flags, "--max-tokens", "4", "To be"]) == 0
    assert bool(fused_calls) == fused
    assert "To be" in capsys.readouterr().out
