"""The engine exam: the pieces of every lab have to be right *together*.

Each lab's tests see one piece alone. The exam runs whole engines, built from whatever pieces this
process composed (:mod:`course.engine.compose`), and demands what nobody can argue with: every
completion equals a recomputation of the same request with no cache at all, token for token (greedy,
and seeded sampling with the same generator), with the same finish reason. Each case also asserts
that the mechanism it is named after really happened (a prefix hit, a chunked prefill, a preemption,
a swap), and that no KV block is still held once every request has finished.

Against the reference engine (``python -m course engine --exam`` runs it first), an engine must
also take the same steps: each step's scheduled tokens, preemptions, swaps, block tables, queues
and the runner's batch order are recorded (:class:`course.engine.engine_side.StepRecorder`) and
compared, and so are the mechanism counters of each call (COUNTERS). A failure then names every
counter that differs and the first step where the two engines part, with both values: the
diagnosis is computed, never guessed.

This module is the exam's trusted side: the cases, the oracle and every check run in a process
that never imports a student's code. The engines run in an engine process
(:mod:`course.engine.engine_side`) that answers requests with data; :class:`Exam` sends the
requests and judges the answers.

The model is a tiny random Llama (vocabulary 64, two layers, GQA) whose weights are scaled up so
that its logits are far apart: a choice never hinges on float rounding, so any difference from the
oracle is a logic error in the engine, not noise.

Run it with ``python -m course engine --exam``; this module holds the cases and the oracle.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import signal
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mini_vllm.attention.fp8 import is_fp8
from mini_vllm.distributed.kv_transfer import remove_shm_segments
from mini_vllm.entrypoints.router import PrefixRouter as ReferenceRouter
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.sample.sampler import Sampler, SamplingMetadata
from mini_vllm.sampling_params import SamplingParams

EOS = 63  # the exam tokenizer's end-of-sequence id
TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=1024,
)
# The fp8 case's twin of TINY: head size 16, because an fp8 cache packs 16 one-byte elements into
# each 16-byte vector of its key layout (x = 16), which a head of 8 cannot fill.
TINY_FP8 = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128)
# The tensor-parallel case's model: a vocabulary of 65 ids, which 2 and 4 ranks do not split
# evenly (their shards are padded), tied embeddings (the head shares the embedding's shard), and
# biases on every projection (a row-parallel layer adds its bias once, after the all-reduce).
TINY_TP = dataclasses.replace(TINY, vocab_size=65, tie_word_embeddings=True,
                              attention_bias=True, o_proj_bias=True, mlp_bias=True)
MODELS = {"tiny": TINY, "fp8": TINY_FP8, "tp": TINY_TP}
# Lab 02-07's case needs Triton, which installs on Linux only (where graders run).
_HAS_TRITON = importlib.util.find_spec("triton") is not None
SWEEP_SEED = 20261122  # the graded sweep's configurations are fixed by this seed
GRADED_SWEEP = 8  # configurations of the randomized sweep in a graded exam


def tiny_model(seed: int = 1, config: ModelConfig = TINY) -> LlamaForCausalLM:
    """The exam's model: random weights with a large scale, so that logits are well separated;
    biases (where the config has them) random too, so that each one counts."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    init_weights(model, seed=seed, std=0.5)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval().requires_grad_(False)


class IdTokenizer:
    """Token ids are the text: the exam's prompts are ids, and its messages show ids."""

    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(str(int(t)) for t in token_ids)


class SplitCharTokenizer(IdTokenizer):
    """Token ids as bytes of UTF-8 text, so that one character can span two tokens: ids 0-31
    are letters and a space, 32-47 the first byte of a two-byte character (0xC3-0xC6), 48-62 a
    continuation byte; a lone or cut byte decodes to U+FFFD. What a stream of the exam model's
    ids reads as text, and where a server must hold a character back (lab 03-05)."""

    PIECES = {**{i: bytes([0x61 + i]) if i < 26 else b" " for i in range(32)},
              **{i: bytes([0xC3 + (i - 32) % 4]) for i in range(32, 48)},
              **{i: bytes([0x80 + 2 * (i - 48)]) for i in range(48, EOS)}}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.PIECES.get(int(t), b"") for t in token_ids).decode(
            "utf-8", errors="replace")

    @classmethod
    def splits_a_character(cls, token_ids: Sequence[int]) -> bool:
        """Some two-byte character of the text is a first byte then a continuation."""
        return any(32 <= a < 48 and 48 <= b < EOS for a, b in zip(token_ids, token_ids[1:]))


# ----------------------------------------------------------------------------------------------
# The oracle: one request at a time, the whole sequence recomputed for every token
# ----------------------------------------------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # "length" or "stop"


def reference_completion(
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_id: int | None,
    max_model_len: int,
    kv_scales: Sequence[tuple[float, float]] | None = None,
) -> Completion:
    """What the engine must produce for one request (``params.n == 1``), with no cache at all.

    Same rules as the engine: stop tokens (and EOS unless ``ignore_eos``) are banned until
    ``min_tokens`` outputs exist; a seeded sampled request draws from its own generator seeded
    with ``params.seed``; the stop checks run in the scheduler's order (the length cap first, then
    EOS, then ``stop_token_ids``). With ``kv_scales`` (an fp8 cache's per-layer scales), keys and
    values are rounded through e4m3 as that cache stores them.
    """
    ids = list(prompt)
    out: list[int] = []
    generator = None
    if params.seed is not None and not params.greedy:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    sampler = Sampler()
    stops = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stops.append(eos_token_id)
    while True:
        logits = model.forward_reference(torch.tensor(ids), kv_scales)[-1:]
        banned = stops if len(out) < params.min_tokens else []
        meta = SamplingMetadata.from_params(
            [params], generators={0: generator} if generator else {}, banned_token_ids=[banned]
        )
        token = int(sampler(logits, meta)[0])
        out.append(token)
        ids.append(token)
        if len(ids) >= max_model_len or len(out) >= params.max_tokens:
            return Completion(out, "length")
        if token in stops:
            return Completion(out, "stop")


Beam = tuple[list[int], float]  # a beam of the brute force: (tokens, prompt first; cum_logprob)


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """The brute force's own ranking score: ``cum_logprob / length ** length_penalty``, where
    ``length`` counts the prompt and every generated token but a final EOS."""
    length = len(tokens) - (1 if tokens[-1] == eos_token_id else 0)
    return cum_logprob / length ** length_penalty


@torch.no_grad()
def last_logprobs(model: LlamaForCausalLM, sequences: list[list[int]]) -> torch.Tensor:
    """``log_softmax`` (float64) of each sequence's next-token logits, with no cache: one forward
    over all of them, right-padded (causal attention: padding after a position cannot change
    it)."""
    longest = max(map(len, sequences))
    ids = torch.tensor([seq + [0] * (longest - len(seq)) for seq in sequences])
    logits = model.forward_reference(ids)
    last = logits[torch.arange(len(sequences)), torch.tensor([len(s) - 1 for s in sequences])]
    return torch.log_softmax(last.double(), dim=-1)


