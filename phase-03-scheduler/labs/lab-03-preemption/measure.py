"""Predict, then measure: bringing back a preempted sequence, by swapping or by recomputing, as
the block size changes.

`python -m course measure 03-03 --plot preempt.png` parks the KV of one 512-token sequence of the
shipped tiny Shakespeare model (4 layers) on the CPU and brings it back, with your SwapSpace
choosing the CPU blocks and the engine's model runner copying them (``swap_blocks``, both
ways, every layer), beside the reference's SwapSpace and beside recomputing the same 512 tokens
(one prefill forward pass through the runner: what a recompute preemption pays on resumption).
Answer the README's "Predict, then measure" questions before you look.

Reported per token of the sequence, in microseconds, the best of a few repeats (the least
disturbed by the rest of the machine).
"""

from __future__ import annotations

import functools
import random

TITLE = "Bringing back a preempted 512-token sequence: swap out and in vs recompute"
X_LABEL = "block size (tokens per KV block)"
Y_LABEL = "microseconds per token (best of 5)"
LOG_X = LOG_Y = True
SEQ_LEN = 512
REPEATS = 5


def sizes(quick: bool) -> list[int]:
    return [1, 16, 128] if quick else [1, 2, 4, 8, 16, 32, 64, 128]


@functools.cache
def _model():
    import torch

    from mini_vllm.model_executor.model_loader.loader import load_default_model

    torch.manual_seed(0)
    return load_default_model()


def _runner(block_size: int):
    from mini_vllm.worker.model_runner import ModelRunner

    n = SEQ_LEN // block_size
    return ModelRunner(_model(), block_size=block_size, num_gpu_blocks=2 * n + 1,
                       num_cpu_blocks=n + 1, use_cuda_ops=False)


def _output(**kw):
    from mini_vllm.core.sched.output import CachedRequestData, SchedulerOutput

    base = dict(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                num_common_prefix_blocks=[0], finished_req_ids=set())
    base.update(kw)
    return SchedulerOutput(**base)


def _best(fn) -> float:
    import time

    fn()  # warm-up
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(impl, block_size: int) -> float:
    """Your SwapSpace (or the reference's): one swap-out and one swap-in of the sequence's
    blocks, the mappings executed by the runner; microseconds per token."""
    runner = _runner(block_size)
    n = SEQ_LEN // block_size
    gpu_ids = list(range(n + 1, 2 * n + 1))  # a real table is scattered, not 1..n
    random.Random(block_size).shuffle(gpu_ids)
    space = impl.SwapSpace(n + 1)

    def swap() -> None:
        runner._execute_block_ops(_output(blocks_to_swap_out=space.swap_out("r", gpu_ids)))
        runner._execute_block_ops(_output(blocks_to_swap_in=space.swap_in("r", gpu_ids)))

    return _best(swap) / SEQ_LEN * 1e6


def recompute(block_size: int) -> float:
    """The same sequence recomputed: a prefill of its 512 tokens through the engine's runner
    (projections, KV written into the paged cache, attention, the last token sampled)."""
    from mini_vllm.core.sched.output import NewRequestData
    from mini_vllm.sampling_params import SamplingParams

    runner = _runner(block_size)
    n = SEQ_LEN // block_size
    tokens = [random.Random(0).randrange(32, 120) for _ in range(SEQ_LEN)]
    calls = iter(range(10**9))

    def prefill() -> None:
        rid = f"r{next(calls)}"
        new = NewRequestData(req_id=rid, prompt_token_ids=tokens,
                             sampling_params=SamplingParams(temperature=0.0),
                             block_ids=(list(range(1, n + 1)),), num_computed_tokens=0)
        runner.execute_model(_output(scheduled_new_reqs=[new], num_scheduled_tokens={rid: SEQ_LEN},
                                     total_num_scheduled_tokens=SEQ_LEN))
        runner.requests.pop(rid)

    return _best(prefill) / SEQ_LEN * 1e6


BASELINES = {"recompute (a prefill, reference runner)": recompute}
