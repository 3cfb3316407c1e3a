"""How a request wants its tokens sampled, and when it wants to stop.

A small subset of vLLM's ``SamplingParams``: the fields that a single-sequence engine with greedy,
temperature, top-k and top-p sampling needs. Values are checked once, at construction, so that the
scheduler and the sampler can trust them.

upstream: vllm/sampling_params.py:85 @ v0.11.0
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this temperature sampling is greedy (upstream uses the same threshold).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    Invariants after construction (checked in ``__post_init__``, a ``ValueError`` otherwise):
    ``n >= 1``; ``temperature >= 0`` (0 means greedy); ``0 < top_p <= 1``; ``top_k`` is 0 or -1
    (both mean "off") or at least 1; ``max_tokens >= 1``; ``0 <= min_tokens <= max_tokens``;
    ``stop_token_ids`` is a list of ints (``None`` becomes ``[]``).

    upstream: vllm/sampling_params.py:85 @ v0.11.0
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.seed == -1:
            # Upstream treats -1 as "no seed"; keep that convention.
            self.seed = None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy sampling ignores the filters; normalise them so that code downstream never
            # has to ask "greedy, but with top_k?".
            self.top_p = 1.0
            self.top_k = 0

    def _verify_args(self) -> None:
        """Raise ``ValueError`` naming the first bad field and the range it must lie in.

        upstream: vllm/sampling_params.py:373 @ v0.11.0
        """
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"SamplingParams: n must be an int >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(
                f"SamplingParams: temperature must be >= 0 (0 means greedy), "
                f"got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"SamplingParams: top_k must be an int, got {self.top_k!r}.")
        if self.top_k < -1:
            raise ValueError(
                f"SamplingParams: top_k must be 0 or -1 (off) or at least 1, got {self.top_k}."
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams: seed must be an int or None, got {self.seed!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens!r}."
            )
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams: min_tokens must be >= 0, got {self.min_tokens}.")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams: min_tokens ({self.min_tokens}) must not exceed "
                f"max_tokens ({self.max_tokens})."
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams: stop_token_ids must contain only ints, "
                f"got {self.stop_token_ids!r}."
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5)."""
        return self.temperature < _SAMPLING_EPS
