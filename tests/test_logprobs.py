"""``SamplingParams.logprobs`` and ``prompt_logprobs`` equal ``log_softmax`` of a no-cache forward.

Every decode path the engine has computes them: the PyTorch ops (block size 4, which the CPU
kernels do not take), the compiled CPU kernels (block size 16), an fp8 cache (against the no-cache
forward with keys and values rounded through e4m3), a composed engine (a stand-in student's
scheduler and attention piece around the reference runner), and chunked prefill with preemption.
Each request samples at temperature 1.5 with a seed, so the sampled token is often not the most
likely one: its entry must be there anyway, with its true rank.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

from course.labs.loader import load_script
from course.labs.numerics import assert_close, tolerances
from mini_vllm.attention import cpu_kernels, paged_attn
from mini_vllm.core.sched import scheduler as scheduler_module
from mini_vllm.engine import core as core_module
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.logprobs import Logprob
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.sampling_params import SamplingParams

CFG = ModelConfig(  # head_dim 16, so that the fp8 cache takes it too
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
)
FP8_SCALES = [(0.08, 0.13), (0.08, 0.16)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(5)
    m = LlamaForCausalLM(CFG)
    init_weights(m, seed=5, std=0.5)
    return m.eval().requires_grad_(False)


def make_prompts() -> list[list[int]]:
    """Lengths inside, at and across block boundaries; two share a 20-token prefix."""
    rng = random.Random(7)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (1, 5, 16, 33)]
    prompts.append(prompts[3][:20] + [3, 4])
    return prompts


def params(i: int, k: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.5, seed=100 + i, max_tokens=MAX_TOKENS, logprobs=k,
                          prompt_logprobs=k, ignore_eos=True)


def check_against_no_cache_forward(model, outputs, k: int = 3, kv_scales=None) -> None:
    """Each generated position: the sampled token and the top-k with the no-cache forward's
    log-probabilities and ranks; each prompt position after the first: the same for the prompt
    token; the cumulative log-probability sums the sampled tokens'."""
    for out in outputs:
        completion = out.outputs[0]
        prompt, generated = out.prompt_token_ids, completion.token_ids
        ids = torch.tensor(prompt + generated[:-1])
        logits = model.forward_reference(ids, kv_scales).double()
        want = torch.log_softmax(logits, dim=-1)
        positions = [(len(prompt) - 1 + t, tok, completion.logprobs[t])
                     for t, tok in enumerate(generated)]
        assert len(completion.logprobs) == len(generated)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        positions += [(p - 1, prompt[p], out.prompt_logprobs[p]) for p in range(1, len(prompt))]
        for row, own, got in positions:
            expected = want[row]
            top = expected.topk(k).indices.tolist()
            assert list(got)[:1] == [own], "the position's own token must come first"
            assert set(got) == {own, *top}, f"row {row}: tokens {sorted(got)}, want {own}+{top}"
            # float32's tolerance on the scale of the logits: a log-probability is a logit less
            # a logsumexp of that size, so it carries their rounding (this model's logits reach
            # about 17, and paged attention sums in another order than the no-cache forward).
            atol, rtol = tolerances(torch.float32)
            assert_close(torch.tensor([got[t].logprob for t in got], dtype=torch.float64),
                         expected[list(got)], atol=atol * max(1.0, float(logits[row].abs().max())),
                         rtol=rtol, msg=f"row {row}")
            assert got[own].rank == int((expected >= expected[own]).sum())
            assert [got[t].rank for t in top] == list(range(1, k + 1))
        assert completion.cumulative_logprob == pytest.approx(
            sum(completion.logprobs[t][tok].logprob for t, tok in enumerate(generated)))


def generate(llm: LLM, prompts, k: int = 3):
    return llm.generate(prompts, [params(i, k) for i in range(len(prompts))], use_tqdm=False)


