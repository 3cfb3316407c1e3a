"""A stand-in ``vllm`` package made of mini_vllm, for running vLLM's own unit tests against it.

vLLM's tests for the block pool, the free queue, the hashing and prefix caching import from a
dozen ``vllm.*`` modules. :func:`install` puts an import hook in front of Python's own that
answers every ``vllm.*`` import (and the upstream test helpers the runner does not run) with a
module built here:

* a name the course has is mapped to mini_vllm's object, through a thin wrapper where the newest
  release renamed or reshaped the API (``BlockPool`` takes ``hash_block_size``, a block's hash is
  set with ``set_block_hash``, ``touch`` takes a flat list, ``get_computed_blocks`` returns three
  values, ``KVCacheManager`` takes a ``KVCacheConfig``, ``Request`` takes ``SamplingParams``
  with the EOS id in it);
* the scheduler's tests build today's configs (``VllmConfig`` and its parts, held as given)
  and a ``Scheduler`` or ``AsyncScheduler`` from them: mini_vllm's v1 schedulers with the
  settings they have (n-gram speculation in the synchronous one), which raise ``LeftOutError``
  for every other one (priority, connectors, pipeline parallelism, other drafters, ...);
  ``update_from_output`` returns today's ``{client: EngineCoreOutputs}``, with this step's
  spec-decoding counts when the scheduler logs stats;
* the rejection sampler's tests get today's API around mini_vllm's (``sample_adapter.py``);
* any other name is a :class:`LeftOut` placeholder: importing it works, using it raises
  ``LeftOutError`` naming it, so a test of a piece mini_vllm leaves out fails with that name.

The wrappers add no behaviour: today's behaviour itself is mini_vllm's, behind
``mini_vllm.core.kv_cache_utils.use_today_behaviour``, which :func:`install` turns on. With
``impl="stretch"`` the block pool, free queue, hashing and the event classes come from the
student's stretch of lab 02-01 (``stretch.py``, on their ``starter.py``) instead of the
reference; the KV cache manager is the reference's either way, over the pool under test.

upstream: none (course-only: the bridge to the newest release's tests)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import sample_adapter

from mini_vllm import request as mv_request
from mini_vllm import sampling_params as mv_sampling
from mini_vllm.core import block_pool as mv_block_pool
from mini_vllm.core import kv_cache_manager as mv_manager
from mini_vllm.core import kv_cache_utils as mv_utils
from mini_vllm.metrics import stats as mv_metrics

# Where the student's stretch lives (a test points it at a filled-in copy).
LAB_02_01 = Path(os.environ.get("UPSTREAM_TESTS_STRETCH_DIR") or (
    Path(__file__).resolve().parents[2] / "phase-02-paged-attention" / "labs"
    / "lab-01-block-allocator"))

# Upstream test helpers that are imported but not run here: served as placeholders too.
STUBBED_TEST_MODULES = ("tests.v1.kv_connector", "tests.utils", "tests.conftest")


class LeftOutError(NotImplementedError):
    """A test used a piece of vLLM that mini_vllm leaves out."""


# While the test files are imported (collection), calling a placeholder gives another one, so
# that a module-level ``new_mla_spec()`` or a parameter list does not stop a whole file; once
# tests run (the plugin sets this), calling one raises.
STRICT = False


class _LeftOutMeta(type):
    """Placeholders are classes so that tests may subclass them, subscript them in annotations,
    or use them in ``X | None``; calling one in a test raises."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not STRICT:
            return left_out(f"{cls.__qualname__}()")
        raise LeftOutError(f"{cls.__qualname__} is left out of mini_vllm")

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return left_out(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls):
        if not STRICT:
            return iter(())
        raise LeftOutError(f"{cls.__qualname__} is left out of mini_vllm")

    def __bool__(cls) -> bool:
        return True


class LeftOut(metaclass=_LeftOutMeta):
    """The base of every placeholder."""


