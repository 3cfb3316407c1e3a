"""The model runner: owns the KV cache tensors and turns a ``SchedulerOutput`` into sampled tokens.

One call of :meth:`ModelRunner.execute_model` does, in order:

1. **update states** -- apply the scheduler's diff to the runner's own copy of every live
   request: forget finished requests, remember new ones, append new block ids (or *replace* the
   whole table of a request resumed after preemption), take over ``num_computed_tokens``;
2. **swap and copy** -- copy preempted requests' blocks to the CPU pool (swap-out), then parked
   blocks back (swap-in), then in-cache copies, all *before* the forward pass reads the cache;
3. **prepare inputs** -- order the batch decodes-first and build the flat ``input_ids`` and the
   attention metadata (positions, slot mapping, block tables) with
   :func:`mini_vllm.attention.metadata.build_attention_metadata`;
4. **forward** -- the model writes every new token's K/V into its slot and attends through the
   block tables (decodes with PagedAttention, prefill chunks with chunked-prefill attention);
5. **sample** -- one logits row per request, the row of its *last* scheduled token, and only for
   requests whose scheduled tokens reach the end of their sequence; a request still in the
   middle of a chunked prefill samples nothing this step;
   With speculative decoding, a request's step ends in the draft tokens the scheduler chose to
   check (``scheduled_spec_decode_tokens``): the forward pass computes them all, its last
   ``k + 1`` rows give the target's distribution after each, and the rejection sampler
   (:mod:`mini_vllm.sample.rejection_sampler`) turns them into the 1 to ``k + 1`` tokens the
   request emits; then the proposer guesses the next drafts (:meth:`take_draft_token_ids`);
6. **log-probabilities** -- for requests that ask: the sampled token's and the top-k
   (``SamplingParams.logprobs``), and those of every prompt position this step computed
   (``prompt_logprobs``). They travel in the ``ModelRunnerOutput`` and wait in the runner's
   outbox (:meth:`ModelRunnerBase.take_logprobs`) for ``LLM``: that way they reach the user
   whatever scheduler or engine step (a student's) passes the output on.

The runner never decides anything: what runs, and where its KV goes, is the scheduler's call.

upstream: vllm/v1/worker/gpu_model_runner.py:176 @ v0.11.0
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mini_vllm.attention import cache_ops, paged_attn
from mini_vllm.attention.backend import (
    PagedAttentionBackend,
    _load_cuda_ops,
    _reference_pieces_in_place,
)
from mini_vllm.attention.fp8 import (
    check_kv_scale,
    kv_cache_torch_dtype,
)
from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.config import SpeculativeConfig
from mini_vllm.core.sched.output import NewRequestData, SchedulerOutput
from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.outputs import DraftTokenIds, LogprobsLists, ModelRunnerOutput
from mini_vllm.sample.rejection_sampler import RejectionSampler
from mini_vllm.sample.sampler import Sampler, SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.draft_model import DraftModelProposer
from mini_vllm.spec_decode.draft_policy import DraftPolicy
from mini_vllm.spec_decode.ngram_proposer import NgramProposer
from mini_vllm.utils import huge_pages
from mini_vllm.worker.cpu_decode import FusedDecode
from mini_vllm.worker.drafter import make_drafter, scheduled_draft_q, sync_draft_cache

__all__ = [
    "CachedRequestState",
    "ModelRunner",
    "ModelRunnerBase",
    "RunnerStats",
    "check_kv_scales",
]


@dataclass
class CachedRequestState:
    """The runner's copy of one live request.

    ``token_ids`` is prompt + every token sampled so far (the runner appends its own samples, so
    the scheduler never has to send them back); ``block_ids`` is the request's block table;
    ``num_computed_tokens`` counts the tokens whose KV is in the cache *before* the current step.

    upstream: vllm/v1/worker/gpu_input_batch.py:29 @ v0.11.0
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class RunnerStats:
    """Counters of the work done (for the engine statistics and the benchmarks).

    upstream: none (vLLM reports these through its metrics loggers)
    """

    num_forward_passes: int = 0
    num_tokens_computed: int = 0
    # Tokens computed at prompt positions: the prefill work that prefix caching saves.
    num_prompt_tokens_computed: int = 0
    num_tokens_sampled: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    model_seconds: list[float] = field(default_factory=list)


