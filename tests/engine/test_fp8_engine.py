"""The engine with an FP8 (e4m3) KV cache: ``LLM(kv_cache_dtype="fp8")`` and the CLI flag.

The tiny model here has head_dim 16 (the fp8 key layout packs 16 elements per 16-byte vector)
and the large weight scale of the other engine tests, so that greedy choices are well separated.
"""

from __future__ import annotations

import math

import pytest
import torch

from mini_vllm import __main__ as cli
from mini_vllm.attention import cache_ops
from mini_vllm.config import kv_block_bytes
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import (
    LlamaForCausalLM,
    ModelConfig,
    greedy_reference,
    init_weights,
)
from mini_vllm.sampling_params import SamplingParams

from .conftest import make_prompts, make_tiny_model

CFG = ModelConfig(
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
)
MAX_TOKENS = 10


def make_model(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(5)
    model = LlamaForCausalLM(CFG)
    init_weights(model, seed=5, std=0.5)
    return model.to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return make_model()


def greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def fake_quant_reference(model, prompts, scales, run=None):
    """Greedy continuations by full recomputation (no cache) with every layer's keys and values
    rounded through e4m3 with its scales, written here: what an fp8 cache must give. ``run``
    (a function of the model) replaces the greedy continuations."""
    def quantized(attn, k_scale, v_scale):
        real = attn._qkv

        def qkv(positions, x):
            q, k, v = real(positions, x)
            k = ((k.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                 * k_scale).to(k.dtype)
            v = ((v.float() / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                 * v_scale).to(v.dtype)
            return q, k, v
        return qkv

    layers = model.model.layers
    try:
        for layer, (ks, vs) in zip(layers, scales):
            layer.self_attn._qkv = quantized(layer.self_attn, ks, vs)
        if run is not None:
            return run(model)
        return [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    finally:
        for layer in layers:
            del layer.self_attn._qkv


SCALES = [(0.08, 0.13), (0.08, 0.16)]  # about what calibration picks for these prompts


def test_fp8_engine_equals_the_reference_on_quantized_kv(model):
    prompts = make_prompts()
    llm = LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8", kv_scales=SCALES)
    runner = llm.engine.model_runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert runner.kv_caches[0][0].shape[-1] == 16  # x = 16 for one-byte elements
    assert greedy(llm, prompts) == fake_quant_reference(model, prompts, SCALES)
    assert "KV cache dtype: fp8 (float8_e4m3fn" in llm.last_stats.summary()


def test_the_no_cache_reference_with_kv_scales_is_the_fake_quantized_model(model):
    """forward_reference(ids, kv_scales), the engine exam's fp8 oracle, equals the model whose
    keys and values this file rounds through e4m3 itself; wrong scale counts are refused."""
    ids = torch.tensor(make_prompts()[0])
    want = fake_quant_reference(model, [], SCALES, run=lambda m: m.forward_reference(ids))
    assert torch.equal(model.forward_reference(ids, SCALES), want)
    assert not torch.equal(model.forward_reference(ids), want)
    with pytest.raises(ValueError, match="one \\(k_scale, v_scale\\) pair per layer"):
        model.forward_reference(ids, SCALES[:1])


def test_fp8_engine_with_calibrated_scales_starts_like_the_unquantized_one(model):
    """This random model is chaotic: once one greedy token differs the rest do too, so only the
    first token is compared with the unquantized reference (measured: the first token of every
    prompt agrees, the second of all but one). The full comparison is the test above."""
    prompts = make_prompts()
    ref = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    out = greedy(LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8"), prompts)
    assert [o[:1] for o in out] == [r[:1] for r in ref]


def test_scales_are_calibrated_once_from_the_first_step(model, monkeypatch):
    seen: list[tuple[float, float]] = []
    real = cache_ops.reshape_and_cache

    def spy(key, value, *args, **kwargs):
        seen.append((float(key.abs().max()), float(value.abs().max())))
        return real(key, value, *args, **kwargs)

    monkeypatch.setattr(cache_ops, "reshape_and_cache", spy)
    llm = LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8")
    assert llm.engine.model_runner.kv_scales == [None, None]
    prompts = make_prompts()[:3]
    greedy(llm, prompts)
    scales = llm.engine.model_runner.kv_scales
    # Upstream's calc_kv_scales: amax of the first batch over K_SCALE_CONSTANT (200) for keys
    # and V_SCALE_CONSTANT (100) for values; the first step holds every prompt token.
    for layer, (k_amax, v_amax) in enumerate(seen[: CFG.num_hidden_layers]):
        assert math.isclose(scales[layer][0], k_amax / 200, rel_tol=1e-6)
        assert math.isclose(scales[layer][1], v_amax / 100, rel_tol=1e-6)
    greedy(llm, [[1, 2, 3]])
    assert llm.engine.model_runner.kv_scales == scales  # once, not per call


def test_given_scales_are_used_and_chunking_does_not_change_the_result(model):
    prompts = make_prompts()
    scales = SCALES
    whole = LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8", kv_scales=scales)
    assert whole.engine.model_runner.kv_scales == scales
    chunked = LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8", kv_scales=scales,
                  max_num_batched_tokens=8, enable_prefix_caching=False)
    one = LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8", kv_scales=(0.05, 0.03))
    assert one.engine.model_runner.kv_scales == [(0.05, 0.03)] * 2
    # Same cache contents, read in different step shapes (decode kernel vs chunked prefill).
    assert greedy(whole, prompts) == greedy(chunked, prompts)


def test_swap_preemption_moves_fp8_blocks(model):
    prompts = make_prompts()
    scales = SCALES
    roomy = greedy(LLM(model, num_gpu_blocks=64, kv_cache_dtype="fp8", kv_scales=scales),
                   prompts)
    tight = LLM(model, num_gpu_blocks=16, block_size=4, kv_cache_dtype="fp8",
                kv_scales=scales, preemption_mode="swap", num_cpu_blocks=64,
                enable_prefix_caching=False)
    assert greedy(tight, prompts) == roomy
    assert tight.last_stats.num_blocks_swapped_out > 0
    assert tight.engine.model_runner.cpu_kv_caches[0][0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype,factor", [(torch.bfloat16, 2), (torch.float16, 2),
                                          (torch.float32, 4)])
def test_a_memory_budget_holds_twice_the_blocks_of_a_16_bit_cache(dtype, factor):
    model = make_model(dtype)
    per_block = kv_block_bytes(model, 16)
    assert kv_block_bytes(model, 16, "fp8") * factor == per_block
    budget = 40 * per_block + per_block // 3  # not a whole number of blocks
    auto = LLM(model, kv_cache_memory=budget)
    fp8 = LLM(model, kv_cache_memory=budget, kv_cache_dtype="fp8")
    assert auto._scheduler_config.num_gpu_blocks == 40
    assert fp8._scheduler_config.num_gpu_blocks == 40 * factor + (per_block // 3) // (
        per_block // factor)
    assert fp8.engine.model_runner.kv_cache_bytes <= budget
    assert auto.engine.model_runner.kv_cache_bytes <= budget
    greedy(fp8, [[1, 2, 3, 4, 5]])
    stats = fp8.last_stats
    assert stats.kv_blocks_total == fp8._scheduler_config.num_gpu_blocks - 1
    assert stats.kv_cache_dtype == "fp8" and stats.kv_cache_torch_dtype == "float8_e4m3fn"
    assert stats.kv_block_bytes == per_block // factor


@pytest.mark.parametrize("kwargs,match", [
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype"),
    ({"kv_scales": (1.0, 1.0)}, "kv_cache_dtype='fp8'"),
    ({"kv_cache_dtype": "fp8", "kv_scales": (0.0, 1.0)}, "finite and > 0"),
    ({"kv_cache_dtype": "fp8", "kv_scales": (1.0, float("nan"))}, "finite and > 0"),
    ({"kv_cache_dtype": "fp8", "kv_scales": (1.0, -2.0)}, "finite and > 0"),
    ({"kv_cache_dtype": "fp8", "kv_scales": (1.0,)}, "pair"),
    ({"kv_cache_dtype": "fp8", "kv_scales": [(1.0, 1.0)] * 3}, "one pair per layer"),
])
def test_bad_kv_cache_settings_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, num_gpu_blocks=16, **kwargs)


def test_fp8_needs_a_head_dim_that_is_a_multiple_of_16():
    narrow = make_tiny_model()  # head_dim 8
    LLM(narrow, num_gpu_blocks=16)  # fine in the model's dtype
    with pytest.raises(ValueError, match="multiple of x=16"):
        LLM(narrow, num_gpu_blocks=16, kv_cache_dtype="fp8")


def test_cli_flag(capsys):
    assert cli.main(["generate", "HAMLET.\\n", "--max-tokens", "5", "--kv-cache-dtype", "fp8",
                     "--kv-cache-memory", "600000"]) == 0
    out = capsys.readouterr().out
    assert "KV cache dtype: fp8 (float8_e4m3fn" in out
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--kv-cache-dtype", "int8"])