def brute_force_beam_search(
    next_logprobs: Callable[[list[list[int]]], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    width: int,
    max_tokens: int,
    eos_token_id: int | None,
    *,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[list[Beam]]:
    """Per prompt, the best ``width`` beams ``(tokens, cum_logprob)``, best first, by v0.11.0's
    beam search written from its statement (not from mini_vllm): each step every live beam
    proposes its ``2 * width`` likeliest next tokens (``next_logprobs`` gives one row of
    log-probabilities per sequence, recomputed from scratch); candidates ending in EOS (unless
    ``ignore_eos``) are complete and wait; the best ``width`` others by :func:`beam_score` live
    on; at the end completed and live beams are ranked together."""
    def key(beam: Beam) -> float:
        return beam_score(beam[0], beam[1], eos_token_id, length_penalty)

    live: list[list[Beam]] = [[(list(prompt), 0.0)] for prompt in prompts]
    completed: list[list[Beam]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        beams = [beam for per_prompt in live for beam in per_prompt]
        if not beams:
            break
        rows = iter(next_logprobs([tokens for tokens, _ in beams]))
        for i, per_prompt in enumerate(live):
            candidates = []
            for tokens, cum in per_prompt:
                row = next(rows)
                top = row.topk(min(2 * width, row.numel()))
                for token, value in zip(top.indices.tolist(), top.values.tolist()):
                    child = (tokens + [token], cum + value)
                    done = token == eos_token_id and not ignore_eos
                    (completed[i] if done else candidates).append(child)
            live[i] = sorted(candidates, key=key, reverse=True)[:width]
    return [sorted(done + alive, key=key, reverse=True)[:width]
            for done, alive in zip(completed, live)]


# ----------------------------------------------------------------------------------------------
# Running one engine and comparing it with the oracle
# ----------------------------------------------------------------------------------------------


class ExamFailure(AssertionError):
    """A case's engine output or bookkeeping differs from what it must be.

    ``str()`` is one line (what happened); ``detail`` holds the lines that show why (the
    counters and the first step that differ from the reference engine's)."""

    def __init__(self, message: str, detail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.detail = list(detail)


class CaseTimeout(BaseException):  # noqa: N818  (not an Exception: student code must not catch it)
    """A case ran past its time limit (a loop that never ends, an engine that never finishes)."""


class EngineError(Exception):
    """An error the engine process reported: its class name (``kind``), message, where in the
    student's code it was raised (``where``) and whether it is a NotImplementedError."""

    def __init__(self, error: dict) -> None:
        self.kind = str(error.get("type", "Exception"))
        self.where = str(error.get("where", "?"))
        self.not_implemented = error.get("not_implemented") is True
        super().__init__(str(error.get("message", "")))


class EngineDied(Exception):
    """The engine process ended (a crash, an exit, a kill) or broke the protocol."""


@dataclass
class Engine:
    """What the exam holds of an engine the engine process built: its number there and what the
    exam configured it with (the oracle reads these, never what the engine says of itself)."""

    id: int
    max_model_len: int
    kv_scales: tuple[tuple[float, float], ...] | None  # an fp8 cache's scales, as configured
    kv_cache_dtype: str  # the dtype the engine reports for its cache
    attention: str = "paged"  # the attention kernel the engine reports ("paged" or "triton")
    model: str = "tiny"  # the exam model it runs (a key of MODELS)


@dataclass
class RequestResult:
    """One request's answer, as data: its ``n`` completions and ``metrics``
    (``num_cached_tokens``)."""

    outputs: list[Completion]
    metrics: dict


@dataclass
class Run:
    """One ``generate`` call of a case: the prompts, their params, the outputs and statistics."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    outputs: list[RequestResult] = field(default_factory=list)
    stats: object = None  # the engine's statistics (EngineStats's fields, as attributes)
    steps: list[dict] = field(default_factory=list)  # StepRecorder's records of the call
    cpu_blocks_held: int = 0  # swap blocks still held once every request finished


# The mechanism counters of one generate call. With the same requests and the same configuration
# the labs' specifications leave no freedom in them, so an engine must reproduce the reference
# engine's exactly. The first ones are the engine's own statistics (``LLM.last_stats``); those in
# TRACE_COUNTERS the exam counts itself from the scheduler's outputs (:class:`StepRecorder`).
COUNTERS = {
    "num_preemptions": "preemptions",
    "num_blocks_swapped_out": "blocks swapped out",
    "num_blocks_swapped_in": "blocks swapped in",
    "prefix_cache_hits": "prefix-cache hit tokens",
    "num_prefill_chunks": "prompts cut short by a step (chunked prefill)",
    "num_prompt_tokens_computed": "prompt tokens computed",
    "num_tokens_scheduled": "tokens scheduled",
    "num_blocks_given": "blocks added to block tables",
    "num_blocks_freed_by_preemption": "blocks freed by preemptions",
    "peak_kv_blocks_in_use": "KV blocks in use at the peak",
    "num_steps": "engine steps",
    "spec_decoding_num_draft_tokens": "draft tokens checked (speculative decoding)",
    "spec_decoding_num_accepted_tokens": "draft tokens accepted (speculative decoding)",
}
TRACE_COUNTERS = ("num_tokens_scheduled", "num_prefill_chunks", "num_blocks_given",
                  "num_blocks_freed_by_preemption")

# What the exam records of each engine step, in the order a difference is reported (causes
# first): what the scheduler decided, then the queues it left, then the runner's batch and the
# model's output. Each field has a short name (for a headline) and a label (for the detail).
STEP_FIELDS = {
    "admitted": ("cached tokens at admission",
                 "admitted or resumed, with the tokens already cached (request:tokens)"),
    "scheduled": ("tokens scheduled", "scheduled (request:tokens)"),
    "preempted": ("preemptions", "preempted (request:blocks it held)"),
    "swap_out": ("blocks swapped out", "blocks swapped out"),
    "swap_in": ("blocks swapped in", "blocks swapped in"),
    "tables": ("block tables", "block-table lengths (request:blocks)"),
    "running": ("running queue", "running queue"),
    "waiting": ("waiting queue", "waiting queue"),
    "swapped": ("swapped queue", "swapped queue"),
    "batch": ("batch order", "the runner's batch order"),
    "nan": ("NaN in the model's output", "rows of the model's output holding NaN"),
    "unreadable": ("an unreadable step", "the step's output, which the exam could not read"),
}


def trace_counters(steps: list[dict]) -> dict[str, int]:
    """The counters of TRACE_COUNTERS over a call's recorded steps."""
    return {
        "num_tokens_scheduled": sum(n for s in steps for _, n in s["scheduled"]),
        "num_prefill_chunks": sum(s["cut"] for s in steps),
        "num_blocks_given": sum(s["given"] for s in steps),
        "num_blocks_freed_by_preemption": sum(b for s in steps for _, b in s["preempted"]),
    }


def _show(value) -> str:
    """A step field as a short text: ``a:3 b:1`` for pairs, ``a b`` for ids, ``none`` for []."""
    if value is None:
        return "not recorded"
    if isinstance(value, list):
        if not value:
            return "none"
        items = [f"{v[0]}:{v[1]}" if isinstance(v, list) else str(v) for v in value]
        more = f" ... (+{len(items) - 12})" if len(items) > 12 else ""
        return " ".join(items[:12]) + more
    return str(value)


def counter_differences(mine: dict, reference: dict) -> list[str]:
    """``label: yours X, reference Y`` for every counter of COUNTERS that differs."""
    return [f"{label}: yours {mine[key]}, reference {reference[key]}"
            for key, label in COUNTERS.items()
            if key in mine and key in reference and mine[key] != reference[key]]


def first_divergence(mine: list[dict], reference: list[dict], finished: bool = True
                     ) -> tuple[int, list[str], list[str]] | None:
    """The first step (1-based) where the two engines' recorded steps differ, the labels of the
    fields that differ there and a line per field (both values), or None when the records are
    equal. A run that stopped early (it raised, ``finished`` false) is compared over the steps
    it made; a finished one that made fewer steps differs at the first step it lacks."""
    for i, (a, b) in enumerate(zip(mine, reference)):
        differ = [key for key in STEP_FIELDS if a.get(key) != b.get(key)]
        lines = [f"{STEP_FIELDS[key][1]}: yours {_show(a.get(key))}, reference "
                 f"{_show(b.get(key))}" for key in differ]
        if lines:
            same = [f"{STEP_FIELDS[key][1]} {_show(a[key])}" for key in ("scheduled", "preempted")
                    if a.get(key) and a.get(key) == b.get(key)]
            if same:
                lines.append("the same in both: " + "; ".join(same))
            return i + 1, [STEP_FIELDS[key][0] for key in differ], lines
    if len(mine) > len(reference):
        return len(reference) + 1, ["steps"], [f"yours runs {len(mine)} steps, the reference "
                                    f"{len(reference)}; yours scheduled "
                                    f"{_show(mine[len(reference)]['scheduled'])}"]
    if finished and len(mine) < len(reference):
        return len(mine) + 1, ["steps"], [f"yours runs {len(mine)} steps, the reference "
                                  f"{len(reference)}; the reference scheduled "
                                  f"{_show(reference[len(mine)]['scheduled'])}"]
    return None


def diagnosis(call: int, mine: dict, reference: dict, finished: bool = True
              ) -> tuple[str, list[str]]:
    """(a summary, the detail lines) of how generate call ``call`` (1-based) of an engine
    differs from the reference engine's: every counter that differs, then the first step where
    the recorded steps differ. ``mine`` and ``reference`` are :meth:`Exam.generate`'s records
    (``counters``, ``steps``); ``finished`` is false for a call that raised (its counters are
    not known, and only the steps it made are compared)."""
    detail = []
    counters = counter_differences(mine["counters"], reference["counters"]) if finished else []
    if counters:
        detail.append("counters that differ:")
        detail += [f"  {line}" for line in counters]
    where = first_divergence(mine["steps"], reference["steps"], finished)
    if where is not None:
        step, fields, lines = where
        detail.append(f"step {step} of generate call {call} is the first that differs:")
        detail += [f"  {line}" for line in lines]
        summary = (f"your engine's steps first differ from the reference's at step {step} "
                   f"({', '.join(fields[:3])})")
    elif not finished:
        summary = (f"your engine's {len(mine['steps'])} step(s) before the error were the "
                   "reference's")
        detail.append(f"steps 1 to {len(mine['steps'])} of generate call {call} equal the "
                      "reference engine's; the error came in the next one")
    else:
        summary = ""
    if counters and not summary:
        summary = f"{len(counters)} counter(s) differ from the reference engine's"
    return summary, detail


class Exam:
    """The context a case runs in: the engines (through ``engines``, the handle on an engine
    process or :class:`course.engine.engine_side.LocalEngines`), the oracle (memoised) and the
    checks. Everything here runs in the exam's own process; the engines answer with data.

    With ``reference_stats`` (case name -> the records of each ``generate`` call of that case
    on the reference engine: ``counters`` and ``steps``), every call must also reproduce them:
    the same counters (COUNTERS) and the same steps (STEP_FIELDS), or the case fails with a
    diagnosis of the first difference.
    """

    def __init__(self, engines, reference_stats: dict[str, list[dict]] | None = None) -> None:
        self.engines = engines
        self.models: dict[str, LlamaForCausalLM] = {"tiny": tiny_model()}
        self._oracle: dict[tuple, Completion] = {}
        self.reference_stats = reference_stats
        self.case = ""
        self.recorded: list[dict] = []
        self.current: list[dict] | None = None  # the steps of the call that failed, if any
        self.deadline: float | None = None

    def start(self, case: str, timeout_s: float = 0.0) -> None:
        """A new case: its records start empty and the engine process drops the last case's
        engines; each request gets what is left of ``timeout_s``."""
        self.case, self.recorded, self.current = case, [], None
        self.deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self.call("forget")

    def call(self, op: str, **args):
        """One request to the engines; their answer, or the error they report raised here
        (EngineError; CaseTimeout for a request that ran past the case's time)."""
        seconds = None if self.deadline is None else max(0.05, self.deadline - time.monotonic())
        answer = self.engines.call(op, args, seconds)
        if "ok" in answer:
            return answer["ok"]
        steps = answer.get("steps") if op == "generate" else None
        self.current = steps if isinstance(steps, list) else None
        if answer.get("timeout") is True:
            raise CaseTimeout()
        error = answer.get("error")
        raise EngineError(error if isinstance(error, dict) else {"message": repr(answer)[:200]})

    def export(self) -> dict:
        """The oracle's completions, as JSON (so another process need not recompute them)."""
        return {"oracle": [[list(k[0]), k[1], k[2], k[3] and [list(s) for s in k[3]], k[4],
                            v.token_ids, v.finish_reason]
                           for k, v in self._oracle.items()]}

    def preload(self, data: dict) -> None:
        for prompt, params, max_model_len, scales, model, tokens, reason in data.get("oracle",
                                                                                      []):
            key = (tuple(prompt), params, max_model_len,
                   tuple(tuple(s) for s in scales) if scales else None, model)
            self._oracle[key] = Completion(tokens, reason)

    def llm(self, **config) -> Engine:
        """An engine built with ``config`` (``LLM``'s keyword arguments; ``tokenizer`` "ids"
        or "split", ``lookahead`` slots every allocation reserves, ``model`` one of MODELS: by
        default "fp8" for an fp8 cache, else "tiny") in the engine process."""
        config.setdefault("max_model_len", TINY.max_position_embeddings)
        scales = None
        if is_fp8(config.get("kv_cache_dtype", "auto")):
            scales = tuple(tuple(float(x) for x in pair) for pair in config["kv_scales"])
        config.setdefault("model", "fp8" if scales else "tiny")
        made = self.call("new", config=config)
        return Engine(int(made["engine"]), config["max_model_len"], scales,
                      str(made["kv_cache_dtype"]), str(made.get("attention", "paged")),
                      config["model"])

    def serve(self, llm: Engine, multiprocessing: bool = False,
              step_timeout_s: float = 60.0) -> Served:
        """``llm`` behind the OpenAI-compatible server in the engine process; the exam is its
        client. ``multiprocessing``: the engine core in a process of its own, composed as the
        engine process is (lab 04-01), rather than on a thread of the engine process;
        ``step_timeout_s``: how long one step may run before the server takes the core for
        hung."""
        made = self.call("serve", engine=llm.id, multiprocessing=multiprocessing,
                         step_timeout_s=step_timeout_s)
        return Served(self, int(made["server"]), str(made["uds"]))

    def model_for(self, name: str) -> LlamaForCausalLM:
        """The oracle's copy of exam model ``name`` (a key of MODELS)."""
        if name not in self.models:
            self.models[name] = tiny_model(config=MODELS[name])
        return self.models[name]

    def expected(self, prompt: Sequence[int], params: SamplingParams, max_model_len: int,
                 kv_scales: tuple[tuple[float, float], ...] | None = None,
                 model: str | None = None):
        """The no-cache oracle's completion on exam model ``model`` (by default "fp8" with
        ``kv_scales``, else "tiny")."""
        model = model or ("fp8" if kv_scales else "tiny")
        key = (tuple(prompt), repr(params), max_model_len, kv_scales, model)
        if key not in self._oracle:
            self._oracle[key] = reference_completion(
                self.model_for(model), prompt, params, eos_token_id=EOS,
                max_model_len=max_model_len,
                kv_scales=kv_scales,
            )
        return self._oracle[key]

    def generate(self, llm: Engine, prompts, params, oracle: bool = True) -> Run:
        """Run ``prompts`` through ``llm`` and check every completion against the oracle, and
        (with reference records) the call's counters and steps against the reference's.

        ``oracle=False``: completions the no-cache oracle cannot predict (seeded sampling with
        speculative decoding, whose draws follow lab 04-04's protocol) are checked against the
        reference engine's own completions of the same call instead (with reference records)."""
        prompts = [list(p) for p in prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        run = Run(prompts, params_list)
        got = self.call("generate", engine=llm.id, prompts=prompts,
                        params=[{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
                                for p in params_list])
        try:
            run.outputs = [RequestResult([Completion(_ints(c["token_ids"]),
                                                     _text(c["finish_reason"]))
                                          for c in out["completions"]],
                                         {"num_cached_tokens": _int(out["num_cached_tokens"])})
                           for out in got["outputs"]]
            run.stats = types.SimpleNamespace(**{k: _number(v) for k, v in got["stats"].items()})
            run.steps = list(got["steps"])
            run.cpu_blocks_held = _int(got["cpu_blocks_held"])
            # (An answer without a counter is compared on the others: the tokens and the steps
            # are checked whatever the answer says.)
            counters = {k: getattr(run.stats, k) for k in COUNTERS
                        if k not in TRACE_COUNTERS and hasattr(run.stats, k)}
            counters.update(trace_counters(run.steps))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ExamFailure(f"generate call {len(self.recorded) + 1}: the engine's answer "
                              f"could not be read ({type(exc).__name__}: {exc})") from None
        call = len(self.recorded)
        tokens = [[c.token_ids for c in out.outputs] for out in run.outputs]
        self.recorded.append({"counters": counters, "steps": run.steps, "tokens": tokens})
        problem = self._check_outputs(llm, run, oracle)
        want = self.reference_record(call)
        if problem is None and not oracle and want is not None and "tokens" in want:
            problem = _compare_with_reference(call + 1, tokens, want["tokens"])
        if want is None:
            if problem:
                raise ExamFailure(problem)
            return run
        summary, detail = diagnosis(call + 1, self.recorded[-1], want)
        if problem:
            raise ExamFailure(f"{problem}; {summary}" if summary else problem, detail)
        if summary:
            raise ExamFailure(
                f"generate call {call + 1}: right tokens, but {summary}; fix that first, in "
                "the lab the bisection names",
                detail,
            )
        return run

    def reference_record(self, call: int) -> dict | None:
        """The reference engine's record of generate call ``call`` (0-based) of this case."""
        want = (self.reference_stats or {}).get(self.case)
        if want is None or call >= len(want) or "steps" not in want[call]:
            return None
        return want[call]

    def diagnose_error(self) -> list[str]:
        """For a case that raised during a generate call: how that call's steps so far compare
        with the reference engine's (empty without reference records)."""
        if self.current is None:
            return []
        call = len(self.recorded)
        want = self.reference_record(call)
        if want is None:
            return []
        try:
            return diagnosis(call + 1, {"counters": {}, "steps": self.current}, want,
                             finished=False)[1]
        except Exception:  # noqa: BLE001 - steps the exam cannot read explain nothing
            return []

    def _check_outputs(self, llm: Engine, run: Run, oracle: bool = True) -> str | None:
        """The first way the call's completions (against the oracle, unless ``oracle`` is
        false) or its freed blocks are wrong, or None."""
        call = len(self.recorded)
        if len(run.outputs) != len(run.prompts):
            return (f"generate call {call}: {len(run.outputs)} outputs for {len(run.prompts)} "
                    "prompts (one per prompt, in the order of the prompts)")
        for i, (prompt, p, out) in enumerate(zip(run.prompts, run.params, run.outputs)):
            if len(out.outputs) != p.n:
                return (f"generate call {call}: request {i} has {len(out.outputs)} "
                        f"completions, its params ask n={p.n}")
            for j, comp in enumerate(out.outputs if oracle else ()):
                child = p
                if p.n > 1:
                    child = SamplingParams(**{**p.__dict__, "n": 1})
                    if p.seed is not None:
                        child.seed = p.seed + j
                want = self.expected(prompt, child, llm.max_model_len, llm.kv_scales,
                                     llm.model)
                try:
                    _compare(i if p.n == 1 else f"{i}.{j}", prompt, comp, want)
                except ExamFailure as exc:
                    return f"generate call {call}: {exc}"
        held = run.stats.kv_blocks_in_use
        if held:
            return (f"{held} KV block(s) still held after every request finished: a request's "
                    "blocks were not all freed (look at free() and at what preemption and "
                    "finishing release)")
        if run.cpu_blocks_held:
            return (f"{run.cpu_blocks_held} CPU swap block(s) still held after every request "
                    "finished: a swapped request's CPU blocks were not all freed when it came "
                    "back or finished")
        return None


class Served:
    """An engine served over HTTP in the engine process, on the Unix socket ``uds``; the exam
    reads it with the official client, as any client would."""

    def __init__(self, exam: Exam, server: int, uds: str) -> None:
        self.exam, self.server, self.uds = exam, server, uds

    def client(self, timeout: float):
        from course.labs.serving import openai_client

        return openai_client(self.uds, timeout=timeout)

    def http_client(self, timeout: float):
        from course.labs.serving import http_client

        return http_client(self.uds, timeout=timeout)

    def generation_tokens(self) -> int:
        return int(self.exam.call("generation_tokens", server=self.server)["tokens"])

    def wait_idle(self, timeout: float) -> str | None:
        """None once the engine holds no request and no KV block, else what it still holds
        after ``timeout`` seconds."""
        held = self.exam.call("wait_idle", server=self.server, timeout=timeout)["held"]
        return None if held is None else str(held)

    def kill_core(self) -> None:
        """SIGKILL the server's engine-core process (it must run in one)."""
        self.exam.call("kill_core", server=self.server)

    def health(self) -> tuple[int, str]:
        """``/health``'s status code and body."""
        with self.http_client(timeout=10) as http:
            response = http.get("/health")
        return response.status_code, response.text

    def stop(self) -> None:
        try:
            self.exam.call("stop_server", server=self.server)
        except (EngineError, EngineDied):  # the case's own error says more
            pass


def _int(value) -> int:
    """An int of an engine's answer (JSON: a bool or a float is not one)."""
    if type(value) is not int:
        raise TypeError(f"{value!r} where an int belongs")
    return value


def _ints(values) -> list[int]:
    if not isinstance(values, list):
        raise TypeError(f"{values!r} where a list of ints belongs")
    return [_int(v) for v in values]


def _number(value) -> int | float:
    if type(value) not in (int, float):
        raise TypeError(f"{value!r} where a number belongs")
    return value


def _text(value) -> str:
    if type(value) is not str:
        raise TypeError(f"{value!r} where a string belongs")
    return value


def _compare(index, prompt: list[int], got, want: Completion) -> None:
    tokens = list(got.token_ids)
    for k, (a, b) in enumerate(zip(tokens, want.token_ids)):
        if a != b:
            raise ExamFailure(
                f"request {index} (prompt of {len(prompt)} tokens), token {k}: yours {a}, "
                f"reference {b}"
            )
    if len(tokens) != len(want.token_ids):
        raise ExamFailure(
            f"request {index} (prompt of {len(prompt)} tokens): {len(tokens)} tokens generated, "
            f"the reference generates {len(want.token_ids)} (finish reason: yours "
            f"{got.finish_reason}, reference {want.finish_reason})"
        )
    if got.finish_reason != want.finish_reason:
        raise ExamFailure(
            f"request {index}: finish reason {got.finish_reason!r}, reference "
            f"{want.finish_reason!r}"
        )


def _compare_with_reference(call: int, mine: list, reference: list) -> str | None:
    """How generate call ``call``'s completions differ from the reference engine's, or None."""
    for i, (got, want) in enumerate(zip(mine, reference)):
        for j, (g, w) in enumerate(zip(got, want)):
            if list(g) != list(w):
                at = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                return (f"generate call {call}: request {i}" + (f".{j}" if len(got) > 1 else "")
                        + f" differs from the reference engine's seeded tokens at token {at} "
                        f"(yours {list(g)[at:at + 3]}, reference {list(w)[at:at + 3]}): with "
                        "speculative decoding a seeded request draws exactly as the reference "
                        "(lab 04-04's rejection sampler: the uniforms first, then one draw at a "
                        "rejection)")
    return None


def expect(condition: bool, what: str) -> None:
    """A case's claim about its mechanism (so that it cannot pass without testing anything)."""
    if not condition:
        raise ExamFailure(f"the case did not exercise what it is for: {what}")


def _prompts(rng: random.Random, lengths: Sequence[int]) -> list[list[int]]:
    # Ids below EOS only, so that a prompt never holds the stop token by accident.
    return [[rng.randrange(EOS) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


# ----------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------


def case_prefix_odd_lengths(exam: Exam) -> None:
    """Prompts sharing prefixes of odd lengths (7, 13, 21 tokens) with block size 4: only whole
    blocks of a shared prefix are reused, and a request's own tail is computed."""
    rng = random.Random(1)
    base = _prompts(rng, [40])[0]
    tails = _prompts(rng, [5, 3, 9, 1])
    prompts = [base, base[:13] + tails[0], base[:21] + tails[1], base[:7] + tails[2],
               base[:21] + tails[3]]
    llm = exam.llm(block_size=4, num_gpu_blocks=128, max_num_batched_tokens=256)
    exam.generate(llm, prompts[:1], GREEDY)  # the shared prefix is cached once finished
    run = exam.generate(llm, prompts[1:], GREEDY)
    expect(run.stats.prefix_cache_hits >= 4 * (3 + 5 + 1 + 5), "prefix-cache hits on the "
           "whole shared blocks")
    expect(run.stats.num_prompt_tokens_computed < run.stats.num_prompt_tokens,
           "prefill skipped for the cached blocks")


def case_prompt_plus_output(exam: Exam) -> None:
    """A prompt equal to an earlier prompt plus its output hits the blocks of that output too:
    they were cached as the earlier request decoded."""
    rng = random.Random(2)
    prompt = _prompts(rng, [10])[0]
    llm = exam.llm(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64)
    first = exam.generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=20))
    longer = prompt + list(first.outputs[0].outputs[0].token_ids)
    run = exam.generate(llm, [longer], GREEDY)
    cached = run.outputs[0].metrics["num_cached_tokens"]
    expect(cached > len(prompt), f"a hit past the original prompt ({cached} tokens cached, "
           f"prompt {len(prompt)})")


def case_chunked_shared_prefix(exam: Exam) -> None:
    """Chunked prefill whose chunks end inside a block (17 tokens, block size 16), and requests
    sharing that prompt's prefix admitted in the same step: they may reuse only blocks whose KV
    has really been computed, never a block the prefill has only started to fill."""
    rng = random.Random(3)
    long = _prompts(rng, [70])[0]
    prompts = [long, long[:50] + [5, 6], long[:40], _prompts(rng, [21])[0]]
    llm = exam.llm(block_size=16, num_gpu_blocks=48, max_num_batched_tokens=40,
                   long_prefill_token_threshold=17)
    run = exam.generate(llm, prompts, GREEDY)
    expect(run.stats.num_steps > GREEDY.max_tokens, "prefills split over steps")
    expect(run.stats.prefix_cache_hits > 0, "the later requests reuse computed blocks")


def case_chunked_budget_one(exam: Exam) -> None:
    """A token budget of 3: every prefill takes many steps, decodes share the budget."""
    rng = random.Random(4)
    prompts = _prompts(rng, [9, 4, 14])
    llm = exam.llm(block_size=2, num_gpu_blocks=64, max_num_batched_tokens=3)
    run = exam.generate(llm, prompts, GREEDY)
    expect(run.stats.num_steps >= (9 + 4 + 14) // 3, "prefills split over steps")


def case_preempt_recompute(exam: Exam) -> None:
    """A cache too small for everyone: the newest requests are preempted, freed, admitted again
    and recomputed (helped by their own cached blocks), and still produce the oracle's tokens."""
    rng = random.Random(5)
    prompts = _prompts(rng, [13, 9, 17, 6, 11])
    llm = exam.llm(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=32)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16))
    expect(run.stats.num_preemptions > 0, "preemptions")
    # The blocks a re-admitted request filled must be cached like any others.
    exam.generate(llm, prompts[::-1], GREEDY)


def case_preempt_recompute_no_cache(exam: Exam) -> None:
    """The same pressure with prefix caching off: a re-admitted request recomputes everything."""
    rng = random.Random(6)
    prompts = _prompts(rng, [10, 12, 7, 15])
    llm = exam.llm(block_size=2, num_gpu_blocks=20, max_num_batched_tokens=16,
                   enable_prefix_caching=False)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=14))
    expect(run.stats.num_preemptions > 0, "preemptions")
    expect(run.stats.prefix_cache_hits == 0, "no prefix hits with caching off")


def case_preempt_swap(exam: Exam) -> None:
    """Preemption by swapping: KV parked in CPU blocks and copied back, progress kept."""
    rng = random.Random(7)
    prompts = _prompts(rng, [13, 9, 17, 6, 11])
    llm = exam.llm(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=32,
                   preemption_mode="swap", num_cpu_blocks=64)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16))
    expect(run.stats.num_blocks_swapped_out > 0 and run.stats.num_blocks_swapped_in > 0,
           "blocks swapped out and back in")
    exam.generate(llm, prompts[::-1], GREEDY)


def case_swap_queue(exam: Exam) -> None:
    """Swapping under pressure with a token budget of 8: victims join the back of ``swapped``
    while others are parked there, and come back first come first served, mid-prefill, each
    taking its tokens from what the step's budget has left."""
    rng = random.Random(14)
    prompts = _prompts(rng, [18, 12, 20, 9, 10, 25])
    llm = exam.llm(block_size=2, num_gpu_blocks=18, max_num_batched_tokens=8,
                   preemption_mode="swap", num_cpu_blocks=128)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                     ignore_eos=True))
    joined = resumed_chunk = False
    for before, step in zip(run.steps, run.steps[1:]):
        victims = {rid for rid, _ in step["preempted"]} & set(step["swapped"])
        joined |= bool(victims) and bool(set(before["swapped"]) & set(step["swapped"]))
        resumed_chunk |= any(n > 1 for rid, n in step["scheduled"] if rid in before["swapped"])
    expect(joined, "a request swapped out while another one was parked")
    expect(resumed_chunk, "a request swapped back in mid-prefill, with several tokens")


