"""Predict, then measure: how fast your engine steps as the batch grows.

`python -m course measure 03-04 --plot steps.png` runs your EngineCore (your step and your model
runner, with the shipped tiny Shakespeare model) and the reference's on the same decode-only
workload: `x` requests, all past their 16-token prompts, each generating one token per step.
It times 16 steps and reports steps per second and generated tokens per second. Answer the
README's "Predict, then measure" questions before you look.

Times are wall-clock on your machine, the best of 3 runs: read the shapes.
"""

from __future__ import annotations

import functools
import random
import time

TITLE = "Engine steps as the batch grows (decode steps, shipped tiny model)"
X_LABEL = "batch size (requests decoding together)"
Y_LABEL = "see each panel"
LOG_X = LOG_Y = True
METRICS = {
    "steps_per_s": "engine steps per second",
    "tokens_per_s": "generated tokens per second",
}
PROMPT_LEN = 16
TIMED_STEPS = 16
RUNS = 3


def sizes(quick: bool) -> list[int]:
    return [1, 8, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128]


@functools.cache
def _model():
    import torch

    from mini_vllm.model_executor.model_loader.loader import load_default_model

    torch.manual_seed(0)
    return load_default_model()


def _one_run(impl, batch: int) -> float:
    from mini_vllm.config import SchedulerConfig
    from mini_vllm.sampling_params import SamplingParams

    config = SchedulerConfig(max_num_seqs=batch,
                             max_num_batched_tokens=max(512, batch * (PROMPT_LEN + 1)),
                             max_model_len=256, block_size=16, num_gpu_blocks=4 * batch + 1,
                             enable_prefix_caching=False)
    engine = impl.EngineCore(_model(), config, eos_token_id=None, use_cuda_ops=False)
    params = SamplingParams(temperature=0.0, max_tokens=TIMED_STEPS + 2, ignore_eos=True)
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(32, 120) for _ in range(PROMPT_LEN)]
        engine.add_request(engine.make_request(f"r{i}", prompt, params))
    for _ in range(2):  # the prefills (one step: the budget holds them all), a warm decode
        engine.step()
    if engine.model_runner.stats.num_forward_passes != 2:
        raise RuntimeError(
            "two engine steps did not run the model twice: run the lab's tests first"
        )
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    return time.perf_counter() - start


def run(impl, batch: int) -> dict[str, float]:
    """Your EngineCore (or the reference's): decode steps per second at this batch size."""
    seconds = min(_one_run(impl, batch) for _ in range(RUNS))
    steps_per_s = TIMED_STEPS / seconds
    return {"steps_per_s": steps_per_s, "tokens_per_s": steps_per_s * batch}
