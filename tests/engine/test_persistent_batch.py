"""The persistent batch outside the lab (lab 04-03's reference): off unless asked, the per-step
runner's tokens and log-probabilities in every configuration, a clean batch after a failed step,
and clear errors for bad sizes."""

from __future__ import annotations

import numpy as np
import pytest

from mini_vllm.config import EngineConfig, SchedulerConfig
from mini_vllm.engine.core import EngineCore
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.block_table import BlockTable
from mini_vllm.worker.input_batch import InputBatch
from mini_vllm.worker.model_runner import ModelRunner
from mini_vllm.worker.persistent_runner import PersistentBatchRunner, batch_metadata

# "always": the adaptive policy sizes drafts from measured times, and the batch's shape with
# them, which moves the log-probabilities' last bits between two runs of either runner.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "draft_policy": "always"}


def test_off_unless_asked_and_a_bad_value_says_what_it_takes(tiny_model):
    config = SchedulerConfig(num_gpu_blocks=16, max_model_len=64, max_num_seqs=4)
    assert type(EngineCore(tiny_model, config).model_runner) is ModelRunner
    runner = EngineCore(tiny_model, config, persistent_batch=True).model_runner
    assert type(runner) is PersistentBatchRunner
    assert (runner.input_batch.max_num_reqs, runner.input_batch.max_model_len) == (4, 64)
    with pytest.raises(TypeError, match="persistent_batch must be True or False"):
        EngineConfig(persistent_batch=1)
    with pytest.raises(TypeError, match="persistent_batch must be True or False"):
        EngineCore(tiny_model, config, persistent_batch="yes")


def _outputs(llm, prompts, params):
    return [(c.token_ids, c.logprobs, out.prompt_logprobs)
            for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


CONFIGS = {
    "roomy": {},
    "chunked-prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(block_size=4, num_gpu_blocks=18, max_num_batched_tokens=16),
    "swap": dict(block_size=4, num_gpu_blocks=18, max_num_batched_tokens=16,
                 preemption_mode="swap", num_cpu_blocks=64),
    "few-seats": dict(max_num_seqs=2),
    "speculative": dict(speculative_config=NGRAM),
    "async-scheduling": dict(async_scheduling=True, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_per_step_runner_s_tokens_and_logprobs(tiny_model, prompts, config):
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2 if i == 1 else None,
                             prompt_logprobs=1 if i == 2 else None)
              for i, n in enumerate((12, 5, 9, 1, 16, 7, 3, 10, 4, 8, 2, 6)[: len(prompts)])]
    knobs = dict(max_model_len=128, **CONFIGS[config])
    per_step, persistent = LLM(tiny_model, **knobs), LLM(tiny_model, persistent_batch=True,
                                                         **knobs)
    assert _outputs(persistent, prompts, params) == _outputs(per_step, prompts, params)
    # Again on each engine: rows freed by the first call are taken by the second.
    assert _outputs(persistent, prompts[::-1], params[::-1]) == \
        _outputs(per_step, prompts[::-1], params[::-1])
    assert persistent.engine.num_blocks_in_use == 0


def test_a_failed_step_leaves_no_stale_row(tiny_model, prompts, monkeypatch):
    llm = LLM(tiny_model, persistent_batch=True, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in LLM(tiny_model, max_model_len=128).generate(
        prompts, params, use_tqdm=False)]
    runner = llm.engine.model_runner
    calls = {"n": 0}
    forward = runner._forward

    def fails_on_the_third_step(*args):
        calls["n"] += 1
        if calls["n"] == 3:  # after this step's diff reached the rows
            raise RuntimeError("planted failure of the forward pass")
        return forward(*args)

    monkeypatch.setattr(runner, "_forward", fails_on_the_third_step)
    with pytest.raises(RuntimeError, match="planted failure"):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.model_runner.input_batch.num_reqs == 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_bad_sizes_and_overflows_are_refused():
    with pytest.raises(ValueError, match="max_num_reqs must be an int >= 1"):
        InputBatch(0, 16, 4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockTable(2, 4, 0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        InputBatch(2, 16, 0)
    batch = InputBatch(1, 8, 4)
    row = batch.add_request("a", [1, 2, 3], 3, 0, [5])
    with pytest.raises(ValueError, match="would hold 9 tokens, more than max_model_len=8"):
        batch.write_tokens(row, 3, [4, 5, 6, 7, 8, 9])
    assert batch.num_tokens[row] == 3


def test_a_row_whose_blocks_miss_the_step_s_positions_is_named():
    batch = InputBatch(2, 16, 4)
    batch.add_request("a", list(range(6)), 6, 0, [3, 4])
    batch.add_request("b", list(range(6)), 6, 0, [5])  # 6 tokens, one block of 4
    with pytest.raises(ValueError, match="request 'b' \\(row 1\\) needs 6 slots but its "
                                         "block-table row holds 1 block"):
        batch_metadata(batch, ["a", "b"], np.array([6, 6]))
