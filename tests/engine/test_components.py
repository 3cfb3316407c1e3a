"""The engine's parts on their own: tokenizer, sampler, model paths (loading: test_loading.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course.labs.numerics import assert_close
from mini_vllm.attention.metadata import build_attention_metadata
from mini_vllm.model_executor.models.llama import ModelConfig
from mini_vllm.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tokenizers.tokenizer import ByteTokenizer
from mini_vllm.worker.model_runner import ModelRunner

# ----------------------------------------------------------------------------- tokenizer


@given(st.text())
def test_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True) + [tok.eos_token_id]) == text


def test_tokenizer_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ByteTokenizer().decode([65, 300])


# ----------------------------------------------------------------------------- sampler


def _meta(params, generators=None, banned=None):
    return SamplingMetadata.from_params(params, generators or {}, banned)


def test_greedy_rows_take_the_argmax_and_random_rows_stay_in_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1)]
    torch.manual_seed(0)
    for _ in range(20):
        out = Sampler()(logits, _meta(params))
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        assert int(out[1]) in logits[1].topk(3).indices.tolist()
        assert out[3] == logits[3].argmax(), "top_k=1 is greedy whatever the temperature"


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(kept[0]).tolist() == [True, False, False, False]
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    torch.manual_seed(1)
    out = Sampler()(logits, _meta([SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(out, minlength=3).float() / 4000
    # 4000 draws: the standard error of each frequency is below 0.008; allow five of them.
    assert_close(freq, probs, atol=0.04, rtol=0.0)


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0)] * 3

    def draw(row, batch_rows):
        g = torch.Generator().manual_seed(42)
        out = Sampler()(logits[batch_rows], _meta(params[: len(batch_rows)],
                                                  {batch_rows.index(row): g}))
        return int(out[batch_rows.index(row)])

    assert draw(1, [1]) == draw(1, [0, 1, 2]) == draw(1, [2, 1])


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 5)
    logits[0, 3] = 10.0
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0)], banned=[[3]]))
    assert int(out[0]) != 3


def test_sampler_rejects_a_row_count_mismatch():
    with pytest.raises(ValueError, match="one row per request"):
        Sampler()(torch.zeros(2, 5), _meta([SamplingParams(temperature=0.0)]))


# ----------------------------------------------------------------------------- model


def test_paged_forward_equals_the_no_cache_forward(tiny_model, prompts):
    """Two chunks of one prompt through the paged cache give the reference's logits."""
    prompt = prompts[4]
    runner = ModelRunner(tiny_model, block_size=4, num_gpu_blocks=32)
    blocks = list(range(1, 1 + -(-len(prompt) // 4)))
    ref = tiny_model.forward_reference(torch.tensor(prompt))
    got = []
    for start, end in ((0, 17), (17, len(prompt))):
        meta = build_attention_metadata(["r"], {"r": end - start}, {"r": start}, {"r": blocks}, 4)
        hidden = tiny_model(torch.tensor(prompt[start:end]), meta.positions, runner.kv_caches,
                            meta, runner.attn_backend)
        got.append(tiny_model.compute_logits(hidden))
    assert_close(torch.cat(got), ref, msg="chunked paged prefill vs no-cache forward")


def test_model_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(hidden_size=30, num_attention_heads=4)


def test_positions_beyond_the_model_are_an_error(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model.forward_reference(torch.zeros(300, dtype=torch.long))


# ----------------------------------------------------------------------------- import


def test_import_mini_vllm_does_not_import_torch():
    code = "import sys, mini_vllm; assert 'torch' not in sys.modules; print(mini_vllm.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
