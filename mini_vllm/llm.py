"""``mini_vllm.LLM``: prompts in, generated text out, through the whole engine.

Three layers, as upstream:

* :class:`EngineCore` -- one scheduler and one model runner, and the step loop that drives them:
  ``schedule() -> execute_model() -> update_from_output()``. Lab 03-04 has the student write it.
* :class:`LLM` -- the user's entry point: it tokenizes prompts, makes ``Request`` objects, runs
  the core until every request finishes (with a progress bar over requests) and detokenizes.
* :class:`EngineConfig` -- every knob of the engine, checked once.

What :class:`LLM` promises about failures:

* bad input (a prompt, a ``SamplingParams``, an engine knob, a device) raises ``TypeError`` or
  ``ValueError`` before anything is queued, and the engine is exactly as it was;
* an exception inside a step (in the scheduler, the runner, the model, the sampler, or one of
  the student's pieces plugged into them), or Ctrl-C, aborts every request that ``generate()``
  queued, frees their KV blocks, drops the prefix cache (the failed step may have registered
  blocks whose KV it never wrote) and re-raises: the next call runs on a clean engine;
* a step that schedules nothing while requests wait, and leaves the engine as it found it, would
  repeat forever: ``generate()`` raises ``RuntimeError`` instead of spinning.

upstream: vllm/entrypoints/llm.py:66 @ v0.11.0
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mini_vllm.attention.fp8 import (
    KV_CACHE_DTYPES,
    check_kv_scale,
    is_fp8,
    kv_cache_torch_dtype,
)
from mini_vllm.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    create_sort_beams_key_function,
    expand_beams,
    finish_beams,
)
from mini_vllm.config import PREEMPTION_MODES, SchedulerConfig
from mini_vllm.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.logprobs import Logprob, LogprobsProcessor, PromptLogprobs
from mini_vllm.model import LlamaForCausalLM
from mini_vllm.model_runner import ModelRunner
from mini_vllm.request import FinishReason, Request, RequestStatus
from mini_vllm.sampling_params import BeamSearchParams, SamplingParams
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
    "default_num_threads",
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
    * ``kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"fp8"``/``"fp8_e4m3"``: the cache
      stores float8_e4m3fn, one byte per element, so a ``kv_cache_memory`` budget holds twice
      the blocks of an fp16/bf16 model's cache (four times a float32 model's).
    * ``kv_scales``: with fp8, one ``(k_scale, v_scale)`` pair for every layer or a list of one
      pair per layer; ``None`` (default): each layer computes its pair once, from the K/V of the
      first step (the first prompts), as upstream's ``calculate_kv_scales``.
    * ``kv_reservation`` / ``static_batching``: the Orca-style and static-batching baselines of
      lab 03-06 (see :class:`~mini_vllm.config.SchedulerConfig`); ``"paged"`` and ``False``
      are how vLLM runs.
    * ``enforce_eager``: run every step op by op through the model's modules; by default a
      decode step on the CPU runs as one compiled call where it can (:mod:`mini_vllm.cpu_decode`,
      the CPU's counterpart of the CUDA graphs this flag turns off upstream).

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
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] | list[tuple[float, float]] | None = None
    kv_reservation: str = "paged"
    static_batching: bool = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name, low, optional in (
            ("block_size", 1, False), ("num_gpu_blocks", 2, True), ("kv_cache_memory", 1, True),
            ("max_num_batched_tokens", 1, False), ("max_num_seqs", 1, False),
            ("max_model_len", 1, True), ("num_cpu_blocks", 0, False),
            ("long_prefill_token_threshold", 0, False),
        ):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"EngineConfig: {name} must be an int{' or None' if optional else ''}, got "
                    f"{type(value).__name__} {value!r}"
                )
            if value < low:
                raise ValueError(f"EngineConfig: {name} must be >= {low}, got {value}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"EngineConfig: block_size must be a power of two, got {self.block_size}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(
                f"EngineConfig: enable_prefix_caching must be True or False, got "
                f"{self.enable_prefix_caching!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"EngineConfig: enforce_eager must be True or False, got "
                            f"{self.enforce_eager!r}")
        if self.use_cuda_ops not in (None, True, False):
            raise TypeError(
                f"EngineConfig: use_cuda_ops must be None, True or False, got {self.use_cuda_ops!r}"
            )
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
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig: kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.kv_scales is not None:
            if not is_fp8(self.kv_cache_dtype):
                raise ValueError(
                    "EngineConfig: kv_scales are for an fp8 cache; set kv_cache_dtype='fp8' "
                    "or leave kv_scales out"
                )
            # The shape against the model's layers is checked by the runner; the values here.
            pairs = (self.kv_scales if self.kv_scales and isinstance(self.kv_scales[0],
                                                                     (tuple, list))
                     else [self.kv_scales])
            for item in pairs:
                if not isinstance(item, (tuple, list)) or len(item) != 2:
                    raise ValueError(
                        f"EngineConfig: kv_scales must be a (k_scale, v_scale) pair or a list "
                        f"of them, one per layer; got {self.kv_scales!r}"
                    )
                for value in item:
                    check_kv_scale("EngineConfig: kv_scales entry", value)

    def scheduler_config(self, model: LlamaForCausalLM) -> SchedulerConfig:
        """The scheduler's half of this config, with the KV-cache size resolved for ``model``."""
        max_model_len = (self.max_model_len if self.max_model_len is not None
                         else model.config.max_position_embeddings)
        if max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig: max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({model.config.max_position_embeddings})"
            )
        num_blocks = self.num_gpu_blocks
        if num_blocks is None and self.kv_cache_memory is not None:
            block_bytes = kv_block_bytes(model, self.block_size, self.kv_cache_dtype)
            num_blocks = self.kv_cache_memory // block_bytes
            if num_blocks < 2:
                raise ValueError(
                    f"EngineConfig: kv_cache_memory={self.kv_cache_memory} bytes holds "
                    f"{num_blocks} block(s) of {block_bytes} bytes; "
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
            kv_reservation=self.kv_reservation,
            static_batching=self.static_batching,
        )


