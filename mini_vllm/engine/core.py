"""The engine core: one scheduler and one model runner, and the step loop that drives them.

``schedule() -> execute_model() -> update_from_output()``: :class:`EngineCoreBase` holds the two
and the statistics they feed; :class:`EngineCore` adds the step (lab 03-04 has the student write
it). ``LLM`` (:mod:`mini_vllm.entrypoints.llm`) steps it in the caller's process; ``AsyncLLM``
(:mod:`mini_vllm.engine.async_llm`) runs it in a busy loop (:mod:`mini_vllm.engine.core_proc`), in
a process of its own by default, behind an engine-core client
(:mod:`mini_vllm.engine.core_client`). With speculative decoding, whoever loops over ``step()``
calls ``post_step()`` after each: it hands the drafts the runner proposed to the scheduler, for
the next step to check.

Asynchronous scheduling (``async_scheduling``; never with speculative decoding): the scheduler
is an :class:`~mini_vllm.core.sched.async_scheduler.AsyncScheduler` and the busy loop steps with
:meth:`EngineCore.step_with_batch_queue`, which plans step N+1 while step N runs on the model
thread (one thread, so steps run in the order planned, as kernels on one CUDA stream). The
model's work runs in torch's and the attention kernels' C code, which releases the GIL, so the
busy loop's scheduling and output handling overlap it where a core is left for them. ``LLM``
steps with ``step()``, which runs the same scheduler one step at a time.

upstream: vllm/v1/engine/core.py
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mini_vllm.config import KVTransferConfig, SchedulerConfig, SpeculativeConfig
from mini_vllm.core import kv_cache_utils
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.core.sched.async_scheduler import AsyncScheduler
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine.kv_connector import KVConnectorScheduling
from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.outputs import EngineCoreOutput, ModelRunnerOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.model_runner import ModelRunner
from mini_vllm.worker.persistent_runner import PersistentBatchRunner

__all__ = ["BATCH_QUEUE_SIZE", "EngineCore", "EngineCoreBase"]

# Steps in flight at most under async scheduling: the one running and the one planned after it.
BATCH_QUEUE_SIZE = 2


class EngineCoreBase:
    """A scheduler and a model runner side by side; :class:`EngineCore` adds the step.

    ``runner_cls`` is the runner class to build (lab 03-04 plugs the student's in).
    ``async_scheduling``: ``None`` (default) turns it on for a model on a CUDA device, as
    upstream does, and off on a CPU, where the step's threads already take every core and the
    hand-off costs more than the overlap saves (``benchmarks/async_scheduling.py``); never with
    speculation (step N's drafts are proposed after it, too late to plan step N+1 with; upstream
    turns it off for its CPU n-gram proposer too), and ``True`` with speculation is refused.
    ``batch_queue``: the steps in flight (newest first), each ``(future, scheduler_output)``.
    ``persistent_batch``: build a :class:`PersistentBatchRunner` (lab 04-03: the batch kept in
    rows across steps) instead of ``runner_cls``.
    ``attention_backend``: ``"paged"`` or ``"triton"`` (the runner's; see ``EngineConfig``).
    ``tensor_parallel_size``: above 1, the runner is a
    :class:`~mini_vllm.executor.multiproc_executor.TensorParallelRunner` over that many ranks.

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
        speculative_config: SpeculativeConfig | None = None,
        draft_model: LlamaForCausalLM | None = None,
        async_scheduling: bool | None = None,
        persistent_batch: bool = False,
        attention_backend: str = "paged",
        tensor_parallel_size: int = 1,
        kv_transfer_config: KVTransferConfig | None = None,
    ) -> None:
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise TypeError(f"EngineCore: async_scheduling must be None, True or False, got "
                            f"{async_scheduling!r}")
        if not isinstance(persistent_batch, bool):
            raise TypeError(f"EngineCore: persistent_batch must be True or False, got "
                            f"{persistent_batch!r}")
        if async_scheduling and speculative_config is not None:
            raise ValueError(
                "EngineCore: async scheduling does not run with speculative decoding (a step's "
                "drafts are proposed after it, too late to plan the next one); leave "
                "async_scheduling unset or False")
        on_gpu = next(model.parameters()).device.type == "cuda"
        self.async_scheduling = speculative_config is None and (
            async_scheduling if async_scheduling is not None else on_gpu)
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(scheduler_config, log_stats=True)
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] = deque()
        self._model_thread: ThreadPoolExecutor | None = None
        # Only an fp8 cache, enforce_eager or speculation pass the newer arguments, so a runner
        # class written before them still builds a default engine.
        extra_kwargs = ({"kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales}
                      if kv_cache_dtype != "auto" else {})
        if enforce_eager:
            extra_kwargs["enforce_eager"] = True
        if attention_backend != "paged":
            extra_kwargs["attention_backend"] = attention_backend
        # Speculation needs a scheduler that schedules drafts (lab 03-01's alone does not: lab
        # 04-04 adds _take_spec_tokens and the rest).
        self.use_spec_decode = (speculative_config is not None
                                and hasattr(self.scheduler, "_take_spec_tokens"))
        if self.use_spec_decode:
            extra_kwargs["speculative_config"] = speculative_config
            extra_kwargs["max_model_len"] = scheduler_config.max_model_len
            if draft_model is not None:
                extra_kwargs["draft_model"] = draft_model
        runner_cls = self.runner_cls
        if persistent_batch:
            runner_cls = PersistentBatchRunner
            extra_kwargs["max_num_reqs"] = scheduler_config.max_num_seqs
            extra_kwargs["max_model_len"] = scheduler_config.max_model_len
        runner_kwargs = dict(block_size=scheduler_config.block_size,
                             num_gpu_blocks=scheduler_config.num_gpu_blocks,
                             num_cpu_blocks=scheduler_config.num_cpu_blocks,
                             eos_token_id=eos_token_id, use_cuda_ops=use_cuda_ops, **extra_kwargs)
        if tensor_parallel_size > 1:  # rank 0's runner here, the other ranks' in workers
            from mini_vllm.executor.multiproc_executor import TensorParallelRunner

            if self.async_scheduling or self.use_spec_decode or persistent_batch:
                raise ValueError("EngineCore: tensor_parallel_size > 1 runs the default engine "
                                 "only (no async scheduling, speculation or persistent batch)")
            self.model_runner = TensorParallelRunner(model, tensor_parallel_size, runner_cls,
                                                     **runner_kwargs)
        else:
            self.model_runner = runner_cls(model, **runner_kwargs)
        self.kv_connector: KVConnectorScheduling | None = None  # lab 04-06's, see _connect_kv
        if kv_transfer_config is not None:
            self._connect_kv(kv_transfer_config, scheduler_config.block_size)
        self.block_hasher = get_request_block_hasher(scheduler_config.block_size, sha256)
        self.eos_token_id = eos_token_id
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_blocks_in_use = 0
        self.peak_blocks_in_step = 0
        self.num_block_steps = 0

    def _connect_kv(self, config: KVTransferConfig, block_size: int) -> None:
        """Give the scheduler and the runner their halves of a KV connector (lab 04-06)."""
        from mini_vllm.distributed.kv_transfer import BlockStoreConnector, KVConnectorRole
        from mini_vllm.worker.kv_connector_model_runner_mixin import KVConnectorRunner

        if self.async_scheduling or self.use_spec_decode:
            raise ValueError("EngineCore: a KV connector runs with the default engine only "
                             "(no async scheduling or speculation)")
        if os.getenv("PYTHONHASHSEED") is None:
            # Engines that share blocks must name them alike: the chain's seed is the fixed one
            # upstream uses today, not v0.11.0's random bytes of each process.
            kv_cache_utils.NONE_HASH = sha256(kv_cache_utils.TODAY_NONE_HASH_SEED)
        self.kv_connector = KVConnectorScheduling(
            self.scheduler, BlockStoreConnector(KVConnectorRole.SCHEDULER, config, block_size))
        self.model_runner = KVConnectorRunner(
            self.model_runner, BlockStoreConnector(KVConnectorRole.WORKER, config, block_size))

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

    def post_step(self) -> None:
        """After a step: hand the draft tokens the runner proposed to the scheduler, which
        schedules them for checking in the next step. Nothing without speculative decoding.

        upstream: vllm/v1/engine/core.py:293 @ v0.11.0
        """
        if not self.use_spec_decode:
            return
        take = getattr(self.model_runner, "take_draft_token_ids", None)
        drafts = take() if take is not None else None
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)

    def step_fn(self) -> list[EngineCoreOutput] | None:
        """The busy loop's step: :meth:`EngineCore.step_with_batch_queue` under async
        scheduling (``None`` when it only planned a step), else :meth:`EngineCore.step`.

        upstream: vllm/v1/engine/core.py:166 @ v0.11.0 (the step_fn attribute)
        """
        return self.step_with_batch_queue() if self.async_scheduling else self.step()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future:
        """Start the step on the model thread; the future holds its ``ModelRunnerOutput``.

        One thread runs every step, in the order they were started: a step reads the tokens
        the one before it sampled, and writes KV the next may read.

        upstream: vllm/v1/executor/abstract.py:98 @ v0.11.0 (execute_model, non_block=True)
        """
        if self._model_thread is None:
            # The CPU ops' thread count is a per-thread setting: the model thread takes the
            # caller's.
            self._model_thread = ThreadPoolExecutor(
                1, thread_name_prefix="mini_vllm-model", initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),))
        return self._model_thread.submit(self.model_runner.execute_model, scheduler_output)

    def drain_batch_queue(self) -> None:
        """Wait for every step in flight and drop its result (after a failure, before the
        engine is cleaned up: nothing may still run on it); stop the model thread.

        upstream: none (upstream's executor is shut down with its workers)
        """
        while self.batch_queue:
            future, _ = self.batch_queue.pop()
            try:
                future.result()
            except Exception:  # noqa: S110 - the failure that mattered is being handled
                pass
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
            self._model_thread = None

    def shutdown(self) -> None:
        """Stop what the engine started: the model thread, and the tensor-parallel workers.

        upstream: vllm/v1/engine/core.py:834 @ v0.33.0
        """
        self.drain_batch_queue()
        for part in (self.model_runner, self.kv_connector):
            stop = getattr(part, "shutdown", None)
            if stop is not None:
                stop()

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

    def stall_message(self) -> str:
        """Why a loop stopped stepping: a step that scheduled nothing and changed nothing while
        requests wait would repeat forever (said with the scheduler's queues and free blocks)."""
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        return (
            f"the engine stalled: a step scheduled nothing and changed nothing while requests "
            f"wait ({len(sched.running)} running, {len(sched.waiting)} waiting, "
            f"{len(getattr(sched, 'swapped', ()))} swapped; {pool.get_num_free_blocks()} of "
            f"{pool.num_gpu_blocks - 1} KV blocks free), so every later step would do the same. "
            "The scheduler cannot make progress: check Scheduler.schedule (a request it never "
            "schedules, or a budget it never spends). The requests of this call were aborted."
        )

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

    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        """One turn of the busy loop under async scheduling: plan and start the next step,
        and while it can wait, return ``None`` at once; otherwise wait for the oldest step in
        flight and update the requests from its tokens (its outputs are returned).

        A step that schedules nothing is started all the same (it carries the ids of finished
        requests the runner must forget) but never makes the loop wait for a newer one.

        upstream: vllm/v1/engine/core.py:300 @ v0.11.0
        """
        queue = self.batch_queue
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            self._record_blocks_in_step()
            queue.appendleft((self.execute_model_async(scheduler_output), scheduler_output))
            if scheduler_output.total_num_scheduled_tokens > 0 and len(queue) < BATCH_QUEUE_SIZE:
                return None
        if not queue:
            return []
        future, scheduler_output = queue.pop()
        model_output: ModelRunnerOutput = future.result()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._record_stats()
        return outputs


