"""Predict, then measure: the token budget against time to first token, throughput and
preemption, with your scheduler driving the real engine.

`python -m course measure 03-01 --plot budget.png` runs the same workload through mini_vllm's
engine (the shipped tiny Shakespeare model, the reference model runner) once with your
Scheduler and once with the reference's, for each token budget (`max_num_batched_tokens`).
Answer the README's "Predict, then measure" questions before you look.

The workload: 16 requests arrive together, prompts of 32 to 160 tokens, 32 tokens generated
each, in a KV cache of 96 blocks of 16 tokens (1,536 slots: about half of what all 16 would
hold at their longest), so a budget that lets many requests run at once runs out of blocks.
Times are wall-clock seconds on your machine, one run per budget: expect some noise, and look
at the shape. The counts (preemptions, victims) do not depend on the machine.
"""

from __future__ import annotations

import functools
import random
import time

TITLE = "The token budget: time to first token, throughput and preemption (16 requests)"
X_LABEL = "token budget (max_num_batched_tokens)"
Y_LABEL = "see each panel"
LOG_X = True
METRICS = {
    "ttft_ms": "mean time to first token (ms)",
    "tokens_per_s": "generated tokens per second",
    "preemptions": "preemptions",
    "victim_rank": "mean arrival rank of the preempted (0 = first, 15 = last)",
}
NUM_REQUESTS = 16
MAX_TOKENS = 32
NUM_GPU_BLOCKS = 96
BLOCK_SIZE = 16
MAX_STEPS = 2_000


def sizes(quick: bool) -> list[int]:
    return [16, 64, 256] if quick else [16, 32, 64, 128, 256, 512]


@functools.cache
def _model():
    import torch

    from mini_vllm.config import SchedulerConfig
    from mini_vllm.engine.core import EngineCore
    from mini_vllm.model_executor.model_loader.loader import load_default_model
    from mini_vllm.sampling_params import SamplingParams

    torch.manual_seed(0)
    model = load_default_model()
    # Warm up (first calls pay one-time costs that would land in the first measurement).
    engine = EngineCore(model, SchedulerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=16),
                        eos_token_id=None)
    for i, prompt in enumerate(_prompts()[:4]):
        engine.add_request(engine.make_request(f"w{i}", prompt, SamplingParams(max_tokens=4)))
    while engine.has_unfinished_requests():
        engine.step()
    return model


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(32, 120) for _ in range(rng.randint(32, 160))]
            for _ in range(NUM_REQUESTS)]


def run(impl, budget: int) -> dict[str, float | None]:
    """One run of the workload with ``impl.Scheduler`` in the engine at this token budget."""
    from mini_vllm.config import SchedulerConfig
    from mini_vllm.engine.core import EngineCore
    from mini_vllm.sampling_params import SamplingParams

    config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=512,
        block_size=BLOCK_SIZE, num_gpu_blocks=NUM_GPU_BLOCKS, enable_prefix_caching=False,
    )
    engine = EngineCore(_model(), config, eos_token_id=None)
    engine.scheduler = impl.Scheduler(config, log_stats=True)  # yours (or the reference's)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = []
    for i, prompt in enumerate(_prompts()):
        requests.append(engine.make_request(f"r{i}", prompt, params))
        engine.add_request(requests[-1])
    first_token_at: dict[str, float] = {}
    start = time.perf_counter()
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        now = time.perf_counter() - start
        for r in requests:
            if r.request_id not in first_token_at and r.num_output_tokens > 0:
                first_token_at[r.request_id] = now
    else:
        raise RuntimeError(
            f"the engine did not finish within {MAX_STEPS} steps (the reference needs about "
            "150): does your scheduler make progress? Run the lab's tests first."
        )
    elapsed = time.perf_counter() - start
    preemptions = sum(r.num_preemptions for r in requests)
    victim_rank = (
        sum(i * r.num_preemptions for i, r in enumerate(requests)) / preemptions
        if preemptions else None
    )
    return {
        "ttft_ms": 1000 * sum(first_token_at.values()) / len(requests),
        "tokens_per_s": sum(r.num_output_tokens for r in requests) / elapsed,
        "preemptions": preemptions,
        "victim_rank": victim_rank,
    }