LOOKAHEAD = 3  # slots reserved past the scheduled tokens in the lookahead case


def case_swap_with_lookahead(exam: Exam) -> None:
    """Slots reserved ahead of the scheduled tokens (``num_lookahead_tokens``, as speculative
    decoding reserves them for draft tokens): a block table holds blocks with no KV yet, and a
    swap moves only the blocks that hold computed tokens (all of the table is freed)."""
    rng = random.Random(15)
    prompts = _prompts(rng, [13, 9, 17, 6, 11])
    # Every allocation reserves at least LOOKAHEAD slots, more if the scheduler reserves more
    # (an Orca-style reservation): the engine process wraps the KV cache manager's allocate_slots.
    llm = exam.llm(block_size=2, num_gpu_blocks=24, max_num_batched_tokens=16,
                   preemption_mode="swap", num_cpu_blocks=128, lookahead=LOOKAHEAD)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))
    freed = trace_counters(run.steps)["num_blocks_freed_by_preemption"]
    expect(0 < run.stats.num_blocks_swapped_out < freed,
           f"swaps of tables longer than their KV ({run.stats.num_blocks_swapped_out} blocks "
           f"swapped out, {freed} freed)")


def case_parallel_sampling(exam: Exam) -> None:
    """``n > 1`` with a seed: three seeded samples per prompt (seeds s, s+1, s+2), each equal to
    the oracle's draw from its own generator; the children share the prompt's cached blocks."""
    rng = random.Random(8)
    prompts = _prompts(rng, [11, 18])
    params = [
        SamplingParams(n=3, temperature=0.9, top_k=20, top_p=0.95, seed=11, max_tokens=10),
        SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=10),
    ]
    llm = exam.llm(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64)
    run = exam.generate(llm, prompts, params)
    texts = {tuple(c.token_ids) for c in run.outputs[0].outputs}
    expect(len(texts) > 1, "different samples for different seeds")
    expect(run.stats.prefix_cache_hits > 0, "the children reuse the prompt's blocks")


