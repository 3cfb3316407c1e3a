"""The engine with lab 02-07's Triton kernel as its attention (``attention_backend="triton"``):
the default backend's tokens, on a tiny GQA model under chunked prefill and preemption and on
the shipped model; bad choices refused with a sentence. On a CPU the kernel runs in Triton's
interpreter (slow), so the runs are short."""

from __future__ import annotations

import importlib.util

import pytest

from mini_vllm.config import EngineConfig
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

from .conftest import counting

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton ships wheels for Linux only")


def _tokens(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("knobs", [dict(max_num_batched_tokens=16),
                                   dict(block_size=4, num_gpu_blocks=24,
                                        max_num_batched_tokens=16)],
                         ids=["chunked-prefill", "preemption"])
def test_the_default_backend_s_tokens_on_a_gqa_model(tiny_model, prompts, knobs, monkeypatch):
    """4 query heads on 2 KV heads; prefill chunks of 16 tokens beside decodes, and (blocks of
    4 and a small pool) preemption, so the kernel sees mixed batches and recomputed prefixes."""
    from mini_vllm.attention import triton_unified

    knobs = dict(max_model_len=128, **knobs)
    expected = _tokens(LLM(tiny_model, **knobs), prompts[:4], 6)
    calls = counting(monkeypatch, triton_unified, "unified_attention")
    assert _tokens(LLM(tiny_model, attention_backend="triton", **knobs), prompts[:4], 6) \
        == expected, "the Triton backend's greedy tokens differ from the default backend's"
    assert calls, "the Triton backend never called the kernel"


def test_the_default_backend_s_tokens_on_the_shipped_model():
    prompts = ["To be, or not", "ROMEO:\nWhat light"]
    expected = _tokens(LLM(), prompts, 4)
    assert _tokens(LLM(attention_backend="triton"), prompts, 4) == expected, (
        "the Triton backend's greedy tokens on the shipped model differ from the default's")


def test_bad_choices_say_what_to_do():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="leave kv_cache_dtype='auto'"):
        EngineConfig(attention_backend="triton", kv_cache_dtype="fp8")


def test_course_engine_runs_the_student_s_pieces_with_the_triton_backend():
    """`python -m course engine --labs 02-07 --attention-backend triton` composes lab 02-07's
    starter into the engine: the untouched starter's first piece is what stops it."""
    import subprocess
    import sys

    from course.labs.catalog import REPO_ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "course", "engine", "--labs", "02-07", "--attention-backend",
         "triton", "--max-tokens", "2", "--prompt", "ROMEO:"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "lab 02-07, task 1: implement load_q_tile" in proc.stdout, proc.stdout