def check_kv_scales(
    kv_scales: object, num_layers: int
) -> list[tuple[float, float]] | None:
    """``kv_scales`` as one ``(k_scale, v_scale)`` pair of floats per layer, or ``None``.

    Accepts ``None`` (calibrate), one pair for every layer, or a sequence of ``num_layers``
    pairs; each scale finite and > 0. Anything else is a ``ValueError``.

    upstream: none (upstream loads per-layer k_scale/v_scale from the checkpoint)
    """
    if kv_scales is None:
        return None

    def pair(item: object, where: str) -> tuple[float, float]:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"kv_scales{where} must be a (k_scale, v_scale) pair, got {item!r}")
        return (check_kv_scale(f"kv_scales{where} k_scale", item[0]),
                check_kv_scale(f"kv_scales{where} v_scale", item[1]))

    if (isinstance(kv_scales, (tuple, list)) and len(kv_scales) == 2
            and not isinstance(kv_scales[0], (tuple, list))):
        return [pair(kv_scales, "")] * num_layers
    if not isinstance(kv_scales, (tuple, list)) or len(kv_scales) != num_layers:
        raise ValueError(
            f"kv_scales must be None, one (k_scale, v_scale) pair, or one pair per layer "
            f"({num_layers}); got {kv_scales!r}"
        )
    return [pair(item, f"[{i}]") for i, item in enumerate(kv_scales)]


