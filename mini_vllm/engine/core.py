"""The engine core: one scheduler and one model runner, and the step loop that drives them.

``schedule() -> execute_model() -> update_from_output()``: :class:`EngineCoreBase` holds the two
and the statistics they feed; :class:`EngineCore` adds the step (lab 03-04 has the student write
it). ``LLM`` (:mod:`mini_vllm.entrypoints.llm`) steps it in the caller's process; ``AsyncLLM``
(:mod:`mini_vllm.engine.async_llm`) runs it in a busy loop (:mod:`mini_vllm.engine.core_proc`), in
a process of its own by default, behind an engine-core client
(:mod:`mini_vllm.engine.core_client`). With speculative decoding, whoever loops over ``step()``
calls ``post_step()`` after each: it hands the drafts the runner proposed to the scheduler, for
the next step to check.

upstream: vllm/v1/engine/core.py
"""

from __future__ import annotations

from mini_vllm.config import SchedulerConfig, SpeculativeConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.outputs import EngineCoreOutput
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.model_runner import ModelRunner

__all__ = ["EngineCore", "EngineCoreBase"]


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
        speculative_config: SpeculativeConfig | None = None,
        draft_model: LlamaForCausalLM | None = None,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, log_stats=True)
        # Only an fp8 cache, enforce_eager or speculation pass the newer arguments, so a runner
        # class written before them still builds a default engine.
        extra_kwargs = ({"kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales}
                      if kv_cache_dtype != "auto" else {})
        if enforce_eager:
            extra_kwargs["enforce_eager"] = True
        # Speculation needs a scheduler that schedules drafts (lab 03-01's alone does not: lab
        # 04-04 adds _take_spec_tokens and the rest).
        self.use_spec_decode = (speculative_config is not None
                                and hasattr(self.scheduler, "_take_spec_tokens"))
        if self.use_spec_decode:
            extra_kwargs["speculative_config"] = speculative_config
            extra_kwargs["max_model_len"] = scheduler_config.max_model_len
            if draft_model is not None:
                extra_kwargs["draft_model"] = draft_model
        self.model_runner = self.runner_cls(
            model,
            block_size=scheduler_config.block_size,
            num_gpu_blocks=scheduler_config.num_gpu_blocks,
            num_cpu_blocks=scheduler_config.num_cpu_blocks,
            eos_token_id=eos_token_id,
            use_cuda_ops=use_cuda_ops,
            **extra_kwargs,
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