# The beam case's prompts: with these, beams that end in EOS make the final ranking, so that each
# of lab 03-04's planted beam bugs (planted_bugs/03-04.py) changes the result.
BEAM_SEED = 27


def case_beam_search(exam: Exam) -> None:
    """``LLM.beam_search`` through the engine (lab 03-04's beam step, every beam a one-token
    request with ``2 * width`` log-probabilities): the same beams, in the same order, with the
    same cumulative log-probabilities as a brute-force search that recomputes every beam with
    no cache; beams that end with EOS compete for the final ranking, and the beams' common full
    blocks come from the prefix cache."""
    rng = random.Random(BEAM_SEED)
    prompts = _prompts(rng, [rng.randint(1, 12) for _ in range(6)])
    llm = exam.llm(block_size=4, num_gpu_blocks=256, max_num_batched_tokens=256)
    width, max_tokens = 4, 5
    got = exam.call("beam_search", engine=llm.id, prompts=prompts, beam_width=width,
                    max_tokens=max_tokens)
    try:
        outputs = [[(_ints(tokens), float(_number(cum))) for tokens, cum in out]
                   for out in got["sequences"]]
        held, hits = _int(got["blocks_in_use"]), _int(got["prefix_cache_hits"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExamFailure(f"beam search: the engine's answer could not be read "
                          f"({type(exc).__name__}: {exc})") from None
    if len(outputs) != len(prompts):
        raise ExamFailure(f"beam search: {len(outputs)} outputs for {len(prompts)} prompts")
    model = exam.model_for("tiny")
    wanted = brute_force_beam_search(lambda seqs: last_logprobs(model, seqs), prompts,
                                     width, max_tokens, EOS)
    for i, (out, want, prompt) in enumerate(zip(outputs, wanted, prompts)):
        beams = [tokens[len(prompt):] for tokens, _ in out]
        if beams != [tokens[len(prompt):] for tokens, _ in want]:
            raise ExamFailure(
                f"beam search, width {width}, prompt {i} ({len(prompt)} tokens): your beams "
                f"{beams}, the brute force's {[t[len(prompt):] for t, _ in want]} (look at "
                "lab 03-04's expand_beams, finish_beams and the beam score)")
        for (tokens, mine), (_, cum) in zip(out, want):
            if not math.isclose(mine, cum, rel_tol=1e-4, abs_tol=1e-3):
                raise ExamFailure(
                    f"beam search, prompt {i}: cumulative logprob {mine:.5f} for "
                    f"{tokens[len(prompt):]}, the brute force's {cum:.5f}")
    if held:
        raise ExamFailure(f"{held} KV block(s) still held after beam search finished")
    expect(any(tokens[-1] == EOS for out in outputs for tokens, _ in out),
           "a beam completed with EOS among the results")
    expect(hits > 0, "beams reuse their common blocks")


def case_stop_tokens_and_min_tokens(exam: Exam) -> None:
    """Stop tokens, EOS and ``min_tokens``: stops are banned before ``min_tokens``; a stop arriving
    as the last allowed token is a length cap (the length check comes first)."""
    rng = random.Random(9)
    prompts = _prompts(rng, [8, 12, 5, 9])
    free_run = [exam.expected(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                              TINY.max_position_embeddings) for p in prompts]
    # Stop tokens taken from the greedy continuations, so that they really occur.
    stop_a = free_run[0].token_ids[3]
    stop_b = free_run[1].token_ids[5]
    # For the third request: a token that first occurs at position k, with max_tokens = k + 1.
    cont = free_run[2].token_ids
    k = next(i for i in range(2, len(cont)) if cont[i] not in cont[:i] and EOS not in cont[:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_a]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_b], min_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=k + 1, stop_token_ids=[cont[k]]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, min_tokens=4,
                       stop_token_ids=[stop_a, stop_b]),
    ]
    llm = exam.llm(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64)
    run = exam.generate(llm, prompts, params)
    reasons = [o.outputs[0].finish_reason for o in run.outputs]
    expect("stop" in reasons, "a request stopped on a stop token")
    expect(reasons[2] == "length", "a stop token as the last allowed token is a length cap")