def kv_block_bytes(model: LlamaForCausalLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block over all layers: keys and values of ``block_size`` tokens, in the
    model's dtype (``"auto"``) or one byte per element (``"fp8"``).

    upstream: none (vLLM sizes pages per layer spec; one full-attention group needs one formula)
    """
    cfg = model.config
    dtype = kv_cache_torch_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    elem = dtype.itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * block_size * elem


@dataclass
class EngineStats:
    """What the engine did, for people (``python -m mini_vllm``) and benchmarks.

    ``kv_blocks_in_use`` is the count after the last step; ``peak_kv_blocks_in_use`` the
    largest count seen after any step. ``peak_kv_blocks_in_step`` and ``num_kv_block_steps``
    are taken inside each step, right after scheduling, before finished requests free their
    blocks: the largest count, and the sum over steps (block-steps). They see what a request
    that finishes within its step held (a beam-search step's one-token requests), which the
    after-step counts miss. ``EngineCore.step`` takes them; a step written in lab 03-04 need
    not call ``_record_blocks_in_step``, and then they read 0. The prefix-cache hit rate is
    over every lookup (tokens hit / tokens queried).

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
    peak_kv_blocks_in_step: int = 0
    num_kv_block_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    kv_cache_dtype: str = "auto"
    kv_cache_torch_dtype: str = ""
    kv_block_bytes: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def peak_blocks(self) -> int:
        """The most blocks held at once: inside a step when the step counted them (a beam
        search's requests finish within their step and free everything before the step
        ends), else after a step."""
        return max(self.peak_kv_blocks_in_use, self.peak_kv_blocks_in_step)

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
            f"(peak {self.peak_blocks} within a step)   KV cache dtype: {self.kv_cache_dtype} "
            f"({self.kv_cache_torch_dtype}, {self.kv_block_bytes} bytes per block)",
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
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[float, float] | list[tuple[float, float]] | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, log_stats=True)
        # Only an fp8 cache (or enforce_eager) passes the new arguments, so a runner class
        # written before them still builds a default engine.
        fp8_kwargs = ({"kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales}
                      if kv_cache_dtype != "auto" else {})
        if enforce_eager:
            fp8_kwargs["enforce_eager"] = True
        self.model_runner = self.runner_cls(
            model,
            block_size=scheduler_config.block_size,
            num_gpu_blocks=scheduler_config.num_gpu_blocks,
            num_cpu_blocks=scheduler_config.num_cpu_blocks,
            eos_token_id=eos_token_id,
            use_cuda_ops=use_cuda_ops,
            **fp8_kwargs,
        )
        self.block_hasher = get_request_block_hasher(scheduler_config.block_size, sha256)
        self.eos_token_id = eos_token_id
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_blocks_in_use = 0
        self.peak_blocks_in_step = 0
        self.num_block_steps = 0

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

    def _record_blocks_in_step(self) -> None:
        """Right after scheduling: count the blocks the step's batch holds (one subtraction),
        before ``update_from_output`` frees those of requests that finish in this step."""
        in_use = self.num_blocks_in_use
        self.num_block_steps += in_use
        self.peak_blocks_in_step = max(self.peak_blocks_in_step, in_use)

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
        self._record_blocks_in_step()
        model_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._record_stats()
        return outputs


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    With ``SamplingParams.logprobs``: ``logprobs[i]`` is the dict ``token id -> Logprob`` of
    ``token_ids[i]``'s position (that token and the top-k), and ``cumulative_logprob`` the sum of
    the generated tokens' log-probabilities; both ``None`` otherwise.

    upstream: vllm/outputs.py:22 @ v0.11.0
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    """Everything the user gets back for one prompt (``n`` completions of it).

    ``metrics`` holds ``arrival_time``, ``first_token_time`` and ``finished_time`` (seconds,
    ``time.perf_counter``) of the first completion, and ``num_cached_tokens``. With
    ``SamplingParams.prompt_logprobs``, ``prompt_logprobs`` has one entry per prompt token:
    ``None`` for the first, then the dict ``token id -> Logprob`` (that token and the top-k).

    upstream: vllm/outputs.py:79 @ v0.11.0
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None

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


# Models with fewer parameters than this run fastest on one thread: each operation is a few
# microseconds of work, and splitting it over threads costs more in synchronisation than it saves
# (and on a busy machine a thread that waits for a descheduled sibling stalls every operation).
SMALL_MODEL_PARAMS = 20_000_000
MAX_DEFAULT_THREADS = 8


# LLM(weight_dtype=...): the linear layers' storage, a dtype (None: as loaded) or a GGUF block
# format (the kernels' name for it).
WEIGHT_DTYPES: dict[str, torch.dtype | str | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "q4_1": "q4_1", "q8_0": "q8_0"}


def default_num_threads(model: torch.nn.Module) -> int:
    """The thread count ``LLM`` uses when none is given.

    ``OMP_NUM_THREADS``, when set, wins. Otherwise 1 for a small model (below 20M parameters),
    and for a larger one the CPU cores this process may use that are not already busy (the
    one-minute load average says how many are), at least 1 and at most 8: an OpenMP thread that
    waits for a sibling the OS has descheduled stalls every operation, so oversubscribing a busy
    machine is far slower than using fewer threads.

    upstream: none (vLLM's CPU backend binds its OpenMP threads in its CPU worker)
    """
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(cores - busy, MAX_DEFAULT_THREADS))


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` saying why it cannot be used here.

    upstream: none (vLLM picks its platform once, in vllm/platforms)
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"LLM: device {device!r} is not a device name ({exc})") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("this PyTorch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        raise ValueError(f"LLM: device={str(device)!r} but {why}; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"LLM: device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    return dev


@dataclass
class _LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any
    # EOS ids beyond the tokenizer's (generation_config.json may list several): stop tokens.
    extra_eos_token_ids: list[int]
    # The path the model was read from (None: a model object or the shipped one).
    path: Path | None = None


def _load_model(model: object, tokenizer: object, device: torch.device) -> _LoadedModel:
    """Resolve ``LLM(model=..., tokenizer=...)`` into a model and the tokenizer that goes with
    it."""
    from mini_vllm import gguf_loader
    from mini_vllm.hf_loader import load_checkpoint, read_generation_config
    from mini_vllm.tokenizer import load_tokenizer

    extra_eos: list[int] = []
    tok: Any = None
    path: Path | None = None
    if model is None:
        model, tok = load_default_model(device), ByteTokenizer()
    elif isinstance(model, (str, Path)):
        path = gguf_loader.resolve_model_name(model)
        if path.suffix == ".gguf":
            loaded = gguf_loader.load_gguf(path, device=device)
            model, tok, extra_eos = loaded.model, loaded.tokenizer, loaded.extra_eos_token_ids
        else:
            model = load_checkpoint(path, device=device)
            tok = load_tokenizer(path)
            if tok is None and model.config.vocab_size == ByteTokenizer.vocab_size:
                tok = ByteTokenizer()  # mini_vllm's own checkpoints are byte-level
            gen_eos = read_generation_config(path).get("eos_token_id")
            gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
            if tok is not None and tok.eos_token_id is None and gen_eos:
                tok.eos_token_id = gen_eos[0]
            primary = getattr(tok, "eos_token_id", None)
            extra_eos = [t for t in gen_eos if isinstance(t, int) and t != primary]
    elif not isinstance(model, LlamaForCausalLM):
        raise TypeError(
            "LLM: model must be a mini_vllm.model.LlamaForCausalLM, a checkpoint path, or "
            f"None for the shipped model; got {type(model).__name__}"
        )
    elif model.config.vocab_size == ByteTokenizer.vocab_size:
        tok = ByteTokenizer()
    if tokenizer is not None:
        if not (callable(getattr(tokenizer, "encode", None))
                and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(
                f"LLM: tokenizer must have encode() and decode(); got {type(tokenizer).__name__}"
            )
        tok = tokenizer
    vocab = model.config.vocab_size
    for tid in [getattr(tok, "eos_token_id", None), *extra_eos]:
        if tid is not None and not 0 <= tid < vocab:
            raise ValueError(f"LLM: EOS token id {tid} is outside the model's vocab [0, {vocab})")
    return _LoadedModel(model, tok, extra_eos, path)


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """The first stop string found in the last ``new_char_count`` characters (or straddling
    them), and where to cut the text: before the string, or after it when it is kept.

    upstream: vllm/v1/engine/detokenizer.py:313 @ v0.11.0
    """
    if not new_char_count:
        return None
    for stop_str in stop:
        # Only text that could contain a new match: the new characters and the stop string's
        # length minus one before them.
        index = output_text.find(stop_str, max(0, len(output_text) - new_char_count
                                               - len(stop_str) + 1))
        if index != -1:
            return stop_str, index + len(stop_str) if include_in_output else index
    return None


@dataclass
class _Tracked:
    """What generate() keeps per request: where its output goes, and its stop-string state."""

    prompt_index: int
    child_index: int
    request: Request
    text_len: int = 0  # characters of output text checked for stop strings so far
    cut: int | None = None  # where a stop string cut the text
    logprobs: LogprobsProcessor | None = None  # when the request asks for log-probabilities



def child_sampling_params(params: SamplingParams, j: int, extra_eos: list[int]) -> SamplingParams:
    """The parameters of child `j` of a request asking for `params.n` outputs. Children of one
    prompt differ: a seeded parent gives seed + j (as upstream). generation_config.json's other
    EOS ids (`extra_eos`) stop like EOS unless EOS is ignored (as upstream).

    upstream: vllm/v1/engine/parallel_sampling.py:12 @ v0.11.0 (ParentRequest)"""
    changes: dict[str, Any] = {}
    if params.n > 1:
        changes["n"] = 1
        if params.seed is not None:
            changes["seed"] = params.seed + j
    if extra_eos and not params.ignore_eos:
        changes["stop_token_ids"] = [*params.stop_token_ids, *extra_eos]
    return dataclasses.replace(params, **changes) if changes else params

class LLM:
    """Generate text with mini_vllm.

    ``model`` is a ``LlamaForCausalLM`` already built, a path (a ``.safetensors`` file with its
    ``.json`` next to it, a local Hugging Face Llama/Qwen2 directory, or a ``.gguf`` file), the
    name ``"smollm2"`` (SmolLM2-135M-Instruct, when its package is installed; see the README), or
    ``None`` for the shipped tiny Shakespeare model. The tokenizer comes with the model: byte-level
    for mini_vllm's checkpoints, ``tokenizer.json`` for a Hugging Face directory, the GGUF's own
    vocabulary for a GGUF file; ``tokenizer=`` overrides it (anything with ``encode`` and
    ``decode``). A model without a tokenizer takes token-id prompts only. EOS: the tokenizer's,
    plus every other id that ``generation_config.json`` lists (as stop tokens).

    ``weight_dtype``: ``"auto"`` (the weights as loaded) or ``"bfloat16"``: the linear layers'
    weights are stored in bf16 and widened to float32 as they are read (weight-only: the
    activations, the KV cache, norms and embeddings keep the model's dtype), half the bytes a
    decode step reads; see :meth:`~mini_vllm.model.LlamaForCausalLM.set_weight_dtype`.
    ``"q4_1"`` or ``"q8_0"``: stored as GGUF's blocks of 32 weights (5 or 8.5 bits a weight),
    dequantized in registers as they are read: a model read from a GGUF file (or a folder
    converted from one) keeps the file's own blocks, so its values are the fp32 model's; other
    weights are quantized here (see :func:`mini_vllm.gguf_loader.linear_blocks`).
    ``num_threads``: PyTorch CPU threads (default :func:`default_num_threads`). Engine knobs: see
    :class:`EngineConfig`. For what happens on bad input and on failures, see the module docstring.

    upstream: vllm/entrypoints/llm.py:66 @ v0.11.0
    """

    def __init__(
        self,
        model: LlamaForCausalLM | str | Path | None = None,
        *,
        tokenizer: object | None = None,
        device: str | torch.device = "cpu",
        num_threads: int | None = None,
        weight_dtype: str = "auto",
        **config_kwargs: object,
    ) -> None:
        self.config = EngineConfig(**config_kwargs)  # type: ignore[arg-type]
        if num_threads is not None and (
            not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1
        ):
            raise ValueError(f"LLM: num_threads must be an int >= 1, got {num_threads!r}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"LLM: weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got "
                             f"{weight_dtype!r}")
        if isinstance(WEIGHT_DTYPES[weight_dtype], str) and str(device).split(":")[0] != "cpu":
            raise ValueError(f"LLM: weight_dtype={weight_dtype!r} runs on the CPU only (its "
                             "kernel is C); use device='cpu', or weight_dtype='bfloat16'")
        dev = check_device(device)
        loaded = _load_model(model, tokenizer, dev)
        self.model = loaded.model.eval()
        storage = WEIGHT_DTYPES[weight_dtype]
        if isinstance(storage, str):
            from mini_vllm.gguf_loader import gguf_source, linear_blocks

            source = gguf_source(loaded.path) if loaded.path is not None else None
            try:
                blocks = linear_blocks(self.model, storage, source)
            except ValueError as exc:
                raise ValueError(f"LLM: weight_dtype={weight_dtype!r}: {exc}") from exc
            self.model.quantize_weights(blocks)
        elif storage is not None:
            self.model.set_weight_dtype(storage)
        self.weight_dtype = weight_dtype
        self.tokenizer = loaded.tokenizer
        self.extra_eos_token_ids = loaded.extra_eos_token_ids
        self.num_threads = num_threads or default_num_threads(self.model)
        if dev.type == "cpu":
            torch.set_num_threads(self.num_threads)
        self._scheduler_config = self.config.scheduler_config(self.model)
        self.engine = self._make_engine()
        self._counter = 0
        self.last_stats = EngineStats()

    def _make_engine(self) -> EngineCoreBase:
        return EngineCore(
            self.model,
            self._scheduler_config,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            use_cuda_ops=self.config.use_cuda_ops,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_scales=self.config.kv_scales,
            enforce_eager=self.config.enforce_eager,
        )

    # ------------------------------------------------------------------ the public calls

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order.

        ``prompts``: a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``, or a list of those. ``sampling_params``: one for all or
        one per prompt (default: greedy, 16 tokens). Bad input raises ``TypeError``/``ValueError``
        before any request is queued. Statistics of the call end up in :attr:`last_stats`.

        upstream: vllm/entrypoints/llm.py:335 @ v0.11.0
        """
        items = self._parse_prompts(prompts)
        if not items:
            return []
        params_list = self._parse_params(sampling_params, len(items))
        tracked = self._make_requests(items, params_list)
        return self._run(items, tracked, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or several.

        Each conversation is rendered with the model's chat template (``tokenizer_config.json``
        or the GGUF's ``tokenizer.chat_template``; ``chat_template=`` overrides it), tokenized
        without adding special tokens (the template wrote them), and generated like a prompt.

        upstream: vllm/entrypoints/llm.py:815 @ v0.11.0
        """
        from mini_vllm.tokenizer import render_chat_template

        if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, (list, tuple)) for m in messages
        ):
            conversations = list(messages)
        else:
            conversations = [messages]
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ValueError(
                "chat: this model's tokenizer has no chat template (the shipped Shakespeare model "
                "is not a chat model); pass chat_template=... or use generate()"
            )
        context = dict(chat_template_kwargs or {})
        for name in ("bos_token", "eos_token"):
            context.setdefault(name, getattr(self.tokenizer, name, None) or "")
        prompts = []
        for conversation in conversations:
            text = render_chat_template(
                template, conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **context,
            )
            prompts.append({"prompt_token_ids": self._encode(text, add_special_tokens=False),
                            "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of every prompt, by beam search.

        ``prompts`` as for :meth:`generate`. Each of at most ``max_tokens`` steps submits every
        live beam of every prompt as one request for a single token with ``2 * beam_width``
        log-probabilities (temperature ``params.temperature``), through this engine's scheduler
        and KV cache: with prefix caching on, beams share the KV of their common full blocks.
        :func:`mini_vllm.beam_search.expand_beams` makes the next beams from the answers. Returns
        one :class:`BeamSearchOutput` per prompt: sequences best first, each with its tokens
        (prompt included), its text (the decoded tokens, prompt included, as upstream), one
        log-probability dict per generated token and its cumulative log-probability.

        Bad input (a width of 0 or above the vocabulary, a prompt too long for ``max_tokens``,
        anything :meth:`generate` refuses) raises before anything is queued. :attr:`last_stats`
        covers the whole search (counts summed over the steps, the peak of any step).

        upstream: vllm/entrypoints/llm.py:538 @ v0.11.0
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(
                f"beam_search: params must be a BeamSearchParams, got {type(params).__name__}"
                + (" (build one with BeamSearchParams(**params))"
                   if isinstance(params, Mapping) else "")
            )
        vocab = self.model.config.vocab_size
        if params.beam_width > vocab:
            raise ValueError(
                f"beam_search: beam_width {params.beam_width} is above the model's vocabulary "
                f"({vocab} tokens); use at most {vocab}"
            )
        items = self._parse_prompts(prompts)
        sched = self._scheduler_config
        for i, (_, ids) in enumerate(items):
            # The last step submits prompt + max_tokens - 1 tokens and asks for one more.
            longest = len(ids) + params.max_tokens
            if longest > sched.max_model_len:
                raise ValueError(
                    f"beam_search: prompt {i} has {len(ids)} tokens; with max_tokens="
                    f"{params.max_tokens} its beams reach {longest}, above max_model_len="
                    f"{sched.max_model_len}. Lower max_tokens or shorten the prompt."
                )
            if -(-longest // sched.block_size) > sched.num_gpu_blocks - 1:
                raise ValueError(
                    f"beam_search: a beam of prompt {i} may reach {longest} tokens, more than "
                    f"the KV cache holds ({sched.num_gpu_blocks - 1} blocks of "
                    f"{sched.block_size}); lower max_tokens or raise num_gpu_blocks"
                )
        step_params = SamplingParams(logprobs=min(2 * params.beam_width, vocab), max_tokens=1,
                                     temperature=params.temperature)
        eos = self.engine.eos_token_id
        sort_key = create_sort_beams_key_function(eos, params.length_penalty)
        instances = [BeamSearchInstance(ids) for _, ids in items]
        total = EngineStats()
        steps = range(params.max_tokens)
        if use_tqdm:
            from tqdm import tqdm

            steps = tqdm(steps, desc="Beam search", unit="token", leave=False)
        for _ in steps:
            beam_items = [(None, beam.tokens) for inst in instances for beam in inst.beams]
            if not beam_items:
                break
            tracked = self._make_requests(beam_items, [step_params] * len(beam_items))
            outputs = self._run(beam_items, tracked, use_tqdm=False)
            _add_stats(total, self.last_stats)
            answers = iter(out.outputs[0].logprobs[0] if out.outputs[0].logprobs else None
                           for out in outputs)
            for inst in instances:
                batch = [next(answers) for _ in inst.beams]
                expand_beams(inst, batch, params.beam_width, eos, params.ignore_eos, sort_key)
        self.last_stats = total
        results = []
        for inst in instances:
            out = finish_beams(inst, params.beam_width, sort_key)
            for beam in out.sequences:
                beam.text = self._decode(beam.tokens, step_params)
            results.append(out)
        return results

    # ------------------------------------------------------------------ input checks

    def _encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "generate: this model has no tokenizer (no tokenizer.json beside it), so text "
                "prompts cannot be encoded; pass token ids, or LLM(..., tokenizer=...)"
            )
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # a user tokenizer without that keyword
            return list(self.tokenizer.encode(text))

    def _check_ids(self, ids: object, where: str) -> list[int]:
        if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
            raise TypeError(
                f"generate: {where} is a {type(ids).__name__}; pass a list of ints "
                "(e.g. tensor.tolist())"
            )
        if not isinstance(ids, (list, tuple)):
            raise TypeError(
                f"generate: {where} must be a str or a list of token ids, got "
                f"{type(ids).__name__} {ids!r:.60}"
            )
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise TypeError(
                f"generate: token ids must be ints, got {type(bad[0]).__name__} {bad[0]!r} in "
                f"{where} (floats are not truncated; convert them yourself if you mean it)"
            )
        if not ids:
            raise ValueError(f"generate: {where} is empty; give it at least one token")
        vocab = self.model.config.vocab_size
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(
                f"generate: token id {outside[0]} in {where} is outside the model's vocab "
                f"[0, {vocab})"
            )
        return list(ids)

    def _parse_one(self, prompt: object, where: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"generate: {where} is empty; give it at least one token")
            return prompt, self._check_ids(self._encode(prompt), where)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return (text if isinstance(text, str) else None,
                        self._check_ids(prompt["prompt_token_ids"], where))
            if isinstance(prompt.get("prompt"), str):
                return self._parse_one(prompt["prompt"], where)
            raise TypeError(
                f"generate: {where} is a dict without 'prompt' (str) or 'prompt_token_ids'"
            )
        return None, self._check_ids(prompt, where)

    def _parse_prompts(self, prompts: object) -> list[tuple[str | None, list[int]]]:
        """Normalise ``prompts`` into ``(text or None, token ids)`` pairs, checking each."""
        if prompts is None or isinstance(prompts, (int, float, bytes)):
            raise TypeError(
                "generate: prompts must be a str, a list of token ids, or a list of those; got "
                f"{type(prompts).__name__}"
            )
        if isinstance(prompts, (str, Mapping, torch.Tensor)):
            return [self._parse_one(prompts, "the prompt")]
        if type(prompts).__module__ == "numpy":
            return [self._parse_one(prompts, "the prompt")]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"generate: prompts must be a str or a list, got {type(prompts).__name__}"
            )
        if prompts and all(isinstance(t, (int, float)) for t in prompts):
            return [self._parse_one(list(prompts), "the prompt")]  # one prompt of token ids
        return [self._parse_one(p, f"prompt {i}") for i, p in enumerate(prompts)]

    def _parse_params(self, sampling_params: object, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams(temperature=0.0)] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise TypeError(
                "generate: sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
                + (" (build one with SamplingParams(**params))"
                   if isinstance(sampling_params, Mapping) else "")
            )
        if len(sampling_params) != n:
            raise ValueError(
                f"generate: got {n} prompts but {len(sampling_params)} SamplingParams; "
                "pass one for all or one per prompt"
            )
        return list(sampling_params)

    def _make_requests(self, items: list[tuple[str | None, list[int]]],
                       params_list: list[SamplingParams]) -> list[_Tracked]:
        """Build (and check) every request before queueing any, so bad input changes nothing."""
        vocab = self.model.config.vocab_size
        tracked: list[_Tracked] = []
        for i, ((_, ids), params) in enumerate(zip(items, params_list)):
            outside = [t for t in params.stop_token_ids if t >= vocab]
            if outside:
                raise ValueError(
                    f"generate: stop token id {outside[0]} (prompt {i}) is outside the model's "
                    f"vocab [0, {vocab})"
                )
            if params.stop and self.tokenizer is None:
                raise ValueError("generate: stop strings need a tokenizer to detokenize with")
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > vocab:
                    raise ValueError(
                        f"generate: {name}={value} (prompt {i}) asks for more tokens than the "
                        f"model's vocabulary has ({vocab}); use at most {vocab}, or -1 for all"
                    )
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            for j in range(params.n):
                child = child_sampling_params(params, j, extra)
                rid = f"{self._counter + i}-{j}"
                t = _Tracked(i, j, self.engine.make_request(rid, ids, child))
                if params.logprobs is not None or params.prompt_logprobs is not None:
                    t.logprobs = LogprobsProcessor(self.tokenizer, params.logprobs,
                                                   params.prompt_logprobs, len(ids))
                tracked.append(t)
        self._check_fits([t.request for t in tracked])
        return tracked

    def _check_fits(self, requests: list[Request]) -> None:
        """Raise before queueing anything if a request can never be served."""
        sched = self._scheduler_config
        usable = sched.num_gpu_blocks - 1
        for req in requests:
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

    # ------------------------------------------------------------------ running

    def _run(self, items: list[tuple[str | None, list[int]]], tracked: list[_Tracked],
             use_tqdm: bool) -> list[RequestOutput]:
        self._counter += len(items)
        engine = self.engine
        sched_stats = engine.scheduler.stats
        runner_stats = engine.model_runner.stats
        start_steps, start_preempt = sched_stats.num_steps, sched_stats.num_preemptions
        start_out = runner_stats.num_blocks_swapped_out
        start_in = runner_stats.num_blocks_swapped_in
        start_prompt_computed = runner_stats.num_prompt_tokens_computed
        start_q, start_h = engine.prefix_cache_queries, engine.prefix_cache_hits
        engine.peak_blocks_in_use = engine.peak_blocks_in_step = 0
        start_block_steps = engine.num_block_steps

        t0 = time.perf_counter()
        by_id = {t.request.request_id: t for t in tracked}
        first_token: dict[str, float] = {}
        finished_at: dict[str, float] = {}
        with_stop = {rid for rid, t in by_id.items() if t.request.sampling_params.stop}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(tracked), desc="Processed prompts", unit="req", leave=False)
        with_logprobs = {rid: t.logprobs for rid, t in by_id.items() if t.logprobs is not None}
        self._take_logprobs({})  # drop what an earlier, failed call left behind
        try:
            for t in tracked:
                t.request.arrival_time = t0
                engine.add_request(t.request)
            stalled_at: tuple | None = None
            while engine.has_unfinished_requests():
                outputs = engine.step()
                if with_logprobs:
                    self._take_logprobs(with_logprobs)
                now = time.perf_counter()
                for out in outputs:
                    rid = out.request_id
                    first_token.setdefault(rid, now)
                    finished = out.finished
                    if not finished and rid in with_stop and self._hit_stop_string(by_id[rid]):
                        engine.scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
                        finished = True
                    if finished:
                        finished_at[rid] = now
                        if bar is not None:
                            bar.update(1)
                if outputs:
                    stalled_at = None
                    continue
                # No request gained a token: fine during chunked prefill or a swap, a livelock
                # when the step left everything as it was (the next one would do the same).
                state = self._progress_state(tracked)
                if state == stalled_at:
                    raise RuntimeError(self._stall_message())
                stalled_at = state
            for t in tracked:
                if t.logprobs is not None:
                    self._check_logprobs_arrived(t)
        except BaseException:
            self._abort_after_failure(tracked)
            raise
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0

        results: list[RequestOutput] = []
        for i, (text, ids) in enumerate(items):
            completions = sorted((t.child_index, t) for t in tracked if t.prompt_index == i)
            first = completions[0][1].request
            rid = first.request_id
            results.append(RequestOutput(
                request_id=rid.rsplit("-", 1)[0],
                prompt=text,
                prompt_token_ids=list(ids),
                outputs=[self._completion(j, t) for j, t in completions],
                prompt_logprobs=(completions[0][1].logprobs.prompt_logprobs
                                 if completions[0][1].logprobs is not None else None),
                metrics={
                    "arrival_time": t0,
                    "first_token_time": first_token.get(rid, float("nan")),
                    "finished_time": finished_at.get(rid, float("nan")),
                    "num_cached_tokens": max(first.num_cached_tokens, 0),
                },
            ))

        pool = engine.scheduler.kv_cache_manager.block_pool
        requests = [t.request for t in tracked]
        self.last_stats = EngineStats(
            num_steps=sched_stats.num_steps - start_steps,
            num_requests=len(requests),
            num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            num_generated_tokens=sum(r.num_output_tokens for r in requests),
            num_prompt_tokens_computed=runner_stats.num_prompt_tokens_computed
            - start_prompt_computed,
            elapsed_s=elapsed,
            kv_blocks_total=pool.num_gpu_blocks - 1,
            kv_blocks_in_use=engine.num_blocks_in_use,
            peak_kv_blocks_in_use=engine.peak_blocks_in_use,
            peak_kv_blocks_in_step=engine.peak_blocks_in_step,
            num_kv_block_steps=engine.num_block_steps - start_block_steps,
            prefix_cache_queries=engine.prefix_cache_queries - start_q,
            prefix_cache_hits=engine.prefix_cache_hits - start_h,
            num_preemptions=sched_stats.num_preemptions - start_preempt,
            num_blocks_swapped_out=runner_stats.num_blocks_swapped_out - start_out,
            num_blocks_swapped_in=runner_stats.num_blocks_swapped_in - start_in,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_cache_torch_dtype=str(engine.model_runner.kv_caches[0][0].dtype).replace(
                "torch.", ""),
            kv_block_bytes=kv_block_bytes(self.model, self._scheduler_config.block_size,
                                          self.config.kv_cache_dtype),
        )
        return results

    def _decode(self, token_ids: Sequence[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(list(token_ids),
                                         skip_special_tokens=params.skip_special_tokens)
        except TypeError:  # a user tokenizer without that keyword
            return self.tokenizer.decode(list(token_ids))

    def _hit_stop_string(self, t: _Tracked) -> bool:
        """Check the request's new output text for its stop strings (after ``min_tokens``)."""
        req, params = t.request, t.request.sampling_params
        text = self._decode(req.output_token_ids, params)
        if req.num_output_tokens <= params.min_tokens:
            t.text_len = len(text)  # text made within min_tokens never stops the request
            return False
        found = check_stop_strings(text, len(text) - t.text_len, params.stop,
                                   params.include_stop_str_in_output)
        t.text_len = len(text)
        if found is None:
            return False
        req.stop_reason, t.cut = found
        return True

    def _completion(self, index: int, t: _Tracked) -> CompletionOutput:
        req, params = t.request, t.request.sampling_params
        ids = list(req.output_token_ids)
        shown = ids
        if (isinstance(req.stop_reason, int) or (
                req.get_finished_reason() == FinishReason.STOP and req.stop_reason is None
        )) and ids and not params.include_stop_str_in_output:
            shown = ids[:-1]  # a stop token (or EOS) ends the output without being part of it
        text = self._decode(shown, params)
        if t.cut is not None:
            text = text[: t.cut]
        lp = t.logprobs
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=ids,
            finish_reason=_reason(req.get_finished_reason()),
            stop_reason=req.stop_reason,
            cumulative_logprob=lp.cumulative_logprob if lp is not None else None,
            logprobs=lp.logprobs if lp is not None else None,
        )

    # ------------------------------------------------------------------ log-probabilities

    def _take_logprobs(self, processors: dict[str, LogprobsProcessor]) -> None:
        """Hand the runner's new log-probability rows to the requests' processors (the rows of
        requests not in ``processors`` are dropped)."""
        take = getattr(self.engine.model_runner, "take_logprobs", None)
        if take is None:
            return
        sample, prompt = take()
        for rid, steps in sample.items():
            if rid in processors:
                for rows in steps:
                    processors[rid].add_sampled(rows)
        for rid, chunks in prompt.items():
            if rid in processors:
                for first, rows in chunks:
                    processors[rid].add_prompt(first, rows)

    def _check_logprobs_arrived(self, t: _Tracked) -> None:
        """A request that asked for log-probabilities got one dict per generated token and per
        prompt position, or the engine's pieces do not produce them: say which."""
        lp, req = t.logprobs, t.request
        if req.status == RequestStatus.FINISHED_ABORTED:
            return
        got = len(lp.logprobs) if lp.logprobs is not None else req.num_output_tokens
        if got == req.num_output_tokens and not lp.num_prompt_rows_missing:
            return
        raise RuntimeError(
            f"request {req.request_id} asked for log-probabilities but got {got} of "
            f"{req.num_output_tokens} generated-token rows and misses "
            f"{lp.num_prompt_rows_missing} prompt rows: make the model runner gather them "
            "(lab 03-04: _sample calls the given self._gather_sample_logprobs(logits, states, "
            "tokens), execute_model returns self._with_logprobs(output, hidden, meta)). A "
            "prompt that asks for prompt_logprobs must also not be served from the prefix cache "
            "(KVCacheManager.get_computed_blocks)."
        )

    # ------------------------------------------------------------------ failures

    def _progress_state(self, tracked: list[_Tracked]) -> tuple:
        """Everything a step could change that decides the next step."""
        sched = self.engine.scheduler
        return (
            tuple((r.request_id, r.status, r.num_computed_tokens, r.num_output_tokens)
                  for r in (t.request for t in tracked)),
            sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        )

    def _stall_message(self) -> str:
        sched = self.engine.scheduler
        pool = sched.kv_cache_manager.block_pool
        return (
            f"the engine stalled: a step scheduled nothing and changed nothing while requests "
            f"wait ({len(sched.running)} running, {len(sched.waiting)} waiting, "
            f"{len(getattr(sched, 'swapped', ()))} swapped; {pool.get_num_free_blocks()} of "
            f"{pool.num_gpu_blocks - 1} KV blocks free), so every later step would do the same. "
            "The scheduler cannot make progress: check Scheduler.schedule (a request it never "
            "schedules, or a budget it never spends). The requests of this call were aborted."
        )

    def _abort_after_failure(self, tracked: list[_Tracked]) -> None:
        """Leave the engine as if this call's requests had never been queued.

        Abort them through the scheduler (which frees their blocks), make the runner forget every
        request the scheduler no longer serves, and drop the prefix cache: blocks the failed
        step registered may hold KV it never wrote. If the engine is still not clean (a fault
        left the scheduler's queues inconsistent), build a fresh engine core.
        """
        ids = [t.request.request_id for t in tracked]
        engine = self.engine
        try:
            self._take_logprobs({})
            engine.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            # The runner keeps only what the scheduler still serves (the failed step may also
            # have lost the scheduler's news of requests that finished before it).
            runner, live = engine.model_runner, engine.scheduler.requests
            for rid in [r for r in runner.requests if r not in live]:
                del runner.requests[rid]
            runner.batch_req_ids = [r for r in runner.batch_req_ids if r in live]
            clean = (not engine.has_unfinished_requests() and engine.num_blocks_in_use == 0
                     and engine.scheduler.kv_cache_manager.reset_prefix_cache())
        except Exception:  # the state is too broken to repair in place
            clean = False
        for t in tracked:
            if not t.request.is_finished():
                t.request.status = RequestStatus.FINISHED_ABORTED
        if not clean:
            self.engine = self._make_engine()


def _add_stats(total: EngineStats, step: EngineStats) -> None:
    """Fold one call's statistics into a running total: counts add up, the peak is the largest,
    the rest (sizes, the last state) is the latest call's."""
    for f in dataclasses.fields(EngineStats):
        value = getattr(step, f.name)
        if f.name.startswith("peak_"):
            value = max(value, getattr(total, f.name))
        elif f.name.startswith("num_") or f.name in ("elapsed_s", "prefix_cache_queries",
                                                    "prefix_cache_hits"):
            value += getattr(total, f.name)
        setattr(total, f.name, value)


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)
