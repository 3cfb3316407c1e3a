"""``mini_vllm.LLM``: prompts in, generated text out, through the whole engine.

Three layers, as upstream:

* :class:`EngineCore` -- one scheduler and one model runner, and the step loop that drives them:
  ``schedule() -> execute_model() -> update_from_output()``. Lab 03-04 has the student write it.
* :class:`LLM` -- the user's entry point: it tokenizes prompts, makes ``Request`` objects, runs
  the core until every request finishes (with a progress bar over requests) and detokenizes.
* :class:`EngineConfig` -- every knob of the engine, checked once.

upstream: vllm/entrypoints/llm.py:66 @ v0.11.0
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mini_vllm.config import PREEMPTION_MODES, SchedulerConfig
from mini_vllm.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.model import LlamaForCausalLM
from mini_vllm.model_runner import ModelRunner
from mini_vllm.request import FinishReason, Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import Scheduler
from mini_vllm.scheduler_output import EngineCoreOutput
from mini_vllm.tokenizer import ByteTokenizer

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "EngineCoreBase",
    "EngineStats",
    "LLM",
    "RequestOutput",
    "kv_block_bytes",
]

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "tiny_shakespeare"


@dataclass
class EngineConfig:
    """The engine's knobs. Give the KV cache either ``num_gpu_blocks`` or ``kv_cache_memory``
    (bytes; the number of blocks is what fits); with neither, 512 blocks.

    * ``block_size``: tokens per KV block (a power of two).
    * ``enable_prefix_caching``: reuse the KV of full blocks shared with earlier requests.
    * ``max_num_batched_tokens`` / ``max_num_seqs``: the per-step token budget and seat count;
      a budget below a prompt's length forces chunked prefill.
    * ``max_model_len``: prompt + output cap (default: the model's ``max_position_embeddings``).
    * ``preemption_mode``: ``"recompute"`` or ``"swap"`` (then ``num_cpu_blocks`` >= 2).
    * ``long_prefill_token_threshold``: per-request cap per step (0: off).

    upstream: vllm/engine/arg_utils.py:285 @ v0.11.0
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    long_prefill_token_threshold: int = 0
    use_cuda_ops: bool | None = None

    def __post_init__(self) -> None:
        if self.num_gpu_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "EngineConfig: give num_gpu_blocks or kv_cache_memory, not both"
            )
        if self.kv_cache_memory is not None and (
            not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0
        ):
            raise ValueError(
                f"EngineConfig: kv_cache_memory must be a positive number of bytes, got "
                f"{self.kv_cache_memory!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"EngineConfig: preemption_mode must be one of {PREEMPTION_MODES}, got "
                f"{self.preemption_mode!r}"
            )

    def scheduler_config(self, model: LlamaForCausalLM) -> SchedulerConfig:
        """The scheduler's half of this config, with the KV-cache size resolved for ``model``."""
        max_model_len = self.max_model_len or model.config.max_position_embeddings
        if max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig: max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({model.config.max_position_embeddings})"
            )
        num_blocks = self.num_gpu_blocks
        if num_blocks is None and self.kv_cache_memory is not None:
            num_blocks = self.kv_cache_memory // kv_block_bytes(model, self.block_size)
            if num_blocks < 2:
                raise ValueError(
                    f"EngineConfig: kv_cache_memory={self.kv_cache_memory} bytes holds "
                    f"{num_blocks} block(s) of {kv_block_bytes(model, self.block_size)} bytes; "
                    "give it at least two (block 0 is reserved)"
                )
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=self.block_size,
            num_gpu_blocks=num_blocks if num_blocks is not None else 512,
            enable_prefix_caching=self.enable_prefix_caching,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            preemption_mode=self.preemption_mode,
            num_cpu_blocks=self.num_cpu_blocks,
        )


def kv_block_bytes(model: LlamaForCausalLM, block_size: int) -> int:
    """Bytes of one KV block over all layers: keys and values of ``block_size`` tokens.

    upstream: none (vLLM sizes pages per layer spec; one full-attention group needs one formula)
    """
    cfg = model.config
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * block_size * elem