def case_several_generate_calls(exam: Exam) -> None:
    """One engine, three ``generate`` calls with overlapping prompts: what one call cached the
    next one reuses, and nothing leaks between calls."""
    rng = random.Random(10)
    shared = _prompts(rng, [16])[0]
    calls = [
        [shared + [1, 2], _prompts(rng, [7])[0]],
        [shared + [3], shared[:8] + [4, 5, 6]],
        [shared + [1, 2], _prompts(rng, [21])[0], shared[:9]],
    ]
    llm = exam.llm(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=24)
    hits = 0
    for prompts in calls:
        run = exam.generate(llm, prompts, GREEDY)
        hits += run.stats.prefix_cache_hits
    expect(hits > 0, "later calls hit what earlier calls cached")


def case_long_context(exam: Exam) -> None:
    """Decode over a context longer than one 512-token partition: PagedAttention v2 (the split
    context and the merge of the partitions' partial results) serves these steps."""
    from mini_vllm.attention.paged_attn import PARTITION_SIZE

    rng = random.Random(11)
    prompts = _prompts(rng, [PARTITION_SIZE + 90, PARTITION_SIZE // 2])
    llm = exam.llm(block_size=16, num_gpu_blocks=96, max_num_batched_tokens=1024)
    run = exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8))
    expect(run.stats.num_steps >= 8, "decode steps over the long context")


# Per-layer (k_scale, v_scale) of the fp8 case: about what calibration picks for the exam's fp8
# model on the case's prompts (amax of its keys over 200, of its values over 100, as upstream).
FP8_KV_SCALES = ((0.07, 0.12), (0.07, 0.13))


def case_fp8_kv_cache(exam: Exam) -> None:
    """An fp8 (e4m3) KV cache with given scales (lab 02-04, task 7): keys and values are quantized
    as they are written and dequantized as decode and chunked prefill read them, so every token
    equals the no-cache oracle run on keys and values rounded through e4m3. The 40-token prompt
    is prefilled in chunks (a budget of 24 tokens), so chunks read earlier chunks' fp8 blocks."""
    rng = random.Random(13)
    prompts = _prompts(rng, [23, 9, 40, 17])
    llm = exam.llm(block_size=8, num_gpu_blocks=64, max_num_batched_tokens=24,
                   kv_cache_dtype="fp8", kv_scales=list(FP8_KV_SCALES))
    expect(llm.kv_cache_dtype == str(torch.float8_e4m3fn),
           f"an fp8 cache (got {llm.kv_cache_dtype})")
    exam.generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12))


def case_triton_attention(exam: Exam) -> None:
    """Lab 02-07's unified Triton kernel as the engine's whole attention
    (``attention_backend="triton"``; Triton's interpreter on a CPU): prefill chunks of a
    24-token budget beside decodes in the same launch, blocks of 8 under 16-position tiles,
    contexts of several tiles, and a prompt whose first blocks are a prefix hit. Every token is
    the no-cache oracle's."""
    rng = random.Random(17)
    shared = _prompts(rng, [24])[0]
    prompts = [shared + _prompts(rng, [13])[0], *_prompts(rng, [5, 30])]
    llm = exam.llm(block_size=8, num_gpu_blocks=64, max_num_batched_tokens=24,
                   attention_backend="triton")
    expect(llm.attention == "triton", f"the Triton kernel as the attention (got {llm.attention})")
    run = exam.generate(llm, prompts, GREEDY)
    expect(run.stats.num_steps > GREEDY.max_tokens, "prefills split over steps")
    run = exam.generate(llm, [shared + [3, 4, 5]], GREEDY)
    expect(run.stats.prefix_cache_hits > 0, "a prefix hit on the shared blocks")


def case_disaggregated_prefill(exam: Exam) -> None:
    """Lab 04-06's connector in a prefill engine and a decode engine sharing a store in shared
    memory: the prefill engine (chunked prefill under a 24-token budget) saves each prompt block
    in the step that fills it, and the decode engine loads the leading run of each prompt's
    block-hash chain into blocks of its own pool, which already hold another prompt's blocks
    (one prompt loads its third block past a two-block prefix hit). Every completion of the
    decode engine is the no-cache oracle's, and it computes only each prompt's last block: every
    full block before it is loaded or a prefix hit. Then prompts the store does not hold reuse
    the blocks those loads filled, and must not see them loaded again."""
    rng = random.Random(47)
    shared = _prompts(rng, [16])[0]
    prompts = [shared + _prompts(rng, [13])[0], *_prompts(rng, [21, 3, 8, 30]),
               shared + _prompts(rng, [13])[0]]  # its hit: 2 blocks here, its 3rd loaded
    store = {"kv_transport": "shm", "kv_store": f"exam_kv_{os.getpid()}_{rng.randrange(1 << 30)}"}
    try:
        producer = exam.llm(block_size=8, num_gpu_blocks=64, max_num_batched_tokens=24,
                            kv_transfer_config={"kv_role": "kv_producer", **store})
        consumer = exam.llm(block_size=8, num_gpu_blocks=36,
                            kv_transfer_config={"kv_role": "kv_consumer", **store})
        exam.generate(consumer, _prompts(rng, [20]), GREEDY)  # its pool is not the producer's
        exam.generate(producer, prompts, SamplingParams(temperature=0.0, max_tokens=1))
        run = exam.generate(consumer, prompts, GREEDY)
        # Then prompts the store does not hold, in blocks the loads above used: no load again.
        exam.generate(consumer, _prompts(rng, [20, 22, 19, 30, 25]), GREEDY)
    finally:  # the engines' stores go now: the engine process may be killed after the case
        try:
            exam.call("forget")
        except Exception:  # noqa: BLE001, S110 - a dead engine process: the sweep below
            pass
        remove_shm_segments(store["kv_store"])
    expected = [(len(p) - 1) // 8 * 8 for p in prompts]
    got = [out.metrics.get("num_cached_tokens") for out in run.outputs]
    expect(got == expected, f"the decode engine loading every full prompt block but the last "
           f"(tokens not computed per prompt {expected}; got {got})")


def _refusal(exam: Exam, **config) -> str:
    """How the engine process refused to build an engine of ``config`` ("" if it built one)."""
    try:
        exam.llm(**config)
    except EngineError as exc:
        if exc.not_implemented:
            raise
        return f"{exc.kind}: {exc}"
    return ""


def case_tensor_parallel(exam: Exam) -> None:
    """Lab 04-05's split at tp 2 (each rank two query heads, one KV head) and tp 4 (each KV
    head kept by two ranks) on TINY_TP (a vocabulary of 65 ids, padded on each split; tied
    embeddings; a bias on every projection), the ranks in processes of their own: greedy
    completions beside chunked prefill and a seeded sample, each the no-cache oracle's, with a
    prompt that holds the last ids of the vocabulary. tp 3 is refused before anything starts,
    naming the sizes that split the model."""
    rng = random.Random(45)
    last = TINY_TP.vocab_size - 1  # the id past EOS: the one a floor division leaves to no rank
    prompts = [*_prompts(rng, [5, 19, 11]), [last, EOS - 1, last, 7, EOS - 2, last, 3]]
    params = [GREEDY] * 3 + [SamplingParams(temperature=1.0, seed=4, max_tokens=12)]
    refused = _refusal(exam, model="tp", tensor_parallel_size=3, block_size=4)
    expect(refused.startswith("ValueError") and "tensor_parallel_size=3" in refused
           and "[1, 2, 4]" in refused,
           f"tp 3 refused with a ValueError naming tensor_parallel_size=3 and the sizes "
           f"[1, 2, 4] (got {refused or 'an engine'!r})")
    for tp in (2, 4):
        llm = exam.llm(model="tp", tensor_parallel_size=tp, block_size=4, num_gpu_blocks=48,
                       max_num_batched_tokens=16)
        exam.generate(llm, prompts, params)
        exam.call("forget")  # its worker processes stop before the next size starts its own


def case_cache_aware_routing(exam: Exam) -> None:
    """Lab 04-07's router over two engines of blocks of 8: chat sessions on three system prompts
    built from a few repeated blocks (equal blocks under different prefixes are no match), each
    turn's prompt extending the last, with requests ending between routes so that the load
    threshold of 1 acts, and a picture of each cache bounded at 8 blocks. Every request goes to
    the engine the policy names, and each engine's requests, run on it in that order, give the
    oracle's tokens and hit its prefix cache."""
    rng = random.Random(7)
    pieces = _prompts(rng, [8, 8, 8, 8])  # few blocks, repeated under different prefixes
    systems = [rng.choice(pieces) + rng.choice(pieces) for _ in range(3)]
    sessions = [[rng.choice(systems) + rng.choice(pieces)] for _ in range(12)]
    events, prompts = [], []
    for turn in range(4):
        for session in sessions:
            if turn:
                session.append(session[-1] + rng.choice(pieces) + _prompts(rng, [3])[0])
            prompts.append(session[-1])
            events.append(["route", session[-1]])
            if len(prompts) > 2 and rng.random() < 0.6:
                events.append(["finish", len(prompts) - 3])
    knobs = {"engines": 2, "block_size": 8, "num_blocks": 8, "threshold": 1}
    chosen = exam.call("route", events=events, **knobs)["chosen"]
    policy = ReferenceRouter(2, block_size=8, num_blocks=8, balance_abs_threshold=1)
    want = []
    for kind, value in events:
        if kind == "route":
            want.append(policy.route(value))
        else:
            policy.finished(want[value])
    for i, (got, expected) in enumerate(zip(chosen, want, strict=False)):
        if got != expected:
            raise ExamFailure(f"request {i} (a {len(prompts[i])}-token prompt) was routed to "
                              f"engine {got}; the policy sends it to engine {expected} (the "
                              f"first {i} requests went where it says)")
    expect(len(chosen) == len(want), f"a choice for every request ({len(chosen)} of {len(want)})")
    expect(len(set(want)) == 2, "requests on both engines")
    for engine in (0, 1):
        llm = exam.llm(block_size=8, num_gpu_blocks=96)
        mine = [p for p, e in zip(prompts, want, strict=True) if e == engine]
        run = exam.generate(llm, mine, SamplingParams(temperature=0.0, max_tokens=4))
        expect(run.stats.prefix_cache_hits > 0, f"prefix hits on engine {engine}")


# Prompt lookup with every proposal checked (the adaptive policy's choices depend on timing, and
# the exam compares every step with the reference engine's).
NGRAM_ALWAYS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3, "draft_policy": "always"}
# A one-layer draft of the model whose drafts are sampled: its distribution q reaches the
# rejection sampler, so a rejected draft's token comes from max(0, p - q).
SAMPLED_DRAFT = {"method": "draft_model", "num_draft_layers": 1,
                 "draft_sample_method": "probabilistic", "num_speculative_tokens": 3,
                 "draft_policy": "always"}