class ModelRunnerBase:
    """The runner's state and plumbing: the caches, the attention backend, swaps and copies.

    :class:`ModelRunner` adds the step itself (lab 03-04's tasks). Owns, per layer,
    ``key_cache [num_gpu_blocks, KVH, D // x, block_size, x]`` and
    ``value_cache [num_gpu_blocks, KVH, D, block_size]`` on the model's device, plus CPU pools
    of the same layout with ``num_cpu_blocks`` blocks when swapping is enabled. Block 0 is the
    null block: the scheduler never hands it out, so writing to it is a bug upstream of here.

    upstream: vllm/v1/worker/gpu_model_runner.py:176 @ v0.11.0
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        eos_token_id: int | None = None,
        use_cuda_ops: bool | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: list[tuple[float, float]] | None = None,
        enforce_eager: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        max_model_len: int | None = None,
        draft_model: LlamaForCausalLM | None = None,
        attention_backend: str = "paged",
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        # One product for q/k/v and one for gate/up per layer: fewer, longer weight streams.
        if hasattr(model, "fuse_projections"):
            model.fuse_projections()
        # A CPU decode streams every weight each step: faster from 2 MB pages, where offered.
        if (hasattr(model, "move_weights_to_huge_pages") and huge_pages.offered()
                and param.device.type == "cpu"):
            model.move_weights_to_huge_pages()
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.eos_token_id = eos_token_id
        # The cache's dtype: the model's ("auto") or float8_e4m3fn ("fp8", x = 16).
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        kv_scales = check_kv_scales(kv_scales, cfg.num_hidden_layers)
        x = paged_attn.kv_cache_x(self.cache_dtype)
        kv_heads, head_dim = model.kv_cache_spec()  # a tensor-parallel rank's KV heads only
        if head_dim % x:
            raise ValueError(f"head_dim {head_dim} must be a multiple of x={x} for "
                             f"{self.cache_dtype}")
        kv_shape = (kv_heads, head_dim // x, block_size, x)
        v_shape = (kv_heads, head_dim, block_size)

        def pool(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [
                (torch.zeros((n, *kv_shape), dtype=self.cache_dtype, device=device),
                 torch.zeros((n, *v_shape), dtype=self.cache_dtype, device=device))
                for _ in range(cfg.num_hidden_layers)
            ]

        self.kv_caches = pool(num_gpu_blocks, self.device)
        self.cpu_kv_caches = pool(num_cpu_blocks, torch.device("cpu")) if num_cpu_blocks else []
        cuda_ops = _load_cuda_ops(self.device) if use_cuda_ops in (None, True) else None
        if use_cuda_ops and cuda_ops is None:
            raise RuntimeError("use_cuda_ops=True but the CUDA ops are not available here")
        if cuda_ops is not None and head_dim not in cuda_ops.SUPPORTED_HEAD_SIZES:
            if use_cuda_ops:
                raise ValueError(
                    f"use_cuda_ops=True but the kernels are compiled for head sizes "
                    f"{cuda_ops.SUPPORTED_HEAD_SIZES}, not this model's {head_dim}; leave "
                    "use_cuda_ops unset to run the PyTorch ops")
            cuda_ops = None  # a head size with no compiled kernel: the PyTorch ops serve it
        self.attn_backend = PagedAttentionBackend(kv_heads, cuda_ops, kv_cache_dtype,
                                                  self.kv_caches, kv_scales, attention_backend)
        # The decode step as one compiled call, where the model and the kernels allow it (the
        # CPU's CUDA graph); enforce_eager=True runs every step op by op, as vLLM's flag does.
        self.fused_decode = None if enforce_eager else FusedDecode.build(
            model, self.kv_caches, self.attn_backend.cpu_kernels is not None)
        self.sampler = Sampler()
        # Speculative decoding: the proposer, the verifier, and the drafts of the last step.
        self.drafter: NgramProposer | DraftModelProposer | None = None
        self.draft_policy: DraftPolicy | None = None
        if speculative_config is not None:
            self.drafter = make_drafter(speculative_config, model, draft_model, block_size,
                                         num_gpu_blocks,
                                         max_model_len or cfg.max_position_embeddings,
                                         compiled=not enforce_eager)
            if speculative_config.draft_policy == "adaptive":
                self.draft_policy = DraftPolicy(speculative_config.num_speculative_tokens)
        self.rejection_sampler = RejectionSampler()
        self._draft_token_ids: DraftTokenIds | None = None
        # "probabilistic" drafts: each sampled request's drafts and their distributions q, kept
        # for the step that checks them.
        self.sample_drafts = (speculative_config is not None
                              and speculative_config.draft_sample_method == "probabilistic")
        self._draft_q: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._step_started = 0.0
        self.requests: dict[str, CachedRequestState] = {}
        # The persistent batch order (decodes first), carried from step to step.
        self.batch_req_ids: list[str] = []
        self.stats = RunnerStats()
        # This step's sampled-token log-probabilities (filled by _sample), and every step's
        # log-probabilities not yet taken by the LLM (see take_logprobs).
        self.step_logprobs: dict[str, LogprobsLists] = {}
        self.sample_logprobs_outbox: dict[str, list[LogprobsLists]] = {}
        self.prompt_logprobs_outbox: dict[str, list[tuple[int, LogprobsLists]]] = {}

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Given: the model over the step's flat batch, ``self.model(input_ids, positions,
        self.kv_caches, meta, self.attn_backend)`` with ``positions = meta.positions`` on the
        model's device; a step of few tokens that :attr:`fused_decode` takes (a CPU model whose
        lab 02-04 pieces, and for prefill tokens the lab 03-02 attention, are the reference's;
        no forward hooks) runs as one compiled call instead (:mod:`mini_vllm.worker.cpu_decode`):
        the same hidden rows, to rounding, and the same K/V written.

        upstream: vllm/v1/worker/gpu_model_runner.py:2298 @ v0.11.0 (the CUDA graph or eager
        dispatch of the forward pass)
        """
        fused = self.fused_decode
        if (fused is not None and fused.applies(meta.num_actual_tokens)
                and _reference_pieces_in_place(prefill=meta.num_prefills > 0)):
            return fused.step(input_ids, meta)
        return self.model(input_ids, meta.positions.to(self.device), self.kv_caches, meta,
                          self.attn_backend)

    @property
    def kv_scales(self) -> list[tuple[float, float] | None] | None:
        """Per layer ``(k_scale, v_scale)`` of an fp8 cache (``None`` for a layer not yet
        calibrated); ``None`` for an ``"auto"`` cache."""
        return list(self.attn_backend.kv_scales) if self.attn_backend.fp8 else None

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the paged cache of every layer (keys and values)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.kv_caches)

    def _execute_block_ops(self, scheduler_output: SchedulerOutput) -> None:
        """Swap out, then swap in, then copy, so that the forward pass sees the final cache.

        V0's worker runs swap-in first; mini_vllm's scheduler never swaps both ways in one step,
        and swapping out first stays correct even if a block it frees were handed out at once.
        A draft model's cache does not travel with the blocks: the requests they belong to
        start its cache over (:meth:`_sync_draft_cache`).

        upstream: vllm/worker/worker.py:512 @ v0.10.2
        """
        sync_draft_cache(self.drafter, scheduler_output)
        pairs = (
            (scheduler_output.blocks_to_swap_out, self.kv_caches, self.cpu_kv_caches),
            (scheduler_output.blocks_to_swap_in, self.cpu_kv_caches, self.kv_caches),
        )
        for mapping, src_pool, dst_pool in pairs:
            if not mapping:
                continue
            if not self.cpu_kv_caches:
                raise RuntimeError("the scheduler asked for a swap but the runner has no CPU pool")
            m = torch.tensor(mapping, dtype=torch.int64)
            for (src_k, src_v), (dst_k, dst_v) in zip(src_pool, dst_pool):
                cache_ops.swap_blocks(src_k, dst_k, m)
                cache_ops.swap_blocks(src_v, dst_v, m)
        self.stats.num_blocks_swapped_out += len(scheduler_output.blocks_to_swap_out)
        self.stats.num_blocks_swapped_in += len(scheduler_output.blocks_to_swap_in)
        if scheduler_output.blocks_to_copy:
            m = torch.tensor(scheduler_output.blocks_to_copy, dtype=torch.int64)
            cache_ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], m)

    def take_logprobs(self) -> tuple[dict[str, list[LogprobsLists]],
                                     dict[str, list[tuple[int, LogprobsLists]]]]:
        """Every log-probability computed since the last call, and forget them.

        Returns ``(sample, prompt)``: ``sample[r]`` one ``LogprobsLists`` per step in which
        ``r`` sampled (one row per token, in order); ``prompt[r]`` ``(first position, rows)``
        per step that computed prompt positions of ``r``.

        upstream: none (the engine core sends them to the output processor with each
        EngineCoreOutput; here they bypass the scheduler, which a student may have written)
        """
        out = (self.sample_logprobs_outbox, self.prompt_logprobs_outbox)
        self.sample_logprobs_outbox, self.prompt_logprobs_outbox = {}, {}
        return out

    def _with_logprobs(self, output: ModelRunnerOutput, hidden: torch.Tensor,
                       meta: AttentionMetadata) -> ModelRunnerOutput:
        """``output`` with the step's log-probabilities attached and kept for ``LLM``.

        Attaches what ``_gather_sample_logprobs`` recorded during ``_sample`` and the prompt
        positions this step computed (from ``hidden``, one row per token of the batch), puts
        both in the outbox (:meth:`take_logprobs`) and starts the next step with none recorded.
        Given code in lab 03-04: the runner's step only has to call it.
        """
        output.logprobs = self.step_logprobs
        output.prompt_logprobs_dict = self._gather_prompt_logprobs(hidden, meta)
        self.step_logprobs = {}
        return self._keep_logprobs(output)

    def _keep_logprobs(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Put ``output``'s log-probabilities in the outbox (see :meth:`take_logprobs`)."""
        for req_id, rows in output.logprobs.items():
            self.sample_logprobs_outbox.setdefault(req_id, []).append(rows)
        for req_id, chunk in output.prompt_logprobs_dict.items():
            self.prompt_logprobs_outbox.setdefault(req_id, []).append(chunk)
        return output

    def _gather_sample_logprobs(self, logits: torch.Tensor, states: list[CachedRequestState],
                                tokens: torch.Tensor) -> None:
        """Into ``step_logprobs``: for each state whose request asks for ``logprobs``, its
        sampled token (row ``i`` of ``tokens``) and top-k, from row ``i`` of the raw ``logits``.
        Given code in lab 03-04: ``_sample`` calls it once the tokens are drawn."""
        wanted = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
        if not wanted:
            return
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = self.sampler.compute_logprobs(logits[rows])
        vocab = logprobs.shape[-1]
        ks = [_num_logprobs(states[i].sampling_params.logprobs, vocab) for i in wanted]
        gathered = self.sampler.gather_logprobs(logprobs, max(ks), tokens[rows]).tolists()
        for j, (i, k) in enumerate(zip(wanted, ks)):
            self.step_logprobs[states[i].req_id] = LogprobsLists(
                [gathered.logprob_token_ids[j][: k + 1]], [gathered.logprobs[j][: k + 1]],
                [gathered.sampled_token_ranks[j]])

    def _gather_prompt_logprobs(
        self, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[str, tuple[int, LogprobsLists]]:
        """The log-probabilities of the prompt tokens this step's rows predict.

        The row at position ``p`` predicts token ``p + 1``; a prompt of ``P`` tokens gets rows
        for positions ``1 .. P - 1``, whichever steps (prefill chunks) compute them.

        upstream: vllm/v1/worker/gpu_model_runner.py:2720 @ v0.11.0
        """
        result: dict[str, tuple[int, LogprobsLists]] = {}
        starts, ctxs = meta.query_start_loc.tolist(), meta.context_lens.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, req_id in enumerate(meta.req_ids):
            state = self.requests[req_id]
            num = state.sampling_params.prompt_logprobs
            end = min(seq_lens[i], state.num_prompt_tokens - 1)  # last predicting position + 1
            if num is None or ctxs[i] >= end:
                continue
            rows = torch.arange(starts[i], starts[i] + end - ctxs[i], device=hidden.device)
            logprobs = self.sampler.compute_logprobs(self.model.compute_logits(hidden[rows]))
            targets = torch.tensor(state.token_ids[ctxs[i] + 1: end + 1], device=hidden.device)
            k = _num_logprobs(num, logprobs.shape[-1])
            result[req_id] = (ctxs[i] + 1,
                              self.sampler.gather_logprobs(logprobs, k, targets).tolists())
        return result

    def _account(self, meta: AttentionMetadata) -> None:
        """Count the step's work for the statistics: tokens computed, and those at prompt
        positions (the prefill work that prefix caching saves)."""
        self.stats.num_forward_passes += 1
        self.stats.num_tokens_computed += meta.num_actual_tokens
        for req_id, ctx, seq in zip(meta.req_ids, meta.context_lens.tolist(),
                                    meta.seq_lens.tolist()):
            prompt = self.requests[req_id].num_prompt_tokens
            self.stats.num_prompt_tokens_computed += max(0, min(prompt, seq) - ctx)

    def _stop_token_ids(self, state: CachedRequestState) -> list[int]:
        """Tokens a request may not sample yet: its stop tokens (and EOS) before ``min_tokens``."""
        p = state.sampling_params
        if state.num_output_tokens >= p.min_tokens:
            return []
        stop_ids = list(p.stop_token_ids)
        if self.eos_token_id is not None and not p.ignore_eos:
            stop_ids.append(self.eos_token_id)
        return stop_ids

    def _new_request_state(self, new: NewRequestData) -> CachedRequestState:
        """The runner's record of a request it sees for the first time (with its own RNG when
        it is seeded, so its samples do not depend on the rest of the batch)."""
        params = new.sampling_params or SamplingParams(temperature=0.0)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            block_ids=list(new.block_ids[0]),
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
        )


    def _stage_drafts(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Append each request's scheduled draft tokens to its ``token_ids``, so that the
        step's inputs (``_prepare_inputs``) and sequence lengths cover them; the sampling step
        replaces them by the tokens the request really emits. Returns the drafts by request.
        Given code: the runner's step only has to call it before preparing the inputs."""
        self._step_started = time.perf_counter()
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, tokens in drafts.items():
            self.requests[req_id].token_ids.extend(tokens)
        return drafts

    def _propose_drafts(self, meta: AttentionMetadata, sampled: list[list[int]],
                        drafts: dict[str, list[int]]) -> None:
        """After sampling: guess the next draft tokens of every request that sampled, for
        :meth:`take_draft_token_ids`. None for a request that asks for log-probabilities or is
        still under ``min_tokens`` (its stop tokens are banned position by position); no more
        than the request can still emit (``max_tokens``) needs, and, with the adaptive draft
        policy, no more than pay (:mod:`mini_vllm.spec_decode.draft_policy`; not for a seeded
        sampled request), which learns here from the step just run (its time, and how many of
        ``drafts`` were accepted).

        upstream: vllm/v1/worker/gpu_model_runner.py:2458 @ v0.11.0
        """
        if self.drafter is None:
            return
        policy = self.draft_policy
        if policy is not None:
            self._teach_draft_policy(policy, meta, sampled, drafts)
        req_ids, rooms = [], []
        for req_id, tokens in zip(meta.req_ids, sampled):
            state = self.requests[req_id]
            params = state.sampling_params
            if (not tokens or params.logprobs is not None
                    or state.num_output_tokens < params.min_tokens):
                continue
            room = params.max_tokens - state.num_output_tokens - 1
            # Not for a seeded sampled request: its draws depend on how many drafts it checks,
            # the policy's choice on measured times; so it checks its whole proposal.
            if policy is not None and state.generator is None:
                room = min(room, policy.num_drafts(req_id, len(meta.req_ids)))
            req_ids.append(req_id)
            rooms.append(max(room, 0))
        states = [self.requests[r] for r in req_ids]
        if isinstance(self.drafter, DraftModelProposer):
            started = time.perf_counter()
            sampled_at = ([0.0 if s.sampling_params.greedy else s.sampling_params.temperature
                           for s in states] if self.sample_drafts else None)
            proposals = self.drafter.propose(req_ids, [s.token_ids for s in states],
                                             [s.block_ids for s in states], rooms, sampled_at,
                                             [s.generator for s in states])
            q = self.drafter.take_draft_probs()
            self._draft_q = {r: (d, q[r]) for r, d in zip(req_ids, proposals) if r in q}
            if policy is not None and any(proposals):
                policy.observe_draft_cost(max(map(len, proposals)),
                                          time.perf_counter() - started)
        else:
            proposals = [self.drafter.propose([s.token_ids])[0][:room] if room > 0 else []
                         for s, room in zip(states, rooms)]
        self._draft_token_ids = DraftTokenIds(req_ids, proposals)

    def _teach_draft_policy(self, policy: DraftPolicy, meta: AttentionMetadata,
                            sampled: list[list[int]], drafts: dict[str, list[int]]) -> None:
        """Tell the draft policy what the step showed: each checked draft's acceptance, and,
        for a step of decodes only (every request computed its last token and its drafts, and
        sampled), its seconds by row count."""
        for req_id, tokens in zip(meta.req_ids, sampled):
            if drafts.get(req_id) and tokens:
                policy.observe_draft(req_id, len(drafts[req_id]), len(tokens) - 1)
        rows = len(meta.req_ids) + sum(len(d) for d in drafts.values())
        if all(sampled) and meta.num_actual_tokens == rows:
            policy.observe_step(rows, time.perf_counter() - self._step_started)
        policy.retain(set(self.requests))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (``None`` if none were), and forget them.

        upstream: vllm/v1/worker/gpu_model_runner.py:2447 @ v0.11.0
        """
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    def _sample_with_drafts(self, hidden: torch.Tensor, meta: AttentionMetadata,
                            drafts: dict[str, list[int]]) -> list[list[int]]:
        """``_sample`` for a step that checks draft tokens (``drafts``, staged in the states'
        ``token_ids`` by ``_stage_drafts``): a request with ``d`` drafts uses its last ``d + 1``
        rows, the first ``d`` to judge the drafts and the last for the bonus token, which is
        drawn exactly as ``_sample`` draws (same settings, same generator). Returns the 1 to
        ``d + 1`` tokens each request emits, and leaves them, not the drafts, in ``token_ids``.

        Given code in lab 03-04: the runner's step calls it instead of ``_sample`` when the step
        checks drafts.

        upstream: vllm/v1/worker/gpu_model_runner.py:2054 @ v0.11.0
        """
        seq_lens, query_start_loc = meta.seq_lens.tolist(), meta.query_start_loc.tolist()
        draft_rows, bonus_rows, states, request_drafts = [], [], [], []
        for i, req_id in enumerate(meta.req_ids):
            state = self.requests[req_id]
            d = drafts.get(req_id, [])
            if seq_lens[i] >= state.num_tokens:
                end = query_start_loc[i + 1]
                draft_rows.extend(range(end - 1 - len(d), end - 1))
                bonus_rows.append(end - 1)
                states.append(state)
                request_drafts.append(d)
            del state.token_ids[len(state.token_ids) - len(d):]
        sampled: list[list[int]] = [[] for _ in meta.req_ids]
        if not states:
            return sampled
        logits = self.model.compute_logits(hidden[torch.tensor(draft_rows + bonus_rows,
                                                                device=hidden.device)])
        draft_logits, bonus_logits = logits[:len(draft_rows)], logits[len(draft_rows):]
        params = [s.sampling_params for s in states]
        bonus_meta = SamplingMetadata.from_params(
            params, generators={j: s.generator for j, s in enumerate(states)
                                if s.generator is not None},
            banned_token_ids=[self._stop_token_ids(s) for s in states])
        bonus = self.sampler(bonus_logits, bonus_meta)
        self._gather_sample_logprobs(bonus_logits, states, bonus)
        # A request with drafts is past min_tokens (see _propose_drafts): nothing is banned.
        row_params = [p for p, d in zip(params, request_drafts) for _ in d]
        target_probs = self.sampler.compute_probs(
            draft_logits, SamplingMetadata.from_params(row_params))
        kept_q, self._draft_q = self._draft_q, {}  # sampled drafts' q, used once
        emitted = self.rejection_sampler.parse_output(self.rejection_sampler(
            request_drafts, target_probs, bonus.tolist(), [p.greedy for p in params],
            draft_probs=scheduled_draft_q(kept_q, [s.req_id for s in states],
                                          request_drafts, target_probs),
            generators=[s.generator for s in states]))
        index = {r: i for i, r in enumerate(meta.req_ids)}
        for state, tokens in zip(states, emitted):
            state.token_ids.extend(tokens)
            sampled[index[state.req_id]] = tokens
        return sampled


def _num_logprobs(requested: int, vocab: int) -> int:
    """How many top tokens a request's ``logprobs``/``prompt_logprobs`` asks for (-1: all)."""
    return vocab if requested == -1 else min(requested, vocab)


class ModelRunner(ModelRunnerBase):
    """Run scheduled steps of the model over the paged KV cache (see the module docstring).

    upstream: vllm/v1/worker/gpu_model_runner.py:176 @ v0.11.0
    """

    @torch.no_grad()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the tokens sampled for each scheduled request.

        upstream: vllm/v1/worker/gpu_model_runner.py:2231 @ v0.11.0
        """
        self._update_states(scheduler_output)
        self._execute_block_ops(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        drafts = self._stage_drafts(scheduler_output)
        input_ids, meta = self._prepare_inputs(scheduler_output)
        self._account(meta)
        hidden = self._forward(input_ids, meta)
        sampled = (self._sample_with_drafts(hidden, meta, drafts) if drafts
                   else self._sample(hidden, meta))
        self._propose_drafts(meta, sampled, drafts)
        output = ModelRunnerOutput(
            req_ids=list(meta.req_ids),
            req_id_to_index={r: i for i, r in enumerate(meta.req_ids)},
            sampled_token_ids=sampled,
        )
        return self._with_logprobs(output, hidden, meta)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to ``self.requests`` (see the module docstring, step 1).

        upstream: vllm/v1/worker/gpu_model_runner.py:526 @ v0.11.0
        """
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_request_state(new)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                # The request lost its blocks when it was preempted: its table starts over.
                state.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids is not None:
                state.block_ids.extend(new_block_ids[0])

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Order the batch decodes-first and build ``input_ids`` and the attention metadata.

        Returns ``(input_ids[num_tokens], metadata)``: request ``r``'s rows are its tokens at
        positions ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.

        upstream: vllm/v1/worker/gpu_model_runner.py:923 @ v0.11.0
        """
        scheduled = scheduler_output.num_scheduled_tokens
        # Keep the previous order for requests still scheduled; newcomers join at the back.
        order = [r for r in self.batch_req_ids if r in scheduled]
        known = set(order)
        order += [r for r in scheduler_output.scheduled_req_ids if r not in known]
        reorder_batch_to_split_decodes_and_prefills(order, scheduled)
        self.batch_req_ids = order

        states = [self.requests[r] for r in order]
        meta = build_attention_metadata(
            order,
            scheduled,
            {s.req_id: s.num_computed_tokens for s in states},
            {s.req_id: s.block_ids for s in states},
            self.block_size,
        )
        input_ids: list[int] = []
        for s in states:
            start = s.num_computed_tokens
            input_ids.extend(s.token_ids[start : start + scheduled[s.req_id]])
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), meta

    def _sample(self, hidden: torch.Tensor, meta: AttentionMetadata) -> list[list[int]]:
        """Sample one token for every request whose step reaches the end of its sequence.

        The logits row of request ``i`` is its *last* scheduled token, ``query_start_loc[i+1] -
        1``. Returns one list per request in batch order: ``[token]`` or ``[]`` (mid-prefill).

        upstream: vllm/v1/worker/gpu_model_runner.py:2054 @ v0.11.0
        """
        rows, states = [], []
        seq_lens, query_start_loc = meta.seq_lens.tolist(), meta.query_start_loc.tolist()
        for i, req_id in enumerate(meta.req_ids):
            state = self.requests[req_id]
            if seq_lens[i] >= state.num_tokens:
                rows.append(query_start_loc[i + 1] - 1)
                states.append(state)
        sampled: list[list[int]] = [[] for _ in meta.req_ids]
        if not rows:
            return sampled
        # Rows ascend; consecutive ones (every decode step) are a view, no gather.
        if rows[-1] - rows[0] == len(rows) - 1:
            picked = hidden[rows[0]:rows[-1] + 1]
        else:
            picked = hidden[torch.tensor(rows, device=hidden.device)]
        logits = self.model.compute_logits(picked)
        sampling_meta = SamplingMetadata.from_params(
            [s.sampling_params for s in states],
            generators={j: s.generator for j, s in enumerate(states) if s.generator is not None},
            banned_token_ids=[self._stop_token_ids(s) for s in states],
        )
        token_tensor = self.sampler(logits, sampling_meta)
        self._gather_sample_logprobs(logits, states, token_tensor)
        tokens = token_tensor.tolist()
        index = {r: i for i, r in enumerate(meta.req_ids)}
        for state, token in zip(states, tokens):
            state.token_ids.append(int(token))
            sampled[index[state.req_id]] = [int(token)]
        return sampled
