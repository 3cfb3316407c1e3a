"""How a request wants its tokens sampled, and when it wants to stop.

A small subset of vLLM's ``SamplingParams``: the fields that a single-sequence engine with greedy,
temperature, top-k and top-p sampling needs, plus log-probabilities; and ``BeamSearchParams``, the
settings of ``LLM.beam_search``. Values are checked once, at construction, so that the scheduler,
the sampler and the beam search can trust them.

upstream: vllm/sampling_params.py:85 @ v0.11.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature sampling is greedy (upstream uses the same threshold).
_SAMPLING_EPS = 1e-5


_SEED_RANGE = (-(2**63), 2**63)  # what torch.Generator.manual_seed takes, with room for n children


def _is_int(value: object) -> bool:
    """A real integer: ``bool`` is an int to Python but never a count, an id or a seed here."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(owner: str, name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool), worded for ``owner.name``."""
    if not _is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}.")


def _check_finite(owner: str, name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is a number, ``ValueError`` unless it is finite."""
    if not _is_real(value):
        raise TypeError(
            f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value}.")


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    Invariants after construction (checked in ``__post_init__``): ``n >= 1``; ``temperature``
    finite and ``>= 0`` (0 means greedy); ``0 < top_p <= 1``; ``top_k`` is 0 or -1 (both mean
    "off") or at least 1; ``seed`` is ``None`` or an int in ``[-2**63, 2**63 - n)``;
    ``max_tokens >= 1``; ``0 <= min_tokens <= max_tokens``; ``stop_token_ids`` a list of ints
    ``>= 0`` (``None`` becomes ``[]``); ``stop`` a list of non-empty strings (a single string
    becomes a list of one).
    A value of the wrong type raises ``TypeError`` (a string temperature, ``max_tokens=True``, a
    float token id); a value of the right type outside its range raises ``ValueError``.

    ``logprobs``: ``None`` (off), or how many of the most likely tokens to report at every
    sampled position (the sampled token is always reported too, so a position holds ``logprobs``
    or ``logprobs + 1`` entries); ``prompt_logprobs`` the same for every prompt position after the
    first. ``-1`` means the whole vocabulary. Log-probabilities are those of the model's raw
    logits (before temperature, top-k/top-p and banned tokens), as upstream's default
    ``raw_logprobs`` mode. Their upper bound, the vocabulary, is checked by ``LLM``.

    ``stop`` strings end generation when the detokenized output contains one of them; the output
    text stops *before* the string unless ``include_stop_str_in_output``. (Token ids the model
    would need to produce are not known in advance; the check runs on text, as upstream.)

    upstream: vllm/sampling_params.py:85 @ v0.11.0
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.seed == -1 and _is_int(self.seed):
            # Upstream treats -1 as "no seed"; keep that convention.
            self.seed = None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise TypeError(
                "SamplingParams: stop_token_ids must be a list of ints, got "
                f"{type(self.stop_token_ids).__name__}."
            )
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise TypeError(
                f"SamplingParams: stop must be a string or a list of strings, got "
                f"{type(self.stop).__name__}."
            )
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy sampling ignores the filters; normalise them so that code downstream never
            # has to ask "greedy, but with top_k?".
            self.top_p = 1.0
            self.top_k = 0

    def _verify_args(self) -> None:
        """Raise ``TypeError`` or ``ValueError`` naming the first bad field and what it must be.

        upstream: vllm/sampling_params.py:373 @ v0.11.0
        """
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            _check_int("SamplingParams", name, getattr(self, name))
        for name in ("temperature", "top_p"):
            _check_finite("SamplingParams", name, getattr(self, name))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SamplingParams: {name} must be True or False, got {getattr(self, name)!r}."
                )
        if self.n < 1:
            raise ValueError(f"SamplingParams: n must be an int >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(
                f"SamplingParams: temperature must be >= 0 (0 means greedy), "
                f"got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(
                f"SamplingParams: top_k must be 0 or -1 (off) or at least 1, got {self.top_k}."
            )
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(
                    f"SamplingParams: seed must be an int or None, got {self.seed!r}."
                )
            low, high = _SEED_RANGE
            if not low <= self.seed < high - self.n:
                raise ValueError(
                    f"SamplingParams: seed must lie in [-2**63, 2**63 - n), got {self.seed}."
                )
        if self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens!r}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value):
                raise TypeError(
                    f"SamplingParams: {name} must be an int or None, got {type(value).__name__} "
                    f"{value!r}."
                )
            if value < -1:
                raise ValueError(
                    f"SamplingParams: {name} must be None, -1 (the whole vocabulary) or >= 0, "
                    f"got {value}."
                )
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams: min_tokens must be >= 0, got {self.min_tokens}.")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams: min_tokens ({self.min_tokens}) must not exceed "
                f"max_tokens ({self.max_tokens})."
            )
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise TypeError(
                    f"SamplingParams: stop_token_ids must contain only ints, "
                    f"got {self.stop_token_ids!r}."
                )
            if t < 0:
                raise ValueError(f"SamplingParams: stop token id {t} is negative.")
        for text in self.stop:
            if not isinstance(text, str):
                raise TypeError(f"SamplingParams: stop strings must be str, got {text!r}.")
            if not text:
                raise ValueError("SamplingParams: a stop string is empty; it would stop at once.")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5)."""
        return self.temperature < _SAMPLING_EPS


@dataclass
class BeamSearchParams:
    """Settings of :meth:`mini_vllm.entrypoints.llm.LLM.beam_search`.

    Invariants after construction: ``beam_width >= 1`` (its upper bound, the vocabulary, is
    checked by ``LLM.beam_search``); ``max_tokens >= 1``; ``temperature`` finite and ``>= 0``
    (0, the default, makes every step's sampled token the argmax, which is among the candidates
    anyway; above 0 the sampled token joins the candidates when it is not one already, as
    upstream); ``length_penalty`` finite. A value of the wrong type raises ``TypeError``, a value
    out of range ``ValueError``, so nothing is queued.

    upstream: vllm/sampling_params.py:582 @ v0.11.0
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check_int("BeamSearchParams", name, value)
            if value < 1:
                raise ValueError(f"BeamSearchParams: {name} must be an int >= 1, got {value}.")
        for name in ("temperature", "length_penalty"):
            _check_finite("BeamSearchParams", name, getattr(self, name))
        if self.temperature < 0.0:
            raise ValueError(
                f"BeamSearchParams: temperature must be >= 0 (0 means greedy), "
                f"got {self.temperature}."
            )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(
                f"BeamSearchParams: ignore_eos must be True or False, got {self.ignore_eos!r}."
            )