def case_speculative_decoding(exam: Exam) -> None:
    """Speculative decoding (labs 03-01, 03-04, 04-04): prompt lookup's drafts are scheduled
    from a token budget that cuts some of them, checked in one forward pass and rolled back when
    rejected, with chunked prefill, prefix caching and preemption. Every greedy token is the
    no-cache oracle's, drafts were both accepted and rejected, the counts of drafted and
    accepted tokens are the reference engine's (they depend on which continuation the proposer
    picks), and every block is free at the end. Each prompt is a text from a few distinct
    tokens, its own greedy continuation, the text again, other tokens and the text a third
    time: its ending recurs twice, followed by different tokens. Then the same prompts sampled
    with seeds: every token and every step must be the reference engine's. Then four short
    texts decoding side by side in a budget of 8 tokens, which cuts a request's drafts short
    part-way twice (the texts of seed 6: the scheduler must name only the drafts it
    schedules); and sampled with
    a draft model's sampled drafts, whose distribution the rejection sampler weighs (blocks of
    64 hold each request whole, so the draft's lookahead slots claim no block of their own)."""
    rng = random.Random(17)
    texts = [[rng.randrange(8) for _ in range(n)] for n in (6, 9, 12, 7)]
    llm = exam.llm(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=10,
                   speculative_config=NGRAM_ALWAYS)
    prompts = [t + exam.expected(t, GREEDY, llm.max_model_len).token_ids[:6] + t
               + [rng.randrange(8, 64) for _ in range(4)] + t for t in texts]
    run = exam.generate(llm, prompts, GREEDY)
    drafted = run.stats.spec_decoding_num_draft_tokens
    accepted = run.stats.spec_decoding_num_accepted_tokens
    expect(drafted > 0, "draft tokens checked (the scheduler takes the proposer's drafts, the "
           "runner stages them and proposes the next)")
    expect(0 < accepted < drafted, f"drafts both accepted and rejected ({accepted} of {drafted} "
           "accepted)")
    expect(run.stats.num_preemptions > 0, "preemptions in a cache of 23 blocks")
    seeded = [SamplingParams(temperature=1.0, max_tokens=16, seed=i)
              for i in range(2 * len(prompts))]
    run = exam.generate(llm, prompts * 2, seeded, oracle=False)
    expect(run.stats.spec_decoding_num_accepted_tokens > 0, "sampled drafts accepted")
    cut_rng = random.Random(6)
    short = [[cut_rng.randrange(8) for _ in range(n)] for n in (6, 9, 12, 7)]
    llm = exam.llm(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=8,
                   speculative_config=NGRAM_ALWAYS)
    run = exam.generate(llm, short, GREEDY)
    expect(run.stats.spec_decoding_num_draft_tokens > 0, "drafts checked within a budget of 8")
    llm = exam.llm(block_size=64, num_gpu_blocks=16, speculative_config=SAMPLED_DRAFT)
    run = exam.generate(llm, prompts * 2, seeded, oracle=False)
    accepted = run.stats.spec_decoding_num_accepted_tokens
    expect(0 < accepted < run.stats.spec_decoding_num_draft_tokens,
           "a sampled draft's tokens both accepted and rejected")


SERVED_TOKENS = 10  # tokens per streamed completion in the served case
HANG_UP_TOKENS = 900  # the completion a client abandons: far more than an abort lets through


def _long_stream(client, prompt: list[int], max_tokens: int = HANG_UP_TOKENS):
    """A streamed completion of ``max_tokens`` tokens, EOS ignored: longer than any case
    reads."""
    return client.completions.create(model="exam", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0.0, stream=True,
                                     extra_body={"ignore_eos": True})


def _hang_up(client, prompt: list[int], max_tokens: int = HANG_UP_TOKENS) -> None:
    """A client that reads three chunks of a long completion and hangs up."""
    with _long_stream(client, prompt, max_tokens) as stream:
        for k, _ in enumerate(stream):
            if k == 2:
                break


def case_served_over_http(exam: Exam) -> None:
    """The exam's prompts served over HTTP (lab 03-05): the composed engine runs in AsyncLLM's
    loop behind the OpenAI-compatible server, on a Unix socket, and the official ``openai``
    client streams each completion; the token ids it reads equal the oracle's, text pieces
    included. Read again as raw bytes, each stream is well-framed server-sent events ending in
    `[DONE]`, with the oracle's finish reason and token counts. A client then hangs up
    mid-stream: the engine must end holding no request and no KV block. Last, with a tokenizer
    whose characters span two tokens, the streamed pieces add up to the decoded text."""
    rng = random.Random(35)
    prompts = _prompts(rng, [13, 4, 21])
    llm = exam.llm(block_size=16, num_gpu_blocks=80)  # room for the abandoned one
    params = SamplingParams(temperature=0.0, max_tokens=SERVED_TOKENS)
    server = exam.serve(llm)
    try:
        client = server.client(timeout=30)
        for i, prompt in enumerate(prompts):
            ids, text = [], ""
            for chunk in client.completions.create(
                    model="exam", prompt=prompt, max_tokens=SERVED_TOKENS, temperature=0.0,
                    stream=True, extra_body={"return_token_ids": True}):
                for choice in chunk.choices:
                    ids += getattr(choice, "token_ids", None) or []
                    text += choice.text
            want = exam.expected(prompt, params, llm.max_model_len)
            if ids != want.token_ids:
                raise ExamFailure(f"streamed completion {i} (prompt {_show(prompt)}): the "
                                  f"client read token ids {ids}, the oracle makes "
                                  f"{want.token_ids}")
            if text.strip() != IdTokenizer().decode(ids):
                raise ExamFailure(f"streamed completion {i}: the client read the text "
                                  f"{text!r}, but its token ids {ids} decode to "
                                  f"{IdTokenizer().decode(ids)!r}: the pieces a stream sends "
                                  "must add up to the decoded output")
            _check_raw_stream(server, i, prompt, want)
        # A client that hangs up at its third chunk of a long completion: the server must abort
        # the request (its tokens stop well short of max_tokens) and free everything it held.
        before = server.generation_tokens()
        _hang_up(client, prompts[0])
        held = server.wait_idle(20.0)
        if held is not None:
            raise ExamFailure(f"{held}: a client that hangs up mid-stream must leave nothing "
                              "held")
        made = server.generation_tokens() - before
        if made >= HANG_UP_TOKENS:
            raise ExamFailure(f"a client hung up at the third chunk of a {HANG_UP_TOKENS}-token "
                              f"completion, yet the engine made all {made} tokens: the request "
                              "must be aborted when its consumer goes away")
    finally:
        server.stop()
    _check_split_characters(exam, prompts)


DEAD_CORE_S = 10.0  # how soon a stream must end after its engine core is killed (it takes ~0.1 s)
# The core-process case's step limit, and how long its server then sits idle: a core whose
# heartbeat reports a step's age between steps would be taken for hung.
CORE_STEP_TIMEOUT_S = 3.0
CORE_IDLE_S = 4.0