def left_out(qualname: str) -> type:
    return _LeftOutMeta(qualname.rsplit(".", 1)[-1], (LeftOut,), {"__qualname__": qualname})


# --------------------------------------------------------------------------------------------
# The renamed and reshaped APIs
# --------------------------------------------------------------------------------------------


def _implementation(impl: str) -> SimpleNamespace:
    """The block pool, free queue and hashing pieces under test: the reference's, or the
    student's stretch (lab 02-01's ``stretch.py``, on top of their own ``starter.py``)."""
    if impl == "solution":
        return SimpleNamespace(
            KVCacheBlock=mv_utils.KVCacheBlock,
            FreeKVCacheBlockQueue=mv_utils.FreeKVCacheBlockQueue,
            prepend_n=lambda queue, blocks: queue._prepend_n(blocks),
            BlockPool=mv_block_pool.BlockPool,
            init_none_hash=mv_utils.init_none_hash,
            none_hash=lambda: mv_utils.NONE_HASH,
            hash_block_tokens=mv_utils.hash_block_tokens,
            generate_block_hash_extra_keys=mv_utils.generate_block_hash_extra_keys,
            BlockHashToBlockMap=mv_block_pool.BlockHashToBlockMap,
            events=mv_block_pool,
        )
    if impl == "stretch":
        from course.labs.loader import load_script

        stretch = load_script("lab_02_01_stretch", LAB_02_01 / "stretch.py")
        if not stretch.STARTED:
            raise LookupError("your stretch is not started: set STARTED = True in "
                             f"{LAB_02_01 / 'stretch.py'} (README: Stretch)")
        return SimpleNamespace(
            KVCacheBlock=stretch.KVCacheBlock,
            FreeKVCacheBlockQueue=stretch.FreeKVCacheBlockQueue,
            prepend_n=stretch.FreeKVCacheBlockQueue.prepend_n,
            BlockPool=stretch.BlockPool,
            init_none_hash=stretch.init_none_hash,
            none_hash=stretch.none_hash,
            hash_block_tokens=stretch.hash_block_tokens,
            generate_block_hash_extra_keys=stretch.generate_block_hash_extra_keys,
            BlockHashToBlockMap=stretch.yours.BlockHashToBlockMap,  # given in your starter
            events=stretch.yours,  # the event classes your pool emits (given in your starter)
        )
    raise ValueError(f"impl must be 'solution' or 'stretch', got {impl!r}")


def _today_block_classes(block_base: type, queue_base: type, prepend_n: Any):
    """Today's names for a block and a free queue class (same fields), and the function that
    gives a built pool's blocks and queue those classes."""

    class KVCacheBlock(block_base):
        """Today's block: the hash is set with ``set_block_hash`` (the property's setter at
        v0.11.0)."""

        __slots__ = ()

        def set_block_hash(self, block_hash: bytes, num_tokens: int | None = None) -> None:
            if num_tokens is not None:
                raise LeftOutError("a partial-block hash (num_tokens) is left out of mini_vllm")
            block_base.block_hash.fset(self, block_hash)

    class FreeKVCacheBlockQueue(queue_base):
        __slots__ = ()

        def prepend_n(self, blocks: list) -> None:
            prepend_n(self, blocks)

    def retype(pool: Any) -> None:
        # The pool built v0.11.0's classes; give them today's method names (same layout).
        for block in pool.blocks:
            block.__class__ = KVCacheBlock
        queue = pool.free_block_queue
        queue.fake_free_list_head.__class__ = KVCacheBlock
        queue.fake_free_list_tail.__class__ = KVCacheBlock
        queue.__class__ = FreeKVCacheBlockQueue

    return KVCacheBlock, FreeKVCacheBlockQueue, retype