def test_pytorch_ops_path(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=128)
    assert llm.engine.model_runner.attn_backend.cpu_kernels is None
    outputs = generate(llm, make_prompts())
    check_against_no_cache_forward(model, outputs)
    # The seeds make the sampled token differ from the most likely one somewhere: the dict then
    # holds k + 1 entries, the sampled token with a rank above 1.
    ranks = [lp[tok].rank for o in outputs
             for lp, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    assert max(ranks) > 3 and min(ranks) == 1


@pytest.mark.skipif(cpu_kernels.load() is None,
                    reason="no C compiler here: the engine uses the PyTorch ops")
def test_cpu_kernels_path(model):
    llm = LLM(model, block_size=16, num_gpu_blocks=64)
    assert llm.engine.model_runner.attn_backend.cpu_kernels is not None
    check_against_no_cache_forward(model, generate(llm, make_prompts()))


def test_fp8_cache_path(model):
    llm = LLM(model, block_size=16, num_gpu_blocks=64, kv_cache_dtype="fp8",
              kv_scales=FP8_SCALES)
    outputs = generate(llm, make_prompts())
    check_against_no_cache_forward(model, outputs, kv_scales=FP8_SCALES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_cuda_path():
    """The compiled CUDA kernels' path: a model whose head size (64) they are built for, since
    the engine runs the PyTorch ops for any other."""
    torch.manual_seed(5)
    cpu = LlamaForCausalLM(dataclasses.replace(CFG, hidden_size=256))
    init_weights(cpu, seed=5, std=0.5)
    cpu = cpu.eval().requires_grad_(False)
    gpu = LlamaForCausalLM(cpu.config)
    gpu.load_state_dict(cpu.state_dict())
    llm = LLM(gpu.cuda().eval(), device="cuda", block_size=16, num_gpu_blocks=64,
              use_cuda_ops=True)
    outputs = generate(llm, make_prompts())
    check_against_no_cache_forward(cpu, outputs)


def private_copy(module, folder: Path):
    """``module``'s source imported from another file, as the engine exam's stand-in students
    do: the engine must treat it as somebody else's piece."""
    path = folder / f"{module.__name__.replace('.', '_')}_copy.py"
    path.write_text(Path(module.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    copy = load_script(path.stem, path)
    del sys.modules[path.stem]
    return copy


def test_composed_engine_with_a_students_scheduler_and_attention(model, monkeypatch, tmp_path):
    """Log-probabilities do not travel through the scheduler or the engine step (a student may
    have written them): a stand-in scheduler and decode piece leave them intact."""
    student_scheduler = private_copy(scheduler_module, tmp_path).Scheduler
    monkeypatch.setattr(core_module, "Scheduler", student_scheduler)
    monkeypatch.setattr(paged_attn, "forward_decode",
                        private_copy(paged_attn, tmp_path).forward_decode)
    llm = LLM(model, block_size=16, num_gpu_blocks=64)
    assert isinstance(llm.engine.scheduler, student_scheduler)
    check_against_no_cache_forward(model, generate(llm, make_prompts()))


def test_chunked_prefill_preemption_and_whole_vocabulary(model):
    """Prompt rows arrive chunk by chunk; a preempted request recomputes its prompt without
    adding rows twice; ``-1`` reports every token of the vocabulary."""
    llm = LLM(model, block_size=4, num_gpu_blocks=14, max_num_batched_tokens=7)
    outputs = generate(llm, make_prompts()[2:], k=-1)
    assert llm.last_stats.num_preemptions > 0
    check_against_no_cache_forward(model, outputs, k=CFG.vocab_size)
    assert all(len(d) == CFG.vocab_size for o in outputs for d in o.outputs[0].logprobs)


def test_prompt_logprobs_skip_the_prefix_cache_and_others_still_hit(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt = make_prompts()[3]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], plain, use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)
    assert llm.last_stats.prefix_cache_hits == 0
    assert all(len(d) == 1 for d in out[0].prompt_logprobs[1:])  # the prompt token alone
    llm.generate([prompt], plain, use_tqdm=False)
    assert llm.last_stats.prefix_cache_hits > 0


class Letters:
    """A tokenizer for the 64-token model: token ``t`` is the letter ``chr(65 + t)``."""

    eos_token_id = None

    def encode(self, text):
        return [ord(c) - 65 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + t) for t in ids)


def test_without_logprobs_nothing_is_reported_and_decoded_tokens_are_text(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64, tokenizer=Letters())
    out = llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=2),
                       use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None
    assert out.outputs[0].cumulative_logprob is None
    out = llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=2, logprobs=0),
                       use_tqdm=False)[0]
    (entry,) = out.outputs[0].logprobs[0].values()
    assert isinstance(entry, Logprob) and entry.rank == 1
    assert entry.decoded_token == chr(65 + out.outputs[0].token_ids[0])


def test_a_runner_that_computes_no_logprobs_is_named(model, monkeypatch):
    """A runner written before log-probabilities (a student's lab 03-04 runner) must not give
    silently empty ones."""
    monkeypatch.setattr(core_module.ModelRunner, "_gather_sample_logprobs",
                        lambda self, *args: None)
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    with pytest.raises(RuntimeError, match="asked for log-probabilities but got 0 of 2"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
    assert llm.engine.num_blocks_in_use == 0  # and the engine is clean for the next call
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"logprobs": -2}, ValueError, "logprobs must be None, -1"),
    ({"prompt_logprobs": 1.5}, TypeError, "prompt_logprobs must be an int or None"),
    ({"logprobs": True}, TypeError, "logprobs must be an int or None"),
])
def test_bad_logprob_counts_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_more_logprobs_than_the_vocabulary_is_refused_before_queueing(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    with pytest.raises(ValueError, match="logprobs=65 .* more tokens than the model's vocab"):
        llm.generate([[1, 2]], SamplingParams(logprobs=65), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