def case_engine_core_process(exam: Exam) -> None:
    """The exam's prompts served with the engine core in a process of its own (lab 04-01): the
    core's busy loop and the messages' codec run in that process, the verdict on a dead core in
    the server's; the official client's token ids equal the oracle's. A client that hangs up
    mid-stream leaves the core holding nothing (as its load reports it). The server then sits
    idle past its step limit and serves again (an idle core is not a hung one). Last, the core
    is killed (SIGKILL) mid-stream: the stream must end with the engine's error within seconds,
    not hang, and ``/health`` must answer 503 saying the core died."""
    rng = random.Random(41)
    prompts = _prompts(rng, [11, 6, 19])
    llm = exam.llm(block_size=16, num_gpu_blocks=80)
    params = SamplingParams(temperature=0.0, max_tokens=SERVED_TOKENS)
    server = exam.serve(llm, multiprocessing=True, step_timeout_s=CORE_STEP_TIMEOUT_S)

    def check_stream(i: int, prompt: list[int], when: str) -> None:
        ids = []
        for chunk in client.completions.create(
                model="exam", prompt=prompt, max_tokens=SERVED_TOKENS, temperature=0.0,
                stream=True, extra_body={"return_token_ids": True}):
            for choice in chunk.choices:
                ids += getattr(choice, "token_ids", None) or []
        want = exam.expected(prompt, params, llm.max_model_len)
        if ids != want.token_ids:
            raise ExamFailure(f"completion {i} (prompt {_show(prompt)}) through the engine core's "
                              f"process{when}: the client read token ids {ids}, the oracle makes "
                              f"{want.token_ids}")

    try:
        client = server.client(timeout=30)
        for i, prompt in enumerate(prompts):
            check_stream(i, prompt, "")
        _hang_up(client, prompts[1])
        held = server.wait_idle(20.0)
        if held is not None:
            raise ExamFailure(f"{held}, as the engine core reports its load: after the last "
                              "request goes away the core must say so (a load-only post), and a "
                              "client that hangs up must leave nothing held")
        time.sleep(CORE_IDLE_S)
        check_stream(len(prompts), prompts[2], f" after {CORE_IDLE_S:.0f} s idle (the step "
                     f"limit is {CORE_STEP_TIMEOUT_S:.0f} s: between steps the heartbeat must "
                     "report no running step)")
        error, read, killed = None, 0, None
        with _long_stream(client, prompts[0]) as stream:
            try:
                for read, _ in enumerate(stream, 1):
                    if read == 2:
                        server.kill_core()
                        killed = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - what the client saw is the verdict
                error = exc
        if killed is None:
            raise ExamFailure(f"a long completion ended after {read} chunk(s), before the engine "
                              f"core could be killed at its second: "
                              f"{type(error).__name__ if error else 'no error'}: "
                              f"{str(error)[:200]}")
        if error is None:
            raise ExamFailure(f"the engine core was killed mid-stream, yet the stream read {read} "
                              "chunks and ended without an error: a dead core must fail every "
                              "open stream (core_failure on its exit)")
        waited = time.monotonic() - killed
        if waited > DEAD_CORE_S or "engine core" not in str(error):
            raise ExamFailure(f"the engine core was killed mid-stream; {waited:.1f} s later the "
                              f"stream ended with {type(error).__name__}: {str(error)[:200]}: it "
                              f"must end within {DEAD_CORE_S:.0f} s with the engine's error "
                              "saying the core died (core_failure on its exit)")
        status, body = server.health()
        if status != 503 or "died" not in body:
            raise ExamFailure(f"after the engine core was killed, /health answered {status}: "
                              f"{body[:200]!r}; it must answer 503 saying the core died")
    finally:
        server.stop()


def case_persistent_batch(exam: Exam) -> None:
    """The persistent batch (lab 04-03): the runner keeps its batch in rows across steps. Seven
    prompts in a small cache and a budget that splits them: requests are preempted, lose their
    rows and take rows again, finished ones leave holes that the next arrivals and the condense
    fill; then the same prompts reversed (rows reused, prefix hits). Then prompt lookup's drafts,
    some accepted and some rejected, whose rejected positions the rows must not keep. Every
    token is the oracle's and every block is free at the end."""
    rng = random.Random(53)
    prompts = _prompts(rng, [13, 9, 17, 6, 11, 3, 21])
    llm = exam.llm(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=12,
                   persistent_batch=True)
    lengths = [SamplingParams(temperature=0.0, max_tokens=n) for n in (14, 3, 9, 1, 12, 7, 5)]
    run = exam.generate(llm, prompts, lengths)
    expect(run.stats.num_preemptions > 0, "preemptions in a cache of 15 blocks")
    exam.generate(llm, prompts[::-1], GREEDY)
    texts = [[rng.randrange(8) for _ in range(n)] for n in (6, 9, 12, 7)]
    llm = exam.llm(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=10,
                   speculative_config=NGRAM_ALWAYS, persistent_batch=True)
    drafty = [t + exam.expected(t, GREEDY, llm.max_model_len).token_ids[:6] + t
              + [rng.randrange(8, 64) for _ in range(4)] + t for t in texts]
    run = exam.generate(llm, drafty, GREEDY)
    accepted = run.stats.spec_decoding_num_accepted_tokens
    drafted = run.stats.spec_decoding_num_draft_tokens
    expect(0 < accepted < drafted, f"drafts both accepted and rejected ({accepted} of {drafted} "
           "accepted)")


# The async-scheduling case: six streams at once, each its own max_tokens (1 to 3 test the step
# not planned past a last token in flight), in a small cache (23 usable blocks of 4 tokens).
ASYNC_MAX_TOKENS = (1, 2, 3, 12, 7, 10)
ASYNC_HANG_UP_TOKENS = 60  # the abandoned completion: fits the small cache, longer than read


def case_async_scheduling(exam: Exam) -> None:
    """The exam's prompts served with asynchronous scheduling (lab 04-02): the engine core plans
    each step while the one before it runs. Six completions stream at once with 1 to 12 tokens
    each, one of them ending at a stop token it meets mid-stream, in a small KV cache and a
    budget that splits the prompts; each client's token ids equal the oracle's (preemption under
    async scheduling is lab 04-02's tests' to stage). A
    client then hangs up mid-stream: the engine must end holding no request and no KV block."""
    rng = random.Random(47)
    prompts = _prompts(rng, [9, 14, 5, 22, 3, 17])
    llm = exam.llm(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16,
                   async_scheduling=True)
    plain = SamplingParams(temperature=0.0, max_tokens=ASYNC_MAX_TOKENS[3])
    stop = exam.expected(prompts[3], plain, llm.max_model_len).token_ids[4]
    wants = [exam.expected(p, SamplingParams(temperature=0.0, max_tokens=n,
                                             stop_token_ids=[stop] if i == 3 else None),
                           llm.max_model_len)
             for i, (p, n) in enumerate(zip(prompts, ASYNC_MAX_TOKENS, strict=True))]
    server = exam.serve(llm)
    try:
        client = server.client(timeout=30)
        got: dict[int, list[int] | BaseException] = {}

        def stream(i: int) -> None:
            ids: list[int] = []
            extra = {"return_token_ids": True}
            if i == 3:
                extra["stop_token_ids"] = [stop]
            try:
                for chunk in client.completions.create(
                        model="exam", prompt=prompts[i], max_tokens=ASYNC_MAX_TOKENS[i],
                        temperature=0.0, stream=True, extra_body=extra):
                    for choice in chunk.choices:
                        ids += getattr(choice, "token_ids", None) or []
                got[i] = ids
            except Exception as exc:  # noqa: BLE001 - reported below, in the exam's thread
                got[i] = exc

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for i, want in enumerate(wants):
            ids = got.get(i)
            if isinstance(ids, BaseException) or ids is None:
                raise ExamFailure(f"completion {i} of six streamed at once with async scheduling "
                                  f"did not finish: {ids or 'no answer in 60 s'}")
            if ids != want.token_ids:
                stopped = f", stop token {stop}" if i == 3 else ""
                raise ExamFailure(f"completion {i} (prompt {_show(prompts[i])}, max_tokens "
                                  f"{ASYNC_MAX_TOKENS[i]}{stopped}) with async scheduling: the "
                                  f"client read token ids {ids}, the oracle makes "
                                  f"{want.token_ids}")
        _hang_up(client, prompts[1], ASYNC_HANG_UP_TOKENS)
        held = server.wait_idle(20.0)
        if held is not None:
            raise ExamFailure(f"{held}: with async scheduling, a client that hangs up while its "
                              "steps are in flight must leave nothing held")
    finally:
        server.stop()


SPLIT_TOKENS = 40  # tokens per completion in the split-character check


def _check_split_characters(exam: Exam, prompts: list[list[int]]) -> None:
    """The same prompts served with a tokenizer whose characters span two tokens
    (SplitCharTokenizer): the text pieces the client reads add up to the decoded output, so no
    piece ended inside a character (a server that sends U+FFFD, then the character, fails)."""
    tokenizer = SplitCharTokenizer()
    llm = exam.llm(block_size=16, num_gpu_blocks=80, tokenizer="split")
    params = SamplingParams(temperature=0.0, max_tokens=SPLIT_TOKENS, ignore_eos=True)
    wants = [exam.expected(p, params, llm.max_model_len) for p in prompts]
    if not any(tokenizer.splits_a_character(w.token_ids) for w in wants):  # not the student's
        raise RuntimeError("the exam's premise broke: no output cuts a character in two")
    server = exam.serve(llm)
    try:
        client = server.client(timeout=30)
        for i, (prompt, want) in enumerate(zip(prompts, wants)):
            pieces = [choice.text for chunk in client.completions.create(
                model="exam", prompt=prompt, max_tokens=SPLIT_TOKENS, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True}) for choice in chunk.choices]
            text = tokenizer.decode(want.token_ids)
            if "".join(pieces) != text:
                raise ExamFailure(
                    f"streamed completion {i} with characters that span two tokens: the "
                    f"pieces {pieces} add up to {''.join(pieces)!r}, but the output decodes to "
                    f"{text!r}: hold a piece that ends inside a character (U+FFFD) until the "
                    "next token completes it")
    finally:
        server.stop()


def _check_raw_stream(server, i: int, prompt: list[int], want: Completion) -> None:
    """The same completion read as bytes, as no tolerant client reads it: every event one
    `data:` line and a blank line, `[DONE]` last, the last choice's finish reason the oracle's,
    `"usage": null` on every chunk but the usage chunk, which has no choices and the counts."""
    body = {"model": "exam", "prompt": prompt, "max_tokens": SERVED_TOKENS, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    with server.http_client(timeout=30) as http:
        raw = http.post("/v1/completions", json=body).text
    events = raw.split("\n\n")
    if events[-1] != "" or any(not e.startswith("data: ") or "\n" in e for e in events[:-1]):
        raise ExamFailure(f"raw stream {i}: {raw[:300]!r} is not a sequence of server-sent "
                          "events (each 'data: <json>' and a blank line)")
    events = [e[len("data: "):] for e in events[:-1]]
    if not events or events[-1] != "[DONE]":
        raise ExamFailure(f"raw stream {i}: its last event is {events[-1:]!r}, not [DONE]: "
                          "OpenAI clients read until [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", [])]
    if not reasons or reasons[-1] != want.finish_reason or any(r is not None
                                                              for r in reasons[:-1]):
        raise ExamFailure(f"raw stream {i}: finish reasons {reasons}; the oracle's completion "
                          f"ends with {want.finish_reason!r}, set on its last chunk only")
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(want.token_ids),
             "total_tokens": len(prompt) + len(want.token_ids)}
    if chunks[-1].get("choices") != [] or chunks[-1].get("usage") != usage:
        raise ExamFailure(f"raw stream {i}: with include_usage the last chunk before [DONE] "
                          f"must have no choices and usage {usage}; it is {chunks[-1]}")
    if any("usage" not in c or c["usage"] is not None for c in chunks[:-1]):
        raise ExamFailure(f"raw stream {i}: with include_usage every chunk but the last says "
                          '"usage": null, as OpenAI\'s do')


