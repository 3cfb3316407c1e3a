"""The user-facing API: ``LLM.generate``, its configuration, its errors, and the CLI."""

from __future__ import annotations

import pytest

from mini_vllm.llm import LLM, kv_block_bytes
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def test_outputs_carry_text_ids_and_finish_reasons(tiny_model, prompts, reference_outputs):
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64)
    stop = reference_outputs[1][3]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop])]
    out = llm.generate(prompts[:2], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_outputs[0]
    assert out[0].outputs[0].finish_reason == "length"
    cut = reference_outputs[1].index(stop) + 1
    assert out[1].outputs[0].token_ids == reference_outputs[1][:cut]
    assert out[1].outputs[0].finish_reason == "stop" and out[1].outputs[0].stop_reason == stop
    assert out[1].prompt_token_ids == prompts[1]
    assert isinstance(out[0].text, str)
    m = out[0].metrics
    assert m["arrival_time"] <= m["first_token_time"] <= m["finished_time"]


def test_n_completions_per_prompt_with_seeds(tiny_model, prompts):
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    first = llm.generate(prompts[:2], params, use_tqdm=False)
    again = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [len(o.outputs) for o in first] == [3, 3]
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    assert ids(first) == ids(again), "seeded sampling is reproducible"
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1, "children differ"


def test_bad_input_is_rejected_before_anything_is_queued(tiny_model, prompts):
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=8, max_model_len=64)
    bad_calls = [
        ([prompts[0], []], GREEDY, "empty"),
        ([prompts[0], [1, 2, 999]], GREEDY, "outside the model's vocab"),
        ([prompts[0], [1] * 64], GREEDY, "max_model_len"),
        ([prompts[0]], SamplingParams(temperature=0.0, max_tokens=40), "KV cache holds"),
        ([prompts[0], prompts[1]], [GREEDY], "2 prompts but 1"),
    ]
    for prompt_list, params, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt_list, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.num_blocks_in_use == 0
    assert llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason


def test_config_checks_and_memory_budget(tiny_model):
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_model, num_gpu_blocks=8, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(tiny_model, preemption_mode="drop")
    with pytest.raises(ValueError, match="at least two"):
        LLM(tiny_model, kv_cache_memory=10)
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        LLM(object())
    per_block = kv_block_bytes(tiny_model, 16)
    llm = LLM(tiny_model, block_size=16, kv_cache_memory=10 * per_block + 5)
    assert llm.engine.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == 10
    assert llm.engine.model_runner.kv_cache_bytes == 10 * per_block


def test_cli_generates_readable_text_with_the_shipped_model(capsys):
    """The one test on the shipped checkpoint: the course's finale runs and reads like text."""
    from mini_vllm.__main__ import main

    assert main(["generate", "HAMLET.\\n", "KING.\\n", "--max-tokens", "48"]) == 0
    printed = capsys.readouterr().out
    for label in ("steps:", "tokens/s", "KV blocks in use", "prefix-cache hit rate", "preemptions"):
        assert label in printed
    body = printed.split("=" * 72)[1]
    letters = sum(c.isalpha() or c.isspace() for c in body)
    assert letters > 0.8 * len(body), f"the shipped model should write words:\n{body}"
    llm = LLM()
    again = llm.generate("HAMLET.\n", SamplingParams(temperature=0.0, max_tokens=48),
                         use_tqdm=False)
    assert again[0].text in body, "greedy CLI output equals LLM.generate's"


def test_cli_reports_bad_input(capsys):
    from mini_vllm.__main__ import main

    assert main(["generate", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
