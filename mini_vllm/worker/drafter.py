"""The runner's proposer: built from the speculative config, and kept in step with the blocks.

A draft model's cache mirrors the target's block for block, but the block operations of a step
(swaps, copies) move only the target's K/V, and a preempted request comes back in new blocks:
:func:`sync_draft_cache` tells the proposer which requests' draft K/V is gone before the step
runs, so that it recomputes them.

upstream: vllm/v1/worker/gpu_model_runner.py:176 @ v0.11.0 (the runner builds its drafter in
its constructor and loads the draft model with the target)
"""

from __future__ import annotations

import torch

from mini_vllm.attention.backend import _reference_pieces_in_place
from mini_vllm.config import SpeculativeConfig
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.spec_decode.draft_model import DraftModelProposer
from mini_vllm.spec_decode.ngram_proposer import NgramProposer
from mini_vllm.worker.cpu_decode import FusedDecode

__all__ = ["make_drafter", "scheduled_draft_q", "sync_draft_cache"]


def make_drafter(config: SpeculativeConfig, model: LlamaForCausalLM,
                 draft_model: LlamaForCausalLM | None, block_size: int, num_blocks: int,
                 max_model_len: int, compiled: bool) -> NgramProposer | DraftModelProposer:
    """The proposer ``config.method`` names; a draft model not given is loaded here (as
    upstream's runner loads it), with its cache mirroring the target's ``num_blocks``, and its
    passes compiled as the target's are (``compiled``: not ``enforce_eager``).

    upstream: vllm/v1/worker/gpu_model_runner.py:280 @ v0.11.0
    """
    if config.method != "draft_model":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.num_speculative_tokens, max_model_len)
    if draft_model is None:
        from mini_vllm.model_executor.model_loader.loader import load_draft_model

        draft_model = load_draft_model(config, model)
    draft_model.fuse_projections()
    drafter = DraftModelProposer(draft_model, num_speculative_tokens=config.num_speculative_tokens,
                                 block_size=block_size, num_blocks=num_blocks,
                                 max_model_len=max_model_len)
    fused = compiled and FusedDecode.build(draft_model, drafter.kv_caches,
                                           drafter.attn_backend.cpu_kernels is not None)
    if fused:
        # As the target's step (ModelRunnerBase._forward): few rows, the reference's pieces.
        drafter.fast_forward = lambda ids, meta: (
            fused.step(ids, meta) if fused.applies(meta.num_actual_tokens)
            and _reference_pieces_in_place(prefill=meta.num_prefills > 0) else None)
    return drafter


def sync_draft_cache(drafter: object, scheduler_output: SchedulerOutput) -> None:
    """Before a step's block operations: tell a draft-model proposer which requests' draft K/V
    is gone (finished and resumed requests, and those holding a block the step swaps or
    copies). Nothing for another proposer, or none.

    upstream: none (upstream's draft layers live in the target's KV-cache groups, so its block
    operations move them with the target's; mini_vllm's draft cache is a pool of its own)
    """
    if not isinstance(drafter, DraftModelProposer):
        return
    cached = scheduler_output.scheduled_cached_reqs
    for req_id in [*scheduler_output.finished_req_ids,
                   *(r for r, resumed in zip(cached.req_ids, cached.resumed_from_preemption)
                     if resumed)]:
        drafter.forget(req_id)
    moved = [src for src, _ in scheduler_output.blocks_to_swap_out]
    moved += [dst for _, dst in (*scheduler_output.blocks_to_swap_in,
                                 *scheduler_output.blocks_to_copy)]
    if moved:
        drafter.invalidate_blocks(moved)


def scheduled_draft_q(kept: dict[str, tuple[list[int], torch.Tensor]], req_ids: list[str],
                      drafts: list[list[int]], target_probs: torch.Tensor) -> torch.Tensor | None:
    """The draft distributions of the drafts a step checks, row for row with ``target_probs``
    (``None`` when no draft was sampled: every ``q`` is one-hot). ``kept`` holds each sampled
    request's proposal and its rows; a request whose drafts were not sampled gets one-hot rows,
    which mean the same to the rejection sampler. The scheduler may have cut a proposal short,
    never changed it.

    upstream: vllm/v1/worker/gpu_model_runner.py:2082 @ v0.11.0 (where 0.11 passes no draft
    probabilities; 0.33 passes the proposer's, with draft_sample_method="probabilistic")
    """
    if not kept:
        return None
    rows = []
    for req_id, d in zip(req_ids, drafts):
        proposal, q = kept.get(req_id, (None, None))
        if q is not None and proposal[:len(d)] == d:
            rows.append(q[:len(d)].to(target_probs))
        else:
            rows.append(torch.nn.functional.one_hot(
                torch.tensor(d, dtype=torch.long), target_probs.shape[1]).to(target_probs))
    return torch.cat(rows) if rows else None