# The reserved case's engine: max_model_len one past a block boundary (33 = 8 blocks of 4 + 1), so
# that a reservation one token short of the model's length is one block short.
RESERVED_MAX_LEN = 33
RESERVED_BLOCKS = 17  # usable blocks: two pow2 reservations of 8 or 9 blocks, not three


def _pow2_reservation_blocks(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request holds from admission under ``kv_reservation="pow2"``: the next power of
    two of its final length (``prompt_len + max_tokens`` capped at the model's length), capped
    at the model's length. Written here from the policy's statement, not taken from mini_vllm."""
    final = min(prompt_len + max_tokens, RESERVED_MAX_LEN)
    power = 1
    while power < final:
        power *= 2
    return -(-min(power, RESERVED_MAX_LEN) // block_size)


def case_reserved_admission(exam: Exam) -> None:
    """Orca-style reservation (lab 03-06's ``admission_lookahead``, claimed by the scheduler at
    admission): with ``kv_reservation="pow2"`` each request claims the next power of two of its
    final length when it is admitted, so a cache of 17 blocks runs two requests at a time, never
    preempts, and every block table is whole from the first step. One request runs into
    ``max_model_len``, whose reservation is capped there."""
    rng = random.Random(36)
    prompts = _prompts(rng, [9, 10, 26, 11])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    block_size = 4
    llm = exam.llm(block_size=block_size, num_gpu_blocks=RESERVED_BLOCKS + 1,
                   max_model_len=RESERVED_MAX_LEN, max_num_batched_tokens=64,
                   kv_reservation="pow2")
    run = exam.generate(llm, prompts, params)
    # FCFS and no preemption: the k-th request admitted is prompt k.
    admitted = [(rid, dict(step["tables"]).get(rid)) for step in run.steps
                for rid, _ in step["admitted"]]
    expect(len(admitted) == len(prompts), f"each request admitted once ({len(admitted)} "
           f"admissions of {len(prompts)} requests)")
    for i, ((_, held), prompt) in enumerate(zip(admitted, prompts)):
        want = _pow2_reservation_blocks(len(prompt), params.max_tokens, block_size)
        expect(held == want, f"request {i} holds its whole pow2 reservation from admission "
               f"({want} blocks; it holds {held})")
    peak = max(len(step["running"]) for step in run.steps)
    expect(peak == 2, f"the reservations let two of four requests run at once (peak {peak})")
    expect(run.stats.num_preemptions == 0, "no preemption: a reserving request never grows")


def _block_size_case(block_size: int) -> Callable[[Exam], None]:
    def case(exam: Exam) -> None:
        rng = random.Random(100 + block_size)
        base = _prompts(rng, [37])[0]
        prompts = [base, base[: 2 * block_size + 1] + [7], _prompts(rng, [3])[0], base[:30]]
        blocks = max(8, 2 * (37 + 12) // block_size + 4)
        llm = exam.llm(block_size=block_size, num_gpu_blocks=blocks,
                       max_num_batched_tokens=max(8, block_size + 3))
        exam.generate(llm, prompts, GREEDY)

    case.__doc__ = (f"Block size {block_size}: chunked prefill, a shared prefix and a tight "
                    "cache at this block size.")
    return case


def _sweep_case(seed: int) -> Callable[[Exam], None]:
    def case(exam: Exam) -> None:
        rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        n_prompts = rng.randint(2, 6)
        base = _prompts(rng, [rng.randint(10, 60)])[0]
        prompts = []
        for _ in range(n_prompts):
            if rng.random() < 0.5:
                tail = _prompts(rng, [rng.randint(0, 8)])[0]
                prompts.append(base[: rng.randint(1, len(base))] + tail)
            else:
                prompts.append(_prompts(rng, [rng.randint(1, 50)])[0])
        params = []
        for _ in prompts:
            max_tokens = rng.randint(1, 20)
            if rng.random() < 0.6:
                p = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            else:
                p = SamplingParams(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000),
                                   top_k=rng.choice([0, 10]), max_tokens=max_tokens,
                                   n=rng.choice([1, 1, 2]))
            if rng.random() < 0.3:
                p.stop_token_ids = [rng.randrange(EOS)]
                p.min_tokens = rng.randint(0, max_tokens)
            params.append(p)
        longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
        need = -(-longest // block_size)
        mode = rng.choice(["recompute", "swap"])
        config = dict(
            block_size=block_size,
            num_gpu_blocks=need + 1 + rng.randint(0, 2 * need),
            max_num_batched_tokens=rng.choice([3, 8, 16, 64, 256]),
            max_num_seqs=rng.choice([1, 2, 4, 64]),
            enable_prefix_caching=rng.random() < 0.8,
            long_prefill_token_threshold=rng.choice([0, 0, 4]),
            preemption_mode=mode,
            num_cpu_blocks=4 * need if mode == "swap" else 0,
        )
        llm = exam.llm(**config)
        exam.generate(llm, prompts, params)

    case.__doc__ = f"Randomized configuration (seed {seed})."
    return case


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Exam], None]
    # The engine process is replaced after the case: its engines leave threads behind
    # (torch.distributed's gloo), and a process forked from one that has them may hang.
    fresh_process: bool = False

    @property
    def what(self) -> str:
        return " ".join((self.run.__doc__ or "").split())


def cases(sweep: int = GRADED_SWEEP) -> list[Case]:
    """The exam's cases in order: the named mechanisms, block sizes 1 to 32, then ``sweep``
    randomized configurations (the first ``GRADED_SWEEP`` are the graded ones)."""
    named = [
        Case("prefix-odd-lengths", case_prefix_odd_lengths),
        Case("prompt-plus-output", case_prompt_plus_output),
        Case("chunked-shared-prefix", case_chunked_shared_prefix),
        Case("chunked-budget-3", case_chunked_budget_one),
        Case("preempt-recompute", case_preempt_recompute),
        Case("preempt-recompute-no-cache", case_preempt_recompute_no_cache),
        Case("preempt-swap", case_preempt_swap),
        Case("swap-queue", case_swap_queue),
        Case("swap-with-lookahead", case_swap_with_lookahead),
        Case("parallel-sampling", case_parallel_sampling),
        Case("beam-search", case_beam_search),
        Case("stop-tokens-min-tokens", case_stop_tokens_and_min_tokens),
        Case("several-generate-calls", case_several_generate_calls),
        Case("long-context-v2", case_long_context),
        Case("fp8-kv-cache", case_fp8_kv_cache),
        *([Case("triton-attention", case_triton_attention)] if _HAS_TRITON else []),
        Case("speculative-decoding", case_speculative_decoding),
        Case("reserved-admission", case_reserved_admission),
        Case("served-over-http", case_served_over_http),
        Case("engine-core-process", case_engine_core_process),
        Case("async-scheduling", case_async_scheduling),
        Case("persistent-batch", case_persistent_batch),
        Case("tensor-parallel", case_tensor_parallel, fresh_process=True),
        Case("disaggregated-prefill", case_disaggregated_prefill),
        Case("cache-aware-routing", case_cache_aware_routing),
    ]
    named += [Case(f"block-size-{b}", _block_size_case(b)) for b in (1, 2, 8, 16, 32)]
    rng = random.Random(SWEEP_SEED)
    seeds = [rng.randrange(1 << 30) for _ in range(sweep)]
    named += [Case(f"sweep-{i:03d}", _sweep_case(s)) for i, s in enumerate(seeds)]
    return named


# ----------------------------------------------------------------------------------------------
# Running cases with a time limit, reporting where student code failed
# ----------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    case: str
    outcome: str  # "passed", "failed", "error", "timeout"
    message: str = ""  # one line: what happened
    seconds: float = 0.0
    detail: list[str] = field(default_factory=list)  # the diagnosis, a line each

    def as_dict(self) -> dict:
        return {"case": self.case, "outcome": self.outcome, "message": self.message,
                "seconds": round(self.seconds, 3), "detail": self.detail}


def _where(exc: BaseException) -> str:
    """The innermost frame of the student's code (a lab's starter.py), else the innermost one."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if Path(frame.filename).name in ("starter.py", "starter.cu"):
            lab = Path(frame.filename).parent.name
            return f"{lab}/starter.py:{frame.lineno}, in {frame.name}"
    if frames:
        f = frames[-1]
        return f"{Path(f.filename).name}:{f.lineno}, in {f.name}"
    return "?"


def _on_alarm(signum, frame):
    raise CaseTimeout()


# Seconds past a case's time limit before the exam stops waiting for the engine process (which
# interrupts its own request at the limit, with the steps it made) and kills it.
GRACE_S = 10.0


def run_case(case: Case, exam: Exam, timeout_s: float) -> CaseResult:
    """Run one case; a time limit (SIGALRM, where the OS has it) turns a hang into a result.
    Only a case that returns is "passed": any error, here or reported by the engine process,
    is an "error"."""
    use_alarm = hasattr(signal, "SIGALRM") and timeout_s > 0
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s + GRACE_S)
    start = time.perf_counter()
    try:
        exam.start(case.name, timeout_s)
        case.run(exam)
        result = CaseResult(case.name, "passed")
    except ExamFailure as exc:
        result = CaseResult(case.name, "failed", str(exc), detail=exc.detail)
    except CaseTimeout:
        result = CaseResult(case.name, "timeout", f"did not finish within {timeout_s:g} s (a loop "
                            "that never ends, or an engine that never finishes its requests)",
                            detail=exam.diagnose_error())
    except EngineError as exc:
        if exc.not_implemented:
            result = CaseResult(case.name, "error", f"not implemented: {exc} ({exc.where})")
        else:
            result = CaseResult(case.name, "error", f"{exc.kind}: {exc} (at {exc.where})",
                                detail=exam.diagnose_error())
    except EngineDied as exc:
        result = CaseResult(case.name, "error", str(exc), detail=exam.diagnose_error())
    except NotImplementedError as exc:
        result = CaseResult(case.name, "error", f"not implemented: {exc} ({_where(exc)})")
    except Exception as exc:
        result = CaseResult(case.name, "error",
                            f"{type(exc).__name__}: {exc} (at {_where(exc)})",
                            detail=exam.diagnose_error())
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    result.seconds = time.perf_counter() - start
    return result
