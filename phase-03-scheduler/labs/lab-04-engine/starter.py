"""Lab 03-04 starter: the engine step loop.

Every piece the step needs exists already: the scheduler (labs 03-01..03-03), the attention
metadata builder (lab 03-02), PagedAttention and the cache ops (phase 02), the model, the sampler.
You write the code that makes them one engine: the model runner's step (tasks 1-4) and the
engine's step (task 5). ``ModelRunnerBase`` (the KV cache tensors, swaps and copies, the attention
backend, the per-request record, the gathering of log-probabilities) and ``EngineCoreBase`` (the
scheduler, the runner, requests in, statistics) are given. Then beam search runs on your engine:
you write its step: the score that ranks beams (task 6) and the expansion of the live beams with
the bookkeeping of completed ones (task 7); ``LLM.beam_search`` (given) submits every live beam
to the engine as a one-token request with ``2 * beam_width`` log-probabilities and calls them.

Each docstring is a contract: what goes in, what comes out, what must hold afterwards. How to get
there is yours to work out; when stuck, climb the hint ladder: ``python -m course hint 03-04 N`` (a
question), then ``--level 2`` (a small case to trace by hand), ``--level 3`` (the idea, and the
tests that check it), then ``--level 4`` (the upstream lines to read).

Run the graded tests against this file with::

    LAB_IMPL=starter pytest phase-03-scheduler/labs/lab-04-engine -q
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mini_vllm.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from mini_vllm.engine.core import EngineCoreBase
from mini_vllm.entrypoints.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
)
from mini_vllm.logprobs import Logprob
from mini_vllm.outputs import EngineCoreOutput, ModelRunnerOutput
from mini_vllm.sample.sampler import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.model_runner import CachedRequestState, ModelRunnerBase

__all__ = [
    "AttentionMetadata",
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CachedRequestData",
    "CachedRequestState",
    "EngineCore",
    "Logprob",
    "ModelRunner",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingMetadata",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "build_attention_metadata",
    "create_sort_beams_key_function",
    "expand_beams",
    "finish_beams",
    "get_beam_search_score",
    "reorder_batch_to_split_decodes_and_prefills",
]


class ModelRunner(ModelRunnerBase):
    """Turns one ``SchedulerOutput`` into one sampled token per finished-prefill request.

    Given by ``ModelRunnerBase`` (read it in ``mini_vllm/worker/model_runner.py``):
    ``self.model``, ``self.kv_caches`` (one ``(key_cache, value_cache)`` per layer),
    ``self.attn_backend``, ``self.sampler``, ``self.block_size``, ``self.device``,
    ``self.requests`` (request id -> ``CachedRequestState``), ``self.batch_req_ids`` (the batch
    order of the previous step), ``self._new_request_state(new_request_data)``,
    ``self._execute_block_ops(scheduler_output)``, ``self._account(metadata)``,
    ``self._forward(input_ids, metadata)`` (the model over the step),
    ``self._stop_token_ids(state)``, and the log-probabilities that ``LLM`` reports and beam
    search ranks by: ``self._gather_sample_logprobs(logits, states, tokens)`` and
    ``self._with_logprobs(output, hidden, meta)``.
    """

    @torch.no_grad()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Task 4: the runner's half of one engine step.

        Input: the step's ``SchedulerOutput``. Afterwards, whatever the step holds:

        * the runner's records follow the scheduler's diff (your ``_update_states``), also in a
          step that schedules no token (it may still finish requests or move blocks);
        * the step's block copies (``blocks_to_swap_out``, ``blocks_to_swap_in``,
          ``blocks_to_copy``) are in the cache *before* the model reads it: a request swapped
          back in attends to the KV it left with. ``self._execute_block_ops`` makes them.

        A step with ``total_num_scheduled_tokens == 0`` runs no model and returns an empty
        ``ModelRunnerOutput`` (no ids, no tokens). Otherwise the model runs once over the flat
        batch of ``_prepare_inputs`` through the given ``self._forward(input_ids, meta)`` (it
        calls ``self.model(input_ids, positions, self.kv_caches, meta, self.attn_backend)`` with
        ``positions = meta.positions`` on ``self.device``, or runs a decode step as one compiled
        call; either writes the step's K/V into the paged cache and returns one hidden row per
        token), the step is
        counted with ``self._account(meta)``, and the output is ``ModelRunnerOutput(req_ids,
        req_id_to_index, sampled)`` with the requests in batch order (``meta.req_ids``),
        ``req_id_to_index[r]`` the position of ``r`` in it and ``sampled`` what ``_sample``
        returned, passed through the given ``self._with_logprobs(output, hidden, meta)``: it
        attaches the step's log-probabilities (those ``_sample`` gathered and those of the
        prompt positions in ``hidden``) and returns the output.

        Speculative decoding (phase 04) adds three given calls. Before ``_prepare_inputs``,
        ``drafts = self._stage_drafts(scheduler_output)`` appends the step's draft tokens to the
        requests' ``token_ids``, so that your inputs cover them; when ``drafts`` is not empty,
        ``self._sample_with_drafts(hidden, meta, drafts)`` samples in place of your ``_sample``
        (it checks the drafts and leaves the emitted tokens, not the drafts, in ``token_ids``);
        and once ``sampled`` is known, ``self._propose_drafts(meta, sampled, drafts)`` guesses
        the next drafts. Without speculation ``drafts`` is always empty and ``_propose_drafts``
        does nothing.
        """
        raise NotImplementedError(
            "lab 03-04, task 4: implement ModelRunner.execute_model "
            "(hint: python -m course hint 03-04 4)"
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Task 1: make ``self.requests`` (id -> ``CachedRequestState``) follow the scheduler.

        Afterwards:

        * no id of ``finished_req_ids`` is in ``self.requests`` (an id the runner never saw is
          ignored);
        * each ``scheduled_new_reqs`` entry has a fresh record, ``self._new_request_state(new)``
          (prompt, block table, prefix-cache hit, its own generator when seeded);
        * for each ``scheduled_cached_reqs`` entry ``i`` (a request the runner knows):
          ``num_computed_tokens`` is ``num_computed_tokens[i]``, the scheduler's count *before*
          this step; if ``resumed_from_preemption[i]``, the request lost its blocks when it was
          preempted and its table is now exactly ``new_block_ids[i][0]`` (the whole new table;
          an empty one when that is None); otherwise ``new_block_ids[i][0]`` (when not None) is
          appended to its table. Its tokens are left alone: the runner appended its samples
          itself.
        """
        raise NotImplementedError(
            "lab 03-04, task 1: implement ModelRunner._update_states "
            "(hint: python -m course hint 03-04 1)"
        )

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Task 2: the step's batch order, its flat ``input_ids`` and its attention metadata.

        Input: the step's ``SchedulerOutput`` (the records already updated by task 1).

        The batch order: the scheduled requests that were in the previous step's batch
        (``self.batch_req_ids``) keep their relative order and come first, the others follow in
        ``scheduler_output.scheduled_req_ids`` order; then
        ``reorder_batch_to_split_decodes_and_prefills(order, num_scheduled_tokens)`` makes it
        decodes-first (in place, with few moves). Afterwards ``self.batch_req_ids`` is that
        order (exactly the scheduled requests).

        Output ``(input_ids, meta)``: ``meta = build_attention_metadata(order,
        num_scheduled_tokens, {id: num_computed_tokens}, {id: block_ids}, self.block_size)``
        from the records; ``input_ids`` (int64, on ``self.device``) holds, request after request
        in batch order, request ``r``'s ``num_scheduled_tokens[r]`` tokens starting at its
        ``num_computed_tokens`` (a whole prompt, a chunk of it, or one token).
        """
        raise NotImplementedError(
            "lab 03-04, task 2: implement ModelRunner._prepare_inputs "
            "(hint: python -m course hint 03-04 2)"
        )

    def _sample(self, hidden: torch.Tensor, meta: AttentionMetadata) -> list[list[int]]:
        """Task 3: one token for each request whose step reaches the end of its tokens.

        Input: the model's hidden states, one row per token of the flat batch, and the step's
        metadata. Request ``i`` of ``meta.req_ids`` samples iff its step reaches the end of
        its tokens (``meta.seq_lens[i] >= state.num_tokens``); a request in the middle of a
        chunked prefill samples nothing. A sampling request's token comes from the logits of
        its *last* scheduled token (``self.model.compute_logits`` of that hidden row), drawn by
        ``self.sampler`` with ``SamplingMetadata.from_params``: its own ``SamplingParams``, its
        ``state.generator`` when it has one (so a seeded request draws the same tokens in any
        batch), and ``self._stop_token_ids(state)`` banned (the stop tokens that ``min_tokens``
        still holds back). The rows of requests that do not sample are never sampled.

        Once drawn, the tokens (the sampler's tensor, one per sampling row), the logits rows they
        came from and the sampling requests' states, in the same order, go to the given
        ``self._gather_sample_logprobs(logits, states, tokens)``: it records the
        log-probabilities of the requests that ask for them (beam search does).

        Output: one list per request, in batch order: ``[token]`` or ``[]``. Afterwards each
        sampled token is appended to its request's ``state.token_ids``.
        """
        raise NotImplementedError(
            "lab 03-04, task 3: implement ModelRunner._sample (hint: python -m course hint 03-04 3)"
        )


class EngineCore(EngineCoreBase):
    """The scheduler and your runner (``runner_cls``) in one loop."""

    runner_cls = ModelRunner

    def step(self) -> list[EngineCoreOutput]:
        """Task 5: one engine step: schedule, run the model, take the sampled tokens back.

        With no unfinished request (``self.scheduler.has_unfinished_requests()``) it returns
        ``[]`` and does nothing else: no schedule (the scheduler's step count stays), no model.
        Otherwise exactly one ``self.scheduler.schedule()``, one
        ``self.model_runner.execute_model`` of its output and one
        ``self.scheduler.update_from_output`` of both, then ``self._record_stats()`` (the
        prefix-cache and block counters that ``python -m mini_vllm`` prints). Returns what
        ``update_from_output`` returned: the news of every request that gained tokens.
        """
        raise NotImplementedError(
            "lab 03-04, task 5: implement EngineCore.step (hint: python -m course hint 03-04 5)"
        )

    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        """The busy loop's turn under async scheduling: lab 04-02 writes it, in the engine core
        that extends this one; this one steps one at a time. (Complete.)"""
        raise RuntimeError(
            "EngineCore.step_with_batch_queue: this is lab 03-04's engine core, which steps one "
            "at a time; async scheduling needs lab 04-02's EngineCore"
        )


# ----------------------------------------------------------------------------------------------
# Beam search on your engine (tasks 6 and 7)
# ----------------------------------------------------------------------------------------------


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: int | None, length_penalty: float = 1.0) -> float:
    """Task 6: the score that ranks beams (higher is better).

    ``tokens`` is the whole sequence, the prompt's tokens first; ``cumulative_logprob`` the sum
    of the log-probabilities of its generated tokens. The score is ``cumulative_logprob /
    length ** length_penalty`` where ``length`` counts every token of ``tokens``, the prompt's
    included, except a final ``eos_token_id`` (an EOS that ends a beam is not part of its text;
    an EOS elsewhere, or any token when ``eos_token_id`` is None, counts). ``length_penalty``
    0 ranks by the sum alone (shorter beams win: fewer negative terms); the larger it is, the
    more it favours longer beams.
    Pure: changes nothing. Cost: O(1).
    """
    raise NotImplementedError(
        "lab 03-04, task 6: implement get_beam_search_score "
        "(hint: python -m course hint 03-04 6)"
    )


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    """Task 6: the key that ranks beams, for ``sorted(beams, key=..., reverse=True)``.

    Returns a function of one ``BeamSearchSequence`` that gives its
    :func:`get_beam_search_score` over the beam's whole ``tokens`` (prompt included) and its
    ``cum_logprob``, with this ``eos_token_id`` and ``length_penalty``.
    """
    raise NotImplementedError(
        "lab 03-04, task 6: implement create_sort_beams_key_function "
        "(hint: python -m course hint 03-04 6)"
    )


