"""A stand-in model runner for the scheduler labs, traces, the notebook and the benchmark.

It does what a real runner does with a ``SchedulerOutput``, minus the neural network:

1. forget finished requests, then execute the swaps (out first, then in) on its paged caches;
2. apply the diff: new requests join the persistent batch at the back, cached ones extend (or,
   when resumed from preemption, replace) their block tables;
3. order the batch decodes-first and build the step's attention metadata;
4. (``with_kv=True``) write each new token's key and value into the cache at its slot and run
   chunked-prefill attention over the paged cache;
5. sample one token for every request whose scheduled tokens reach the end of its sequence.

Keys, queries and values are fixed functions of (token id, position), so the KV a request should
have is known exactly: :meth:`ToyModelRunner.expected_kv` and :meth:`ToyModelRunner.cached_kv`
let tests compare the cache with the truth. Sampled tokens are a fixed function of the tokens so
far (the scheduler cares how many tokens a request gets, not which), which makes every run
reproducible bit for bit.

:func:`run_engine` drives a scheduler and a runner to completion and records one
:class:`StepRecord` per step (the golden trace of lab 03-01 and the notebook's timeline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mini_vllm.attention.cache_ops import reshape_and_cache, swap_blocks
from mini_vllm.attention.chunked_prefill import chunked_prefill_attention, gather_paged_kv
from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.attention.paged_attn import kv_cache_x
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.outputs import ModelRunnerOutput

__all__ = ["StepRecord", "ToyModelRunner", "run_engine", "toy_next_token"]


def toy_next_token(token_ids: list[int], vocab_size: int) -> int:
    """The toy model's next token: a fixed mix of the last token and the length.

    upstream: none (a stand-in for the model and the sampler)
    """
    return (token_ids[-1] * 31 + len(token_ids) * 7 + 3) % vocab_size


@dataclass
class _ReqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class ToyModelRunner:
    """A deterministic runner over real paged caches; see the module docstring.

    ``execute_model`` applies the scheduler's diff the way upstream's runner does.

    upstream: vllm/v1/worker/gpu_model_runner.py:526 @ v0.11.0
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        *,
        with_kv: bool = True,
        num_heads: int = 2,
        num_kv_heads: int = 1,
        head_size: int = 8,
        vocab_size: int = 101,
        max_model_len: int = 4096,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.with_kv = with_kv
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.device = torch.device(device)
        self.requests: dict[str, _ReqState] = {}
        self.batch_order: list[str] = []
        self.last_metadata: AttentionMetadata | None = None
        self.last_attn_out: torch.Tensor | None = None
        if not with_kv:
            return
        gen = torch.Generator().manual_seed(seed)

        def table(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=self.device)

        # Elementwise functions of (token, position): the same inputs give the same bits in any
        # batch, so recomputed KV equals the original KV exactly.
        self._tok = {n: table(vocab_size, h, head_size)
                     for n, h in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))}
        self._pos = {n: table(max_model_len, h, head_size)
                     for n, h in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))}
        x = kv_cache_x(dtype)
        self.key_cache = torch.zeros(
            num_gpu_blocks, num_kv_heads, head_size // x, block_size, x, dtype=dtype,
            device=self.device,
        )
        self.value_cache = torch.zeros(
            num_gpu_blocks, num_kv_heads, head_size, block_size, dtype=dtype, device=self.device
        )
        # The swap space lives in host memory whatever the device.
        self.cpu_key_cache = torch.zeros((max(num_cpu_blocks, 1),) + self.key_cache.shape[1:],
                                         dtype=dtype)
        self.cpu_value_cache = torch.zeros((max(num_cpu_blocks, 1),) + self.value_cache.shape[1:],
                                           dtype=dtype)

    # ------------------------------------------------------------------ the toy model

    def project(self, name: str, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``q``, ``k`` or ``v`` of tokens at positions: ``[n, heads, head_size]``."""
        t = token_ids.to(self.device).long()
        p = positions.to(self.device).long()
        return self._tok[name][t] + self._pos[name][p]

    def expected_kv(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a sequence with these tokens must have in the cache."""
        t = torch.tensor(token_ids)
        p = torch.arange(len(token_ids))
        return self.project("k", t, p), self.project("v", t, p)

    def cached_kv(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the GPU cache holds for a block table, first ``num_tokens``."""
        table = torch.tensor([block_ids], dtype=torch.int64)
        keys, values = gather_paged_kv(self.key_cache, self.value_cache, table)
        return keys[0, :num_tokens], values[0, :num_tokens]

    # ------------------------------------------------------------------ one step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step of ``so``; see the module docstring for the order of work."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        if self.with_kv:
            self._swap(so.blocks_to_swap_out, to_cpu=True)
            self._swap(so.blocks_to_swap_in, to_cpu=False)

        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _ReqState(
                list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            new_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            state.num_computed_tokens = cached.num_computed_tokens[i]

        scheduled = so.num_scheduled_tokens
        if not scheduled:
            return ModelRunnerOutput([], {}, [])
        # Persistent order: keep scheduled requests where they were, newcomers at the back.
        order = [r for r in self.batch_order if r in scheduled]
        order += [r for r in so.scheduled_req_ids if r not in order]
        reorder_batch_to_split_decodes_and_prefills(order, scheduled)
        self.batch_order = order

        md = build_attention_metadata(
            order,
            scheduled,
            {r: self.requests[r].num_computed_tokens for r in order},
            {r: self.requests[r].block_ids for r in order},
            self.block_size,
        )
        self.last_metadata = md
        if self.with_kv:
            self._forward(md)

        sampled: list[list[int]] = []
        for rid in order:
            state = self.requests[rid]
            state.num_computed_tokens += scheduled[rid]
            if state.num_computed_tokens >= len(state.token_ids):
                token = toy_next_token(state.token_ids, self.vocab_size)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # still in prefill
        return ModelRunnerOutput(order, {r: i for i, r in enumerate(order)}, sampled)

    def _swap(self, mapping: list[tuple[int, int]], to_cpu: bool) -> None:
        if not mapping:
            return
        m = torch.tensor(mapping, dtype=torch.int64)
        if to_cpu:
            swap_blocks(self.key_cache, self.cpu_key_cache, m)
            swap_blocks(self.value_cache, self.cpu_value_cache, m)
        else:
            swap_blocks(self.cpu_key_cache, self.key_cache, m)
            swap_blocks(self.cpu_value_cache, self.value_cache, m)

    def _forward(self, md: AttentionMetadata) -> None:
        token_ids = torch.tensor(
            [self.requests[r].token_ids[p] for r, p in zip(self._flat_req_ids(md), md.positions)]
        )
        q = self.project("q", token_ids, md.positions)
        k = self.project("k", token_ids, md.positions)
        v = self.project("v", token_ids, md.positions)
        reshape_and_cache(k, v, self.key_cache, self.value_cache, md.slot_mapping.to(self.device))
        md_dev = md
        if self.device.type != "cpu":
            md_dev = _metadata_to(md, self.device)
        self.last_attn_out = chunked_prefill_attention(q, self.key_cache, self.value_cache, md_dev)

    @staticmethod
    def _flat_req_ids(md: AttentionMetadata) -> list[str]:
        out: list[str] = []
        for rid, n in zip(md.req_ids, md.query_lens.tolist()):
            out.extend([rid] * n)
        return out


def _metadata_to(md: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
              for k, v in md.__dict__.items()}
    return AttentionMetadata(**fields)


@dataclass
class StepRecord:
    """What one step decided and left behind (the lab 03-01 golden trace compares these).

    upstream: none (a course trace record)
    """

    step: int
    num_scheduled_tokens: dict[str, int]
    preempted: list[str]
    finished: list[str]
    running: list[str]
    waiting: list[str]
    swapped: list[str]
    num_blocks_in_use: int
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def run_engine(
    scheduler: Any,
    runner: ToyModelRunner,
    arrivals: dict[int, list[Any]] | None = None,
    *,
    max_steps: int = 10_000,
    on_step: Callable[[int, SchedulerOutput, Any], None] | None = None,
) -> list[StepRecord]:
    """Run until no request is left; ``arrivals[step]`` are added just before that step.

    ``on_step(step, scheduler_output, scheduler)`` is called after each step's update (tests use
    it to check invariants). Raises ``RuntimeError`` if the run does not finish in
    ``max_steps`` steps (a livelock). One iteration is upstream's engine-core step.

    upstream: vllm/v1/engine/core.py:272 @ v0.11.0
    """
    arrivals = dict(arrivals or {})
    records: list[StepRecord] = []
    pool = scheduler.kv_cache_manager.block_pool
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests() and not arrivals:
            return records
        so = scheduler.schedule()
        mro = runner.execute_model(so)
        outputs = scheduler.update_from_output(so, mro)
        records.append(
            StepRecord(
                step=step,
                num_scheduled_tokens=dict(so.num_scheduled_tokens),
                preempted=list(so.preempted_req_ids),
                finished=sorted(o.request_id for o in outputs if o.finished),
                running=[r.request_id for r in scheduler.running],
                waiting=[r.request_id for r in scheduler.waiting],
                swapped=[r.request_id for r in getattr(scheduler, "swapped", [])],
                num_blocks_in_use=pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                num_swapped_out_blocks=len(so.blocks_to_swap_out),
                num_swapped_in_blocks=len(so.blocks_to_swap_in),
            )
        )
        if on_step is not None:
            on_step(step, so, scheduler)
    raise RuntimeError(f"run_engine: requests still unfinished after {max_steps} steps")