def _build_core(impl: SimpleNamespace) -> dict[str, dict[str, Any]]:
    """Module name -> {upstream name: object} for every name the adapter maps."""
    KVCacheBlock, FreeKVCacheBlockQueue, _retype = _today_block_classes(  # noqa: N806
        impl.KVCacheBlock, impl.FreeKVCacheBlockQueue, impl.prepend_n)

    class BlockPool(impl.BlockPool):
        """``BlockPool(num_gpu_blocks, enable_caching, hash_block_size, ...)``."""

        def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                     enable_kv_cache_events: bool = False, metrics_collector: Any = None,
                     num_hash_lookahead_tokens: int = 0, medium: str = "GPU") -> None:
            if metrics_collector is not None or num_hash_lookahead_tokens:
                raise LeftOutError("KV-cache metrics and lookahead hashes are left out")
            super().__init__(num_gpu_blocks, enable_caching, enable_kv_cache_events)
            self.hash_block_size = hash_block_size
            _retype(self)

        def touch(self, blocks: Any) -> None:
            # Today: one flat list of blocks; v0.11.0: one list per KV-cache group.
            blocks = list(blocks)
            if blocks and not isinstance(blocks[0], list):
                blocks = [blocks]
            super().touch(tuple(blocks))

    def _retype(pool: Any) -> None:
        # The pool built v0.11.0's classes; give them today's method names (same layout).
        for block in pool.blocks:
            block.__class__ = KVCacheBlock
        queue = pool.free_block_queue
        queue.fake_free_list_head.__class__ = KVCacheBlock
        queue.fake_free_list_tail.__class__ = KVCacheBlock
        queue.__class__ = FreeKVCacheBlockQueue

    class KVCacheManager(mv_manager.KVCacheManager):
        """``KVCacheManager(kv_cache_config, max_model_len, scheduler_block_size,
        hash_block_size, ...)`` over one full-attention group."""

        def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                     scheduler_block_size: int | None = None,
                     hash_block_size: int | None = None, max_in_flight_tokens: Any = None,
                     enable_caching: bool = True, use_eagle: bool = False,
                     num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                     log_stats: bool = False, enable_kv_cache_events: bool = False,
                     dcp_world_size: int = 1, pcp_world_size: int = 1,
                     metrics_collector: Any = None, watermark: float = 0.0,
                     enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
            groups = kv_cache_config.kv_cache_groups
            if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
                raise LeftOutError("mini_vllm has one KV-cache group, of full attention")
            if (use_eagle or num_hash_lookahead_tokens or num_prefill_lookahead
                    or dcp_world_size != 1 or pcp_world_size != 1 or metrics_collector
                    or watermark or enable_mamba_shared_prefix_checkpoint):
                raise LeftOutError("eagle, lookahead, context parallelism, KV metrics and the "
                                   "watermark are left out of mini_vllm")
            block_size = groups[0].kv_cache_spec.block_size
            super().__init__(kv_cache_config.num_blocks, block_size, max_model_len,
                             enable_caching=enable_caching, log_stats=log_stats,
                             enable_kv_cache_events=enable_kv_cache_events)
            # The manager is the reference's; its pool is the one under test (the student's
            # stretch frees, evicts and hashes here, so the manager's tests see its free order).
            self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                                        hash_block_size or block_size,
                                        enable_kv_cache_events=enable_kv_cache_events)
            if hash_block_size is not None and hash_block_size != block_size:
                self._use_hash_block_size(hash_block_size)
            self.kv_cache_config = kv_cache_config

        def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None):
            if max_cache_hit_length is not None:
                raise LeftOutError("a caller's max_cache_hit_length is left out of mini_vllm")
            blocks, num_tokens = super().get_computed_blocks(request)
            # Today's third value: where a sliding-window or Mamba group's hit ends (none here).
            return blocks, num_tokens, 0

        @property
        def coordinator(self) -> SimpleNamespace:
            # Today the per-group managers sit behind a coordinator; mini_vllm folds its one
            # full-attention manager into KVCacheManager, so the view is the manager itself.
            return SimpleNamespace(single_type_managers=[self])

    @dataclass
    class FullAttentionSpec:
        block_size: int
        num_kv_heads: int = 1
        head_size: int = 1
        dtype: Any = None
        sliding_window: Any = None
        attention_chunk_size: Any = None
        kv_quant_mode: Any = None
        page_size_padded: Any = None

    @dataclass
    class KVCacheGroupSpec:
        layer_names: list
        kv_cache_spec: Any
        role: Any = None
        host_resident: bool = False
        enable_kv_transfer: bool = True

    @dataclass
    class KVCacheTensor:  # where a layer's KV lives: the manager never reads it
        size: int
        layers: list
        layer_stride: int = 0
        block_stride: int = 0

    @dataclass
    class KVCacheConfig:
        num_blocks: int
        kv_cache_tensors: list
        kv_cache_groups: list
        hisparse_host_num_blocks: int | None = None
        prefix_cache_retention_interval: Any = None
        extra: dict = field(default_factory=dict)

    @dataclass(frozen=True)
    class LoRARequest(mv_request.LoRARequest):
        """Today's LoRA request also names the adapter's path, which is part of its hash key."""

        lora_path: str = ""

    class SamplingParams(mv_sampling.SamplingParams):
        """Takes today's keywords the block tests pass; the EOS id comes from the generation
        config, where today's ``Request`` reads it."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.eos_token_id: int | None = None

        def update_from_generation_config(self, generation_config: dict,
                                          eos_token_id: int | None = None) -> None:
            if generation_config:
                raise LeftOutError("generation configs are left out of mini_vllm")
            self.eos_token_id = eos_token_id

    class Request(mv_request.Request):
        """Today's constructor: no ``eos_token_id`` (it is in the sampling parameters)."""

        def __init__(self, request_id: str, prompt_token_ids: list[int] | None,
                     sampling_params: SamplingParams | None, pooling_params: Any = None,
                     mm_features: Any = None, lora_request: Any = None,
                     cache_salt: str | None = None, priority: int = 0,
                     block_hasher: Any = None, prompt_embeds: Any = None,
                     arrival_time: float | None = None, session_id: Any = None,
                     **kwargs: Any) -> None:
            if pooling_params is not None or mm_features or prompt_embeds is not None or (
                    kwargs):
                raise LeftOutError("pooling, multimodal inputs, prompt embeddings and "
                                   f"{sorted(kwargs)} are left out of mini_vllm")
            super().__init__(request_id, prompt_token_ids, sampling_params,
                             getattr(sampling_params, "eos_token_id", None),
                             arrival_time=arrival_time, lora_request=lora_request,
                             cache_salt=cache_salt, priority=priority, block_hasher=block_hasher)

        def update_block_hashes(self) -> None:
            # Today's name for the hashing mini_vllm does inline when tokens are appended.
            if self.get_hash_new_full_blocks is not None:
                self.block_hashes.extend(self.get_hash_new_full_blocks())

    def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any,
                                 num_hash_lookahead_tokens: int = 0):
        if num_hash_lookahead_tokens:
            raise LeftOutError("lookahead block hashes are left out of mini_vllm")
        return mv_utils.get_request_block_hasher(hash_block_size, caching_hash_fn)

    utils = {
        "BlockHash": mv_utils.BlockHash,
        "BlockHashWithGroupId": mv_utils.BlockHashWithGroupId,
        "KVCacheBlock": KVCacheBlock,
        "FreeKVCacheBlockQueue": FreeKVCacheBlockQueue,
        "DEFAULT_NONE_HASH_SEED": mv_utils.TODAY_NONE_HASH_SEED,
        "init_none_hash": impl.init_none_hash,
        "hash_block_tokens": impl.hash_block_tokens,
        "get_request_block_hasher": get_request_block_hasher,
        "generate_block_hash_extra_keys": impl.generate_block_hash_extra_keys,
        "make_block_hash_with_group_id": mv_utils.make_block_hash_with_group_id,
        "get_block_hash": mv_utils.get_block_hash,
        "get_group_id": mv_utils.get_group_id,
        "need_extra_keys": mv_utils.need_extra_keys,
    }
    return {
        "vllm.v1.core.kv_cache_utils": utils,
        "vllm.v1.core.block_pool": {
            "BlockPool": BlockPool,
            "BlockHashToBlockMap": impl.BlockHashToBlockMap,
        },
        "vllm.v1.core.kv_cache_manager": {
            "KVCacheManager": KVCacheManager,
            "KVCacheBlocks": mv_manager.KVCacheBlocks,
            "Request": Request,
        },
        "vllm.v1.kv_cache_interface": {
            "FullAttentionSpec": FullAttentionSpec,
            "KVCacheGroupSpec": KVCacheGroupSpec,
            "KVCacheConfig": KVCacheConfig,
            "KVCacheTensor": KVCacheTensor,
        },
        "vllm.v1.request": {"Request": Request, "RequestStatus": mv_request.RequestStatus},
        "vllm.v1.utils": {"ConstantList": mv_request.ConstantList},
        "vllm.sampling_params": {"SamplingParams": SamplingParams},
        "vllm.lora.request": {"LoRARequest": LoRARequest},
        "vllm.utils.hashing": {"sha256": mv_utils.sha256},
        "vllm.utils.math_utils": {"cdiv": mv_manager.cdiv, "lcm": math.lcm},
        "vllm.v1.metrics.stats": {"PrefixCacheStats": mv_metrics.PrefixCacheStats},
        "vllm.distributed.kv_events": {
            name: getattr(impl.events, name)
            for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "KVCacheEvent")
        },
    }


