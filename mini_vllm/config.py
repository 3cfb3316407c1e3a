"""Plain configuration dataclasses of mini_vllm (no model files, no engine arguments parsing).

Each dataclass checks its values once, in ``__post_init__``, and raises ``ValueError`` naming the
field; code that receives a config can trust it. :class:`SchedulerConfig` is what the scheduler
reads; :class:`EngineConfig` every knob of the engine, from which ``LLM`` builds the rest.

upstream: vllm/config/ (a package there: ``scheduler.py``, ``cache.py``, ``vllm.py``; mini_vllm's
two dataclasses fit one module)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mini_vllm.attention.fp8 import (
    KV_CACHE_DTYPES,
    check_kv_scale,
    is_fp8,
    kv_cache_torch_dtype,
)

if TYPE_CHECKING:
    from mini_vllm.model_executor.models.llama import LlamaForCausalLM

__all__ = ["ATTENTION_BACKENDS", "KV_RESERVATIONS", "KV_ROLES", "KV_TRANSPORTS", "PREEMPTION_MODES",
           "RESERVATION_POLICIES", "EngineConfig", "KVTransferConfig", "SchedulerConfig",
           "kv_block_bytes"]

PREEMPTION_MODES = ("recompute", "swap")
# The contiguous-reservation baselines (mini_vllm.core.sched.reservation computes their sizes).
RESERVATION_POLICIES = ("max", "pow2", "oracle")
# What SchedulerConfig.kv_reservation accepts: paging, or one of the reservation policies.
KV_RESERVATIONS = ("paged", *RESERVATION_POLICIES)
ATTENTION_BACKENDS = ("paged", "triton")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_TRANSPORTS = ("shm", "tcp")


@dataclass
class SchedulerConfig:
    """Everything the scheduler needs: its budgets, the KV-cache geometry and the preemption mode.

    Upstream spreads these over ``SchedulerConfig`` and ``CacheConfig``; mini_vllm keeps one flat
    dataclass because the scheduler is the only reader.

    * ``max_num_seqs``: at most this many requests are RUNNING at once.
    * ``max_num_batched_tokens``: the per-step token budget (new tokens over all requests).
    * ``max_model_len``: prompt plus output never exceeds this many tokens.
    * ``block_size`` / ``num_gpu_blocks``: the paged cache (block 0 is the null block, so
      ``num_gpu_blocks - 1`` blocks are usable).
    * ``long_prefill_token_threshold``: when > 0, a request gets at most this many tokens per
      step, so that one long prompt cannot take the whole budget.
    * ``preemption_mode``: ``"recompute"`` (v1: drop the KV, recompute it later) or ``"swap"``
      (V0: copy the KV to ``num_cpu_blocks`` CPU blocks and back).
    * ``kv_reservation``: ``"paged"`` (blocks are claimed as a request grows) or an Orca-style
      policy of :mod:`mini_vllm.core.sched.reservation` (``"max"``, ``"pow2"``, ``"oracle"``): a
      request claims the blocks of its whole reservation when it is admitted and keeps them until it
      finishes. Baselines for lab 03-06, not how vLLM runs.
    * ``static_batching``: admit new requests only when nothing runs, so a batch runs until its
      longest request finishes (FasterTransformer's batching; lab 03-06's baseline).
    * ``num_lookahead_tokens``: KV slots a running request claims past its scheduled tokens,
      for a draft model's drafts (:attr:`SpeculativeConfig.num_lookahead_tokens`); 0 without.

    upstream: vllm/config/scheduler.py:26 @ v0.11.0
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_gpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    kv_reservation: str = "paged"
    static_batching: bool = False
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("num_lookahead_tokens", 0),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 1),
            ("block_size", 1),
            ("num_gpu_blocks", 2),
            ("long_prefill_token_threshold", 0),
            ("num_cpu_blocks", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SchedulerConfig: {name} must be an int >= {low}, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"SchedulerConfig: block_size must be a power of two, got {self.block_size}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"SchedulerConfig: preemption_mode must be one of {PREEMPTION_MODES}, "
                f"got {self.preemption_mode!r}"
            )
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(
                f"SchedulerConfig: kv_reservation must be one of {KV_RESERVATIONS}, "
                f"got {self.kv_reservation!r}"
            )
        if not isinstance(self.static_batching, bool):
            raise ValueError(
                f"SchedulerConfig: static_batching must be True or False, "
                f"got {self.static_batching!r}"
            )
        if self.preemption_mode == "swap" and self.num_cpu_blocks < 2:
            # The CPU pool reserves block 0 like the GPU pool, so one usable block needs two.
            raise ValueError(
                "SchedulerConfig: preemption_mode='swap' needs num_cpu_blocks >= 2 "
                f"(got {self.num_cpu_blocks}); give the CPU pool room for the swapped KV"
            )


