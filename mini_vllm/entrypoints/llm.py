"""``mini_vllm.LLM``: prompts in, generated text out, through the whole engine.

``LLM`` is the user's entry point: it loads the model, checks the engine's knobs
(:class:`~mini_vllm.config.EngineConfig`), tokenizes prompts, makes ``Request`` objects, runs the
engine core (:class:`~mini_vllm.engine.core.EngineCore`) until every request finishes (with a
progress bar over requests) and detokenizes. Upstream spreads this over ``LLM``, ``LLMEngine``
and the engine-core client; mini_vllm runs the core in the caller's process and keeps one class.

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

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mini_vllm.config import EngineConfig, kv_block_bytes
from mini_vllm.engine.core import EngineCore, EngineCoreBase
from mini_vllm.engine.detokenizer import check_stop_strings
from mini_vllm.engine.logprobs import LogprobsProcessor
from mini_vllm.engine.output_processor import _Tracked
from mini_vllm.engine.parallel_sampling import child_sampling_params
from mini_vllm.entrypoints.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    create_sort_beams_key_function,
    expand_beams,
    finish_beams,
)
from mini_vllm.metrics.stats import EngineStats
from mini_vllm.model_executor.model_loader.loader import (
    _load_model,
    check_weight_dtype,
    load_draft_model,
    store_weights,
)
from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.platforms import check_device, default_num_threads
from mini_vllm.request import FinishReason, Request, RequestStatus
from mini_vllm.sampling_params import BeamSearchParams, SamplingParams
from mini_vllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["LLM"]


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
    decode step reads; see
    :meth:`~mini_vllm.model_executor.models.llama.LlamaForCausalLM.set_weight_dtype`. ``"q4_1"`` or
    ``"q8_0"``: stored as GGUF's blocks of 32 weights (5 or 8.5 bits a weight), dequantized in
    registers as they are read: a model read from a GGUF file (or a folder converted from one)
    keeps the file's own blocks, so its values are the fp32 model's; other weights are quantized
    here (see :func:`mini_vllm.model_executor.model_loader.gguf_loader.linear_blocks`).
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
        check_weight_dtype(weight_dtype, device)
        dev = check_device(device)
        loaded = _load_model(model, tokenizer, dev)
        self.model = loaded.model.eval()
        store_weights(self.model, weight_dtype, loaded.path)
        self.weight_dtype = weight_dtype
        self.tokenizer = loaded.tokenizer
        self.extra_eos_token_ids = loaded.extra_eos_token_ids
        self.num_threads = num_threads or default_num_threads(self.model)
        if dev.type == "cpu":
            torch.set_num_threads(self.num_threads)
        # A draft model (if any) is loaded once, here: its cache counts in kv_cache_memory.
        self.draft_model = load_draft_model(self.config.speculative_config, self.model)
        self._scheduler_config = self.config.scheduler_config(self.model, self.draft_model)
        self._engine: EngineCoreBase | None = self._make_engine()
        self._counter = 0
        self.last_stats = EngineStats()

    @property
    def engine(self) -> EngineCoreBase:
        """The engine core; built anew if it was released (``AsyncLLM`` releases it, with its
        KV cache, while the core runs in a process of its own)."""
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    @engine.setter
    def engine(self, engine: EngineCoreBase | None) -> None:
        self._engine = engine

    def _make_engine(self) -> EngineCoreBase:
        c = self.config
        return EngineCore(
            self.model, self._scheduler_config, tensor_parallel_size=c.tensor_parallel_size,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            use_cuda_ops=c.use_cuda_ops, kv_cache_dtype=c.kv_cache_dtype, kv_scales=c.kv_scales,
            enforce_eager=c.enforce_eager, speculative_config=c.speculative_config,
            draft_model=self.draft_model, async_scheduling=c.async_scheduling,
            persistent_batch=c.persistent_batch, attention_backend=c.attention_backend,
            kv_transfer_config=c.kv_transfer_config)

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
        from mini_vllm.tokenizers.tokenizer import render_chat_template

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
        :func:`mini_vllm.entrypoints.beam_search.expand_beams` makes the next beams from the
        answers. Returns one :class:`BeamSearchOutput` per prompt: sequences best first, each with
        its tokens (prompt included), its text (the decoded tokens, prompt included, as upstream),
        one log-probability dict per generated token and its cumulative log-probability.

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
            total.add(self.last_stats)
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
        # A scheduler without speculative decoding (lab 03-01's) counts no drafts.
        spec_stats = getattr(engine.scheduler, "spec_decoding_stats", SpecDecodingStats())
        start_spec = spec_stats.copy()

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
                engine.post_step()
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
                    raise RuntimeError(engine.stall_message())
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
            spec_decoding=spec_stats.minus(start_spec),
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
            reset_batch = getattr(runner, "reset_persistent_batch", None)
            if reset_batch is not None:  # its rows may hold half of the failed step's diff
                reset_batch()
            clean = (not engine.has_unfinished_requests() and engine.num_blocks_in_use == 0
                     and engine.scheduler.kv_cache_manager.reset_prefix_cache())
        except Exception:  # the state is too broken to repair in place
            clean = False
        for t in tracked:
            if not t.request.is_finished():
                t.request.status = RequestStatus.FINISHED_ABORTED
        if not clean:
            self.engine = self._make_engine()


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)