def expand_beams(
    instance: BeamSearchInstance,
    answers: Sequence[dict[int, Logprob] | None],
    beam_width: int,
    eos_token_id: int | None,
    ignore_eos: bool,
    sort_key: Callable[[BeamSearchSequence], float],
) -> None:
    """Task 7: one step of the search for one prompt, in place.

    Input: ``instance.beams``, the live beams (best first), and ``answers[i]``, the engine's
    answer for live beam ``i``: a dict ``token id -> Logprob`` of the beam's next position (its
    top ``2 * beam_width`` tokens, and the sampled one), or ``None`` when that beam's request
    returned nothing (it was aborted).

    Every token of every answer makes one candidate: a new ``BeamSearchSequence`` with its own
    parent's tokens plus that token, the parent's ``logprobs`` plus the answer dict, and the
    parent's ``cum_logprob`` plus the token's ``.logprob``; a beam whose answer is ``None``
    makes none. Parents are never changed (a child shares no list with them). A candidate
    whose token is ``eos_token_id`` (unless ``ignore_eos``) is complete: it is appended to
    ``instance.completed`` (in the order made) and stays there until :func:`finish_beams`.

    Afterwards ``instance.beams`` holds the best ``beam_width`` other candidates by ``sort_key``
    (descending; ties keep the order in which they were made: beam by beam, and within a beam
    in its dict's order), and ``instance.history`` has one more entry, the token lists of the
    new live beams in that order. Raises ``ValueError`` naming both counts, before changing
    anything, when ``answers`` and the live beams differ in number. Cost: O(c log c) for c
    candidates.
    """
    raise NotImplementedError(
        "lab 03-04, task 7: implement expand_beams (hint: python -m course hint 03-04 7)"
    )


def finish_beams(instance: BeamSearchInstance, beam_width: int,
                 sort_key: Callable[[BeamSearchSequence], float]) -> BeamSearchOutput:
    """Task 7: the search's answer once no step is left.

    The completed beams and the still-live ones are ranked together by ``sort_key``
    (descending; ties keep completed before live, each in its list's order): a beam that ended
    with EOS at step 2 competes with the beams that ran to ``max_tokens``. Returns
    ``BeamSearchOutput(sequences=the best beam_width of them, beam_history=instance.history)``.
    """
    raise NotImplementedError(
        "lab 03-04, task 7: implement finish_beams (hint: python -m course hint 03-04 7)"
    )