@dataclass
class EngineStats:
    """What the engine did, for people (``python -m mini_vllm``) and benchmarks.

    ``kv_blocks_in_use`` is the count after the last step; ``peak_kv_blocks_in_use`` the
    largest count seen after any step. The prefix-cache hit rate is over every lookup (tokens
    hit / tokens queried).

    upstream: none (vLLM reports these through vllm/v1/metrics)
    """

    num_steps: int = 0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    elapsed_s: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    peak_kv_blocks_in_use: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def generation_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        return "\n".join([
            f"steps: {self.num_steps}   requests: {self.num_requests}   "
            f"time: {self.elapsed_s:.2f} s",
            f"tokens: {self.num_prompt_tokens} prompt ({self.num_prompt_tokens_computed} "
            f"computed), {self.num_generated_tokens} generated, "
            f"{self.generation_tokens_per_s:.1f} generated tokens/s",
            f"KV blocks in use: {self.kv_blocks_in_use} of {self.kv_blocks_total} "
            f"(peak {self.peak_kv_blocks_in_use})",
            f"prefix-cache hit rate: {100 * self.prefix_cache_hit_rate:.1f}% "
            f"({self.prefix_cache_hits} of {self.prefix_cache_queries} tokens)",
            f"preemptions: {self.num_preemptions}   blocks swapped out/in: "
            f"{self.num_blocks_swapped_out}/{self.num_blocks_swapped_in}",
        ])


class EngineCoreBase:
    """A scheduler and a model runner side by side; :class:`EngineCore` adds the step.

    ``runner_cls`` is the runner class to build (lab 03-04 plugs the student's in).

    upstream: vllm/v1/engine/core.py:63 @ v0.11.0
    """

    runner_cls: type = ModelRunner

    def __init__(
        self,
        model: LlamaForCausalLM,
        scheduler_config: SchedulerConfig,
        *,
        eos_token_id: int | None = None,
        use_cuda_ops: bool | None = None,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, log_stats=True)
        self.model_runner = self.runner_cls(
            model,
            block_size=scheduler_config.block_size,
            num_gpu_blocks=scheduler_config.num_gpu_blocks,
            num_cpu_blocks=scheduler_config.num_cpu_blocks,
            eos_token_id=eos_token_id,
            use_cuda_ops=use_cuda_ops,
        )
        self.block_hasher = get_request_block_hasher(scheduler_config.block_size, sha256)
        self.eos_token_id = eos_token_id
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_blocks_in_use = 0

    def add_request(self, request: Request) -> None:
        """Queue a request (made with :meth:`make_request`) for scheduling.

        upstream: vllm/v1/engine/core.py:217 @ v0.11.0
        """
        self.scheduler.add_request(request)

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams) -> Request:
        """A ``Request`` wired to this engine's block hasher and EOS id."""
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_id,
                       block_hasher=self.block_hasher)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _record_stats(self) -> None:
        """After a step: fold the prefix-cache counters in and track the peak block usage."""
        stats = self.scheduler.kv_cache_manager.make_prefix_cache_stats()
        if stats is not None:
            self.prefix_cache_queries += stats.queries
            self.prefix_cache_hits += stats.hits
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)

    @property
    def num_blocks_in_use(self) -> int:
        """KV blocks not in the free queue (held by some request), the null block excluded."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


class EngineCore(EngineCoreBase):
    """A scheduler and a model runner, and the loop that steps them.

    Invariant between steps: the runner knows every request the scheduler has scheduled and
    not yet reported finished; the tokens the runner sampled are exactly the output tokens the
    scheduler appended.

    upstream: vllm/v1/engine/core.py:63 @ v0.11.0
    """

    def step(self) -> list[EngineCoreOutput]:
        """One engine step: schedule, run the model on the scheduled batch, update the requests.

        Returns the news of every request that gained tokens (and whether it finished).

        upstream: vllm/v1/engine/core.py:272 @ v0.11.0
        """
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._record_stats()
        return outputs


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    upstream: vllm/outputs.py:22 @ v0.11.0
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """Everything the user gets back for one prompt (``n`` completions of it).

    ``metrics`` holds ``arrival_time``, ``first_token_time`` and ``finished_time`` (seconds,
    ``time.perf_counter``) of the first completion, and ``num_cached_tokens``.

    upstream: vllm/outputs.py:79 @ v0.11.0
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The first completion's text (the common ``n == 1`` case)."""
        return self.outputs[0].text