# --------------------------------------------------------------------------------------------
# The scheduler: today's configs and outputs around mini_vllm's v1 Scheduler
# --------------------------------------------------------------------------------------------

# The one model the upstream scheduler tests name, and the length its config gives it (upstream
# reads it from the model's config.json when a test passes none).
MODEL_LENGTHS = {"facebook/opt-125m": 2048}


class _Config:
    """A config of today's shape that holds what it is given (``DEFAULTS`` first); the Scheduler
    wrapper reads it and refuses every setting mini_vllm leaves out."""

    DEFAULTS: dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        for key, value in {**self.DEFAULTS, **kwargs}.items():
            setattr(self, key, value)


class ModelConfig(_Config):
    DEFAULTS = {"model": "facebook/opt-125m", "max_model_len": None, "runner": "auto",
                "skip_tokenizer_init": False}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.max_model_len is None:
            if self.model not in MODEL_LENGTHS:
                raise LeftOutError(f"reading {self.model}'s config is left out of mini_vllm")
            self.max_model_len = MODEL_LENGTHS[self.model]
        self.is_encoder_decoder = False


class SchedulerConfig(_Config):
    DEFAULTS = {"max_num_seqs": 128, "max_num_active_seqs": None, "max_num_batched_tokens": 2048,
                "max_model_len": 2048, "long_prefill_token_threshold": 0,
                "long_prefill_token_threshold_adaptive": False, "disable_chunked_mm_input": False,
                "enable_chunked_prefill": True, "async_scheduling": False,
                "prefill_schedule_interval": 1, "policy": "fcfs"}