# Proposers mini_vllm runs (upstream also has draft models, EAGLE, MTP and suffix decoding).
SPECULATIVE_METHODS = ("ngram", "draft_model")
# How many of a proposal's tokens are checked: as many as pay (mini_vllm), or all (as upstream).
DRAFT_POLICIES = ("adaptive", "always")
# How a draft model picks its guesses (upstream's names).
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to ``num_speculative_tokens`` tokens per
    request and step, and the target model checks them all in its next forward pass.

    * ``method``: ``"ngram"`` (prompt lookup, :mod:`mini_vllm.spec_decode.ngram_proposer`) or
      ``"draft_model"`` (a small model guesses, :mod:`mini_vllm.spec_decode.draft_model`).
    * ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram): the n-gram lengths the lookup
      tries. As upstream, when only one is given the other takes its value, and when neither
      is, both are 5.
    * ``model`` (draft model): the draft, as ``LLM(model=...)`` takes one (a checkpoint path, a
      known name, a loaded ``LlamaForCausalLM``), with the target's vocabulary;
      ``"tiny_shakespeare_draft"`` is the shipped model's own (``mini_vllm/checkpoints/``).
    * ``num_draft_layers`` (draft model, instead of ``model``): the draft is the target's first
      ``num_draft_layers`` layers with its final norm and head (self-speculation, sharing the
      target's weights; a mini_vllm addition). A draft model needs lookahead slots
      (:attr:`num_lookahead_tokens`) for the drafts it feeds back in.
    * ``draft_sample_method`` (draft model): ``"greedy"`` (default) drafts the draft's argmax,
      which the rejection sampler treats as certain (``q`` one-hot); ``"probabilistic"`` samples
      a sampled request's drafts from the draft's distribution at the request's temperature and
      hands that distribution to the rejection sampler as ``q``.
    * ``draft_policy``: ``"adaptive"`` (default) checks, per request, only as many drafted tokens
      as its measured acceptance and the measured cost of the extra rows pay for
      (:mod:`mini_vllm.spec_decode.draft_policy`; a mini_vllm addition), so that speculation
      stops costing time where drafts keep failing (except for a seeded sampled request, which
      checks every proposed token so that its seed alone decides its tokens); ``"always"``
      checks every proposed token, as upstream does.

    upstream: vllm/config/speculative.py:42 @ v0.11.0
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_policy: str = "adaptive"
    model: object = None
    num_draft_layers: int | None = None
    draft_sample_method: str = "greedy"

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a request's tokens that the scheduler claims for its drafts: a draft
        model writes the K/V of the drafts it feeds back in; an n-gram lookup writes none.

        upstream: vllm/v1/core/sched/scheduler.py:160 @ v0.11.0 (EAGLE's lookahead there; today
        a draft model's too, ``VllmConfig.num_lookahead_tokens``)
        """
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def __post_init__(self) -> None:
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"SpeculativeConfig: draft_policy must be one of {DRAFT_POLICIES}, "
                             f"got {self.draft_policy!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig: method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        if self.method == "draft_model":
            if (self.model is None) == (self.num_draft_layers is None):
                raise ValueError("SpeculativeConfig: method 'draft_model' needs a draft: give "
                                 "model (a checkpoint) or num_draft_layers (the target's first "
                                 "layers), not both")
            if self.num_draft_layers is not None and (
                    not isinstance(self.num_draft_layers, int)
                    or isinstance(self.num_draft_layers, bool) or self.num_draft_layers < 1):
                raise ValueError("SpeculativeConfig: num_draft_layers must be an int >= 1, got "
                                 f"{self.num_draft_layers!r}")
        elif (self.model is not None or self.num_draft_layers is not None
              or self.draft_sample_method != "greedy"):
            raise ValueError(f"SpeculativeConfig: model, num_draft_layers and "
                             f"draft_sample_method are for method 'draft_model', not "
                             f"{self.method!r}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"SpeculativeConfig: draft_sample_method must be one of "
                             f"{DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SpeculativeConfig: {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"SpeculativeConfig: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}")


@dataclass
class KVTransferConfig:
    """How an engine shares prompt KV with other engines through a KV connector (lab 04-06;
    :mod:`mini_vllm.distributed.kv_transfer`).

    * ``kv_role``: ``"kv_producer"`` (a prefill engine: saves the full blocks of every prompt it
      computes), ``"kv_consumer"`` (a decode engine: loads the longest run of a prompt's blocks
      the store holds instead of computing them) or ``"kv_both"``.
    * ``kv_transport``: ``"shm"`` (one shared-memory segment per block, named
      ``{kv_store}_{block hash}``; ``kv_store`` is the name prefix) or ``"tcp"`` (the producer
      serves its blocks on ``kv_store`` = ``"host:port"``, the consumer pulls them).
    * ``kv_buffer_blocks``: how many blocks the producer keeps (the oldest go first).

    upstream: vllm/config/kv_transfer.py:57 @ v0.33.0
    """

    kv_role: str
    kv_transport: str = "shm"
    kv_store: str = "mini_vllm_kv"
    kv_buffer_blocks: int = 4096

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"KVTransferConfig: kv_role must be one of {KV_ROLES}, got "
                             f"{self.kv_role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"KVTransferConfig: kv_transport must be one of {KV_TRANSPORTS}, "
                             f"got {self.kv_transport!r}")
        store = self.kv_store
        if self.kv_transport == "tcp":
            host, _, port = str(store).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"KVTransferConfig: with kv_transport='tcp', kv_store is the "
                                 f"producer's 'host:port', got {store!r}")
        elif not (isinstance(store, str) and 0 < len(store) <= 64
                  and store.replace("_", "").isalnum() and store.isascii()):
            raise ValueError(f"KVTransferConfig: with kv_transport='shm', kv_store is a name "
                             f"prefix of letters, digits and '_' (64 at most), got {store!r}")
        n = self.kv_buffer_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"KVTransferConfig: kv_buffer_blocks must be an int >= 1, got {n!r}")


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
      decode step on the CPU runs as one compiled call where it can
      (:mod:`mini_vllm.worker.cpu_decode`, the CPU's counterpart of the CUDA graphs this flag turns
      off upstream).
    * ``speculative_config``: a :class:`SpeculativeConfig`, or the same fields as a dict (as
      upstream's ``LLM(speculative_config={...})``); ``None`` (default): no speculation.
    * ``async_scheduling``: plan each step while the one before it runs (the engine core's busy
      loop, :meth:`~mini_vllm.engine.core.EngineCore.step_with_batch_queue`); ``None``
      (default): on for a model on a CUDA device, off on a CPU (where it does not pay: see
      ``benchmarks/async_scheduling.py``); never with speculative decoding.
    * ``persistent_batch``: keep the runner's batch in rows that live across steps, updated by
      diffs (:mod:`mini_vllm.worker.persistent_runner`, lab 04-03) instead of rebuilding it each
      step; ``False`` (default): the per-step runner of lab 03-04.
    * ``attention_backend``: ``"paged"`` (default): PagedAttention for the decodes and
      chunked-prefill attention for the rest (labs 02-04, 02-06, 03-02); ``"triton"``: one
      Triton kernel for the whole batch (:mod:`mini_vllm.attention.triton_unified`, lab 02-07;
      compiled on a CUDA GPU, interpreted on a CPU: slow, for correctness). Not with an fp8 cache.
    * ``tensor_parallel_size``: split the model and its KV cache over this many processes
      (:mod:`mini_vllm.executor.multiproc_executor`; 1, the default, is one process). Each rank
      holds ``1/tp`` of the KV heads of the same number of blocks. Not with speculation, async
      scheduling or the persistent batch; the model must split (its heads and MLP evenly).
    * ``kv_transfer_config``: a :class:`KVTransferConfig` (or its fields as a dict): share prompt
      KV with other engines (a prefill engine and a decode engine, lab 04-06). Not with
      tensor parallelism, speculation, async scheduling or the persistent batch.

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
    speculative_config: SpeculativeConfig | dict | None = None
    async_scheduling: bool | None = None
    persistent_batch: bool = False
    attention_backend: str = "paged"
    tensor_parallel_size: int = 1
    kv_transfer_config: KVTransferConfig | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_transfer_config, dict):
            self.kv_transfer_config = KVTransferConfig(**self.kv_transfer_config)
        if not isinstance(self.kv_transfer_config, (KVTransferConfig, type(None))):
            raise TypeError("EngineConfig: kv_transfer_config must be a KVTransferConfig, a dict "
                            f"of its fields or None, got {self.kv_transfer_config!r}")
        if self.kv_transfer_config is not None and (
                self.tensor_parallel_size != 1 or self.speculative_config is not None
                or self.async_scheduling or self.persistent_batch):
            raise ValueError("EngineConfig: kv_transfer_config runs with the default engine "
                             "only; leave tensor_parallel_size at 1 and speculative_config, "
                             "async_scheduling and persistent_batch unset with it")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"EngineConfig: tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1 and (self.speculative_config is not None or self.async_scheduling
                       or self.persistent_batch):
            raise ValueError("EngineConfig: tensor_parallel_size > 1 runs the default engine "
                             "only; leave speculative_config, async_scheduling and "
                             "persistent_batch unset with it")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig: attention_backend must be one of "
                             f"{ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "triton" and is_fp8(self.kv_cache_dtype):
            raise ValueError("EngineConfig: the triton attention backend reads a cache of the "
                             "model's dtype; leave kv_cache_dtype='auto' with it")
        if not isinstance(self.persistent_batch, bool):
            raise TypeError(f"EngineConfig: persistent_batch must be True or False, got "
                            f"{self.persistent_batch!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"EngineConfig: async_scheduling must be None, True or False, got "
                            f"{self.async_scheduling!r}")
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig(**self.speculative_config)
        if not isinstance(self.speculative_config, (SpeculativeConfig, type(None))):
            raise TypeError("EngineConfig: speculative_config must be a SpeculativeConfig, a "
                            f"dict of its fields or None, got {self.speculative_config!r}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("EngineConfig: async_scheduling=True does not run with a "
                             "speculative_config (a step's drafts come too late to plan the "
                             "next step with); leave async_scheduling unset or False")
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

    def scheduler_config(self, model: LlamaForCausalLM,
                         draft_model: LlamaForCausalLM | None = None) -> SchedulerConfig:
        """The scheduler's half of this config, with the KV-cache size resolved for ``model``
        (and ``draft_model``, whose cache has as many blocks: a ``kv_cache_memory`` budget pays
        for both)."""
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
            if draft_model is not None:
                block_bytes += kv_block_bytes(draft_model, self.block_size)
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
            num_lookahead_tokens=(self.speculative_config.num_lookahead_tokens
                                  if self.speculative_config is not None else 0),
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