def load_default_model(device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The tiny Shakespeare model shipped in ``mini_vllm/checkpoints/``.

    upstream: none (course-only: the model this course trains and ships)
    """
    from mini_vllm.hf_loader import load_checkpoint

    return load_checkpoint(DEFAULT_CHECKPOINT, device=device)


class LLM:
    """Generate text with mini_vllm.

    ``model`` is a ``LlamaForCausalLM`` already built, a path (a ``.safetensors`` file with its
    ``.json`` next to it, or a local Hugging Face Llama/Qwen2 directory), or ``None`` for the
    shipped tiny Shakespeare model. The tokenizer is byte-level unless one is given (anything
    with ``encode``, ``decode`` and ``eos_token_id``). Engine knobs: see :class:`EngineConfig`.

    upstream: vllm/entrypoints/llm.py:66 @ v0.11.0
    """

    def __init__(
        self,
        model: LlamaForCausalLM | str | Path | None = None,
        *,
        tokenizer: object | None = None,
        device: str | torch.device = "cpu",
        **config_kwargs: object,
    ) -> None:
        self.config = EngineConfig(**config_kwargs)  # type: ignore[arg-type]
        if model is None:
            model = load_default_model(device)
        elif isinstance(model, (str, Path)):
            from mini_vllm.hf_loader import load_checkpoint

            model = load_checkpoint(model, device=device)
        elif not isinstance(model, LlamaForCausalLM):
            raise TypeError(
                "LLM: model must be a mini_vllm.model.LlamaForCausalLM, a checkpoint path, or "
                f"None for the shipped model; got {type(model).__name__}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.engine = EngineCore(
            self.model,
            self.config.scheduler_config(self.model),
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            use_cuda_ops=self.config.use_cuda_ops,
        )
        self._counter = 0
        self.last_stats = EngineStats()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order.

        ``prompts`` are strings or lists of token ids; ``sampling_params`` is one for all or one
        per prompt (default: greedy, 16 tokens). Invalid input raises ``ValueError`` before any
        request is queued. Statistics of the call end up in :attr:`last_stats`.

        upstream: vllm/entrypoints/llm.py:335 @ v0.11.0
        """
        if isinstance(prompts, str) or (
            prompts and isinstance(prompts[0], int)  # type: ignore[index]
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0)
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"generate: got {len(prompts)} prompts but {len(params_list)} SamplingParams; "
                "pass one for all or one per prompt"
            )
        encoded = [self._encode(p) for p in prompts]

        # Build (and validate) every request before queueing any, so bad input changes nothing.
        requests: list[tuple[int, int, Request]] = []
        for i, (ids, params) in enumerate(zip(encoded, params_list)):
            for j in range(params.n):
                child = params
                if params.n > 1:
                    # Children of one prompt differ; a seeded parent gives seed + j (as upstream).
                    child = SamplingParams(**{**params.__dict__, "n": 1})
                    if params.seed is not None:
                        child.seed = params.seed + j
                rid = f"{self._counter + i}-{j}"
                requests.append((i, j, self.engine.make_request(rid, ids, child)))
        self._check_fits(requests)
        self._counter += len(prompts)

        sched_stats = self.engine.scheduler.stats
        runner_stats = self.engine.model_runner.stats
        start_steps, start_preempt = sched_stats.num_steps, sched_stats.num_preemptions
        start_out = runner_stats.num_blocks_swapped_out
        start_in = runner_stats.num_blocks_swapped_in
        start_prompt_computed = runner_stats.num_prompt_tokens_computed
        start_q, start_h = self.engine.prefix_cache_queries, self.engine.prefix_cache_hits
        self.engine.peak_blocks_in_use = 0

        t0 = time.perf_counter()
        by_id: dict[str, tuple[int, int, Request]] = {}
        first_token: dict[str, float] = {}
        finished_at: dict[str, float] = {}
        for i, j, req in requests:
            req.arrival_time = t0
            self.engine.add_request(req)
            by_id[req.request_id] = (i, j, req)

        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", unit="req", leave=False)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    now = time.perf_counter()
                    first_token.setdefault(out.request_id, now)
                    if out.finished:
                        finished_at[out.request_id] = now
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0

        results: list[RequestOutput] = []
        for i, ids in enumerate(encoded):
            completions = sorted(
                (j, req) for (pi, j, req) in by_id.values() if pi == i
            )
            outs = [
                CompletionOutput(
                    index=j,
                    text=self.tokenizer.decode(list(req.output_token_ids)),
                    token_ids=list(req.output_token_ids),
                    finish_reason=_reason(req.get_finished_reason()),
                    stop_reason=req.stop_reason,
                )
                for j, req in completions
            ]
            first = completions[0][1]
            rid = first.request_id
            results.append(RequestOutput(
                request_id=rid.rsplit("-", 1)[0],
                prompt=prompts[i] if isinstance(prompts[i], str) else None,
                prompt_token_ids=list(ids),
                outputs=outs,
                metrics={
                    "arrival_time": t0,
                    "first_token_time": first_token.get(rid, float("nan")),
                    "finished_time": finished_at.get(rid, float("nan")),
                    "num_cached_tokens": max(first.num_cached_tokens, 0),
                },
            ))

        pool = self.engine.scheduler.kv_cache_manager.block_pool
        self.last_stats = EngineStats(
            num_steps=sched_stats.num_steps - start_steps,
            num_requests=len(requests),
            num_prompt_tokens=sum(len(r.prompt_token_ids) for _, _, r in requests),
            num_generated_tokens=sum(r.num_output_tokens for _, _, r in requests),
            num_prompt_tokens_computed=runner_stats.num_prompt_tokens_computed
            - start_prompt_computed,
            elapsed_s=elapsed,
            kv_blocks_total=pool.num_gpu_blocks - 1,
            kv_blocks_in_use=self.engine.num_blocks_in_use,
            peak_kv_blocks_in_use=self.engine.peak_blocks_in_use,
            prefix_cache_queries=self.engine.prefix_cache_queries - start_q,
            prefix_cache_hits=self.engine.prefix_cache_hits - start_h,
            num_preemptions=sched_stats.num_preemptions - start_preempt,
            num_blocks_swapped_out=runner_stats.num_blocks_swapped_out - start_out,
            num_blocks_swapped_in=runner_stats.num_blocks_swapped_in - start_in,
        )
        return results

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("generate: a prompt is empty; give it at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"generate: token id {bad[0]} is outside the model's vocab [0, {vocab})"
            )
        return ids

    def _check_fits(self, requests: list[tuple[int, int, Request]]) -> None:
        """Raise before queueing anything if a request can never be served."""
        sched = self.engine.scheduler
        usable = sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
        for _, _, req in requests:
            if req.num_tokens >= sched.max_model_len:
                raise ValueError(
                    f"generate: a prompt has {req.num_tokens} tokens; max_model_len="
                    f"{sched.max_model_len} leaves no room to generate. Shorten the prompt."
                )
            longest = min(req.num_tokens + req.max_tokens, sched.max_model_len)
            if -(-longest // sched.block_size) > usable:
                raise ValueError(
                    f"generate: a request may reach {longest} tokens, more than the KV cache "
                    f"holds ({usable} blocks of {sched.block_size}); lower max_tokens or raise "
                    "num_gpu_blocks / kv_cache_memory"
                )


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)