class CacheConfig(_Config):
    DEFAULTS = {"block_size": 16, "enable_prefix_caching": True, "cache_dtype": "auto"}


class ParallelConfig(_Config):
    DEFAULTS = {"pipeline_parallel_size": 1, "data_parallel_size": 1}


class ObservabilityConfig(_Config):
    DEFAULTS = {"per_request_spec_decode_metrics": "none"}


class SpeculativeConfig(_Config):
    """Held as given; the Scheduler wrapper accepts the n-gram methods and refuses the rest."""

    DEFAULTS = {"model": None, "method": None, "num_speculative_tokens": None,
                "prompt_lookup_min": None, "prompt_lookup_max": None, "parallel_drafting": False,
                "num_speculative_tokens_per_batch_size": None}


class VllmConfig(_Config):
    DEFAULTS = {"kv_transfer_config": None, "speculative_config": None, "diffusion_config": None,
                "ec_transfer_config": None, "lora_config": None}


class StructuredOutputManager(_Config):
    """Held by the scheduler; mini_vllm has no structured output, so nothing reads it."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config=vllm_config)


def _build_scheduler(full_attention_spec: type) -> dict[str, dict[str, Any]]:
    """Module name -> {upstream name: object} for the scheduler's tests."""
    from mini_vllm import config as mv_config
    from mini_vllm import outputs as mv_outputs
    from mini_vllm.core.sched import async_scheduler as mv_async
    from mini_vllm.core.sched import output as mv_output
    from mini_vllm.core.sched import scheduler as mv_scheduler

    @dataclass
    class EngineCoreOutputs:
        """Today's per-client batch of outputs (one client here, index 0)."""

        outputs: list = field(default_factory=list)
        scheduler_stats: Any = None

    @dataclass
    class SchedulerStats:
        """Today's per-step scheduler statistics, of which mini_vllm gives the part counted in
        the step (the checked drafts); reading any other field fails."""

        spec_decoding_stats: Any = None

    class ModelRunnerOutput(mv_outputs.ModelRunnerOutput):
        """Today's keywords; log-probabilities, pooling, connectors and masks are refused."""

        def __init__(self, req_ids: list[str], req_id_to_index: dict[str, int],
                     sampled_token_ids: Any = None, logprobs: Any = None,
                     prompt_logprobs_dict: Any = None, pooler_output: Any = None,
                     **kwargs: Any) -> None:
            used = [k for k, v in kwargs.items() if v is not None] + [
                k for k, v in (("logprobs", logprobs), ("prompt_logprobs_dict",
                               prompt_logprobs_dict), ("pooler_output", pooler_output)) if v]
            if used:
                raise LeftOutError(f"ModelRunnerOutput's {used} are left out of this bridge")
            super().__init__(list(req_ids), dict(req_id_to_index),
                             [[int(t) for t in ids] for ids in sampled_token_ids or []])

    class SchedulerOutput(mv_output.SchedulerOutput):
        """Today's keywords (encoder inputs and their hashes are required there); anything
        mini_vllm has no field for is refused unless empty."""

        def __init__(self, scheduled_new_reqs: list, scheduled_cached_reqs: Any,
                     num_scheduled_tokens: dict[str, int], total_num_scheduled_tokens: int,
                     scheduled_spec_decode_tokens: dict[str, list[int]],
                     scheduled_encoder_inputs: dict, finished_req_ids: set[str],
                     free_encoder_mm_hashes: list, preempted_req_ids: Any = None,
                     num_common_prefix_blocks: Any = None, **kwargs: Any) -> None:
            used = [k for k, v in (("scheduled_encoder_inputs", scheduled_encoder_inputs),
                                   ("free_encoder_mm_hashes", free_encoder_mm_hashes),
                                   *kwargs.items()) if v]
            if used:
                raise LeftOutError(f"SchedulerOutput's {used} are left out of mini_vllm")
            super().__init__(scheduled_new_reqs, scheduled_cached_reqs,
                             dict(num_scheduled_tokens), total_num_scheduled_tokens,
                             list(num_common_prefix_blocks or []), finished_req_ids,
                             preempted_req_ids=list(preempted_req_ids or []),
                             scheduled_spec_decode_tokens=scheduled_spec_decode_tokens)

    class TodaysScheduler:
        """``Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size,
        ...)``: mini_vllm's scheduler with the settings it has; any other raises. Mixed into
        mini_vllm's Scheduler and AsyncScheduler below (``ASYNC``: which one)."""

        ASYNC = False

        def __init__(self, vllm_config: VllmConfig, kv_cache_config: Any,
                     structured_output_manager: Any, block_size: int,
                     hash_block_size: int | None = None, include_finished_set: bool = False,
                     log_stats: bool = False) -> None:
            sc, mc = vllm_config.scheduler_config, vllm_config.model_config
            cc, pc = vllm_config.cache_config, vllm_config.parallel_config
            spec = vllm_config.speculative_config
            # Today the method may be given as the model's name only ("ngram").
            method = spec and (spec.method or spec.model)
            observability = getattr(vllm_config, "observability_config", None)
            refused = [what for what, used in (
                ("max_num_active_seqs", sc.max_num_active_seqs is not None),
                ("the adaptive long-prefill threshold", sc.long_prefill_token_threshold_adaptive),
                ("scheduling without chunked prefill", not sc.enable_chunked_prefill),
                # Today's config chooses the class (create_scheduler: AsyncScheduler when
                # async_scheduling); a synchronous scheduler under the async flag is refused.
                ("async scheduling in the synchronous Scheduler",
                 sc.async_scheduling and not self.ASYNC),
                ("a prefill interval", sc.prefill_schedule_interval != 1),
                (f"the {sc.policy!r} policy", sc.policy != "fcfs"),
                ("multimodal inputs", sc.disable_chunked_mm_input),
                ("pipeline and data parallelism",
                 pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1),
                ("KV and encoder transfer, LoRA limits, diffusion",
                 any(getattr(vllm_config, k) is not None for k in VllmConfig.DEFAULTS
                     if k != "speculative_config")),
                # mini_vllm drafts by n-gram lookup only: the drafters that run a model (draft
                # models, EAGLE, MTP, DFlash) and suffix decoding are left out.
                (f"the {method!r} speculative method",
                 spec is not None and method not in ("ngram", "ngram_gpu")),
                # As mini_vllm's EngineConfig: drafts are never planned a step ahead.
                ("speculative decoding under async scheduling", spec is not None and self.ASYNC),
                ("parallel drafting and draft lengths per batch size", spec is not None and (
                    spec.parallel_drafting or spec.num_speculative_tokens_per_batch_size)),
                ("per-request spec-decoding metrics",
                 getattr(observability, "per_request_spec_decode_metrics", "none") != "none"),
                ("pooling models", mc.runner == "pooling"),
                ("the finished-request set", include_finished_set),
                ("a hash block size other than the block size",
                 hash_block_size not in (None, block_size)),
            ) if used]
            groups = kv_cache_config.kv_cache_groups
            if len(groups) != 1 or type(groups[0].kv_cache_spec) is not full_attention_spec:
                refused.append("KV-cache groups other than one of full attention")
            if refused:
                raise LeftOutError(f"{', '.join(refused)}: left out of mini_vllm's scheduler")
            super().__init__(mv_config.SchedulerConfig(
                max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                max_model_len=mc.max_model_len, block_size=block_size,
                num_gpu_blocks=kv_cache_config.num_blocks,
                enable_prefix_caching=cc.enable_prefix_caching,
                long_prefill_token_threshold=sc.long_prefill_token_threshold), log_stats=log_stats)
            # mini_vllm's scheduler takes no speculative config: it schedules whatever drafts
            # update_draft_token_ids hands it. Building mini_vllm's config still checks that
            # the draft settings are ones it runs ("ngram_gpu" is the same lookup on the GPU;
            # like "ngram", it reserves no lookahead slots).
            self.speculative_config = spec and mv_config.SpeculativeConfig(
                method="ngram", num_speculative_tokens=spec.num_speculative_tokens,
                prompt_lookup_min=spec.prompt_lookup_min,
                prompt_lookup_max=spec.prompt_lookup_max)

        def schedule(self, throttle_prefills: bool = False) -> Any:
            if throttle_prefills:
                raise LeftOutError("prefill throttling is left out of mini_vllm")
            return super().schedule()

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
            before = self.spec_decoding_stats.copy()
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            if not self.log_stats:
                return {0: EngineCoreOutputs(outputs=outputs)} if outputs else {}
            # Today a scheduler that logs stats returns them every step (on client 0 when no
            # request has news), with the drafts checked in this step only, None if there
            # were none. mini_vllm keeps one running total: this step's part is the difference.
            # (Its fields keep mini_vllm's names, accepted_per_pos for today's
            # num_accepted_tokens_per_pos.) No other statistic is carried.
            step = self.spec_decoding_stats.minus(before)
            stats = SchedulerStats(spec_decoding_stats=step if step.num_drafts else None)
            return {0: EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)}

    class Scheduler(TodaysScheduler, mv_scheduler.Scheduler):
        pass

    class AsyncScheduler(TodaysScheduler, mv_async.AsyncScheduler):
        ASYNC = True

    return {
        "vllm.config": {name: cls for name, cls in (
            ("ModelConfig", ModelConfig), ("SchedulerConfig", SchedulerConfig),
            ("CacheConfig", CacheConfig), ("ParallelConfig", ParallelConfig),
            ("ObservabilityConfig", ObservabilityConfig), ("VllmConfig", VllmConfig),
            ("SpeculativeConfig", SpeculativeConfig))},
        "vllm.v1.core.sched.scheduler": {"Scheduler": Scheduler},
        "vllm.v1.core.sched.async_scheduler": {"AsyncScheduler": AsyncScheduler},
        "vllm.v1.core.sched.utils": {"check_stop": mv_scheduler.check_stop},
        # Today's DraftTokenIds has the same two fields.
        "vllm.v1.outputs": {"ModelRunnerOutput": ModelRunnerOutput,
                            "DraftTokenIds": mv_outputs.DraftTokenIds},
        # CachedRequestData is only built empty by the tests (make_empty), which mini_vllm has.
        "vllm.v1.core.sched.output": {"SchedulerOutput": SchedulerOutput,
                                      "CachedRequestData": mv_output.CachedRequestData},
        "vllm.v1.engine": {"EngineCoreOutputs": EngineCoreOutputs},
        # mini_vllm has one kind of KV-cache spec: nothing to register.
        "vllm.v1.core.single_type_kv_cache_manager": {
            "register_all_kvcache_specs": lambda vllm_config: None},
        "vllm.v1.structured_output": {"StructuredOutputManager": StructuredOutputManager},
    }


# --------------------------------------------------------------------------------------------
# The import hook
# --------------------------------------------------------------------------------------------

# Names forwarded to mini_vllm at every read, because upstream code reassigns them.
_LIVE = {"vllm.v1.core.kv_cache_utils": ("NONE_HASH",)}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, core: dict[str, dict[str, Any]], none_hash: Any) -> None:
        self.core = core
        self.none_hash = none_hash

    def _serves(self, name: str) -> bool:
        return name == "vllm" or name.startswith("vllm.") or any(
            name == m or name.startswith(m + ".") for m in STUBBED_TEST_MODULES)

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if not self._serves(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        module.__path__ = []  # every module is a package: any submodule resolves here
        module.__dict__.update(self.core.get(name, {}))
        live = _LIVE.get(name, ())
        none_hash = self.none_hash

        def __getattr__(attr: str) -> Any:
            if attr in live:
                return none_hash()
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = left_out(f"{name}.{attr}")
            setattr(module, attr, value)
            return value

        module.__getattr__ = __getattr__


def install(impl: str = "solution", today: bool = True) -> None:
    """Serve ``vllm.*`` from mini_vllm (``impl``: ``solution`` or ``stretch``) with today's
    behaviour on (``today=False`` keeps v0.11.0's, to see which tests tell the two apart).
    Call once, before the upstream tests are imported."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    mv_utils.use_today_behaviour(today)
    pieces = _implementation(impl)
    core = _build_core(pieces)
    for name, names in [*_build_scheduler(
            core["vllm.v1.kv_cache_interface"]["FullAttentionSpec"]).items(),
            *sample_adapter.build(LeftOutError).items()]:
        core.setdefault(name, {}).update(names)
    sys.meta_path.insert(0, _Finder(core, pieces.none_hash))
