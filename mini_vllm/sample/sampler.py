"""Turn one row of logits per request into one next token per request.

Greedy rows take the argmax. Random rows divide by their temperature, keep only their top-k and
top-p tokens, and draw from the softmax. A request with a ``seed`` owns a ``torch.Generator``
that lives as long as the request, so its tokens do not depend on which other requests share the
batch, nor on how the scheduler split its prefill: the same seed gives the same text.

upstream: vllm/v1/sample/sampler.py:22 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mini_vllm.outputs import LogprobsTensors
from mini_vllm.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one batch; row ``i`` is the ``i``-th logits row.

    ``generators`` maps a row to its request's own generator (seeded requests only); the other
    random rows share the process-wide RNG. ``banned_token_ids[i]`` are masked to ``-inf`` before
    anything else (the stop tokens of a request that has not yet reached ``min_tokens``).
    ``all_greedy`` says, as a plain bool, that every row is greedy: the sampler then takes the
    argmax and nothing else, without looking at the tensors (False is always safe: greedy rows
    still get their argmax on the full path).

    upstream: vllm/v1/sample/metadata.py:13 @ v0.11.0
    """

    temperature: torch.Tensor
    top_k: torch.Tensor  # 0 means "off"
    top_p: torch.Tensor  # 1.0 means "off"
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    banned_token_ids: list[list[int]] = field(default_factory=list)
    all_greedy: bool = False

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator] | None = None,
        banned_token_ids: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        temperatures = [p.temperature for p in params]
        return cls(
            temperature=torch.tensor(temperatures, dtype=torch.float32),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            generators=dict(generators or {}),
            banned_token_ids=list(banned_token_ids or [[] for _ in params]),
            all_greedy=all(t < _SAMPLING_EPS for t in temperatures),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask (to ``-inf``) every token outside row ``i``'s top ``top_k[i]`` and top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token always survives, so every row keeps at least one candidate.

    upstream: vllm/v1/sample/ops/topk_topp_sampler.py:164 @ v0.11.0
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly before each token: a token is dropped once that mass already
    # reaches top_p (so the token that crosses the threshold is kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p.unsqueeze(1))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Sample one token per logits row according to :class:`SamplingMetadata`.

    upstream: vllm/v1/sample/sampler.py:22 @ v0.11.0
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """``logits[num_reqs, vocab]`` -> ``token_ids[num_reqs]`` (int64)."""
        if logits.dim() != 2 or logits.shape[0] != meta.temperature.shape[0]:
            raise ValueError(
                f"Sampler: expected logits [num_reqs={meta.temperature.shape[0]}, vocab], got "
                f"{tuple(logits.shape)}; pass exactly one row per request."
            )
        logits = self._ban(logits, meta)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature < _SAMPLING_EPS
        sampled = self.random_sample(self._processed_probs(logits, meta), meta.generators)
        return torch.where(is_greedy, greedy, sampled)

    def compute_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each row's token is drawn from: banned tokens removed, then
        temperature, top-k and top-p applied; one-hot at the argmax for a greedy row. What the
        rejection sampler checks draft tokens against.

        upstream: vllm/v1/sample/rejection_sampler.py:89 @ v0.11.0 (the target's logits
        processed as the sampler would, then softmax)
        """
        logits = self._ban(logits, meta)
        greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1])
        if meta.all_greedy:
            return greedy.to(logits.dtype)
        is_greedy = (meta.temperature < _SAMPLING_EPS).unsqueeze(1)
        return torch.where(is_greedy, greedy.to(logits.dtype), self._processed_probs(logits, meta))

    @staticmethod
    def _ban(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Float logits with every row's banned tokens at ``-inf`` (a copy only if some are)."""
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.to(torch.float32)
        if any(meta.banned_token_ids):
            logits = logits.clone()
            for row, banned in enumerate(meta.banned_token_ids):
                if banned:
                    logits[row, banned] = float("-inf")
        return logits

    @staticmethod
    def _processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Softmax after temperature, top-k and top-p. Greedy rows get temperature 1 here only
        to avoid dividing by zero; callers replace them by their argmax."""
        is_greedy = meta.temperature < _SAMPLING_EPS
        temp = torch.where(is_greedy, 1.0, meta.temperature).to(logits.dtype)
        return apply_top_k_top_p(logits / temp.unsqueeze(1), meta.top_k, meta.top_p).softmax(-1)

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of the raw logits, in float32 (float64 stays float64).

        Raw: before temperature, top-k/top-p and banned tokens, so a request's log-probabilities
        say what the model thinks, whatever its sampling settings (upstream's default
        ``raw_logprobs`` mode).

        upstream: vllm/v1/sample/sampler.py:198 @ v0.11.0
        """
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return logits.log_softmax(dim=-1, dtype=dtype)

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                        token_ids: torch.Tensor) -> LogprobsTensors:
        """Each row's own token (``token_ids[i]``) and its ``num_logprobs`` most likely tokens.

        Returns ids and values ``[n, num_logprobs + 1]`` (own token first, then the top-k, most
        likely first) and the own token's rank ``[n]``: how many tokens are at least as likely as
        it, itself included (so the unique argmax has rank 1, and a tie counts against it).

        upstream: vllm/v1/sample/sampler.py:201 @ v0.11.0
        """
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
        own_ids = token_ids.to(torch.int64).unsqueeze(-1)
        own_values = logprobs.gather(-1, own_ids)
        ranks = (logprobs >= own_values).sum(dim=-1)
        return LogprobsTensors(torch.cat((own_ids, top_ids), dim=1),
                               torch.cat((own_values, top_values), dim=1), ranks)

    @staticmethod
    def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]):
        """Draw from each row of ``probs`` with the exponential race ``argmax(p / E)``.

        With ``E ~ Exp(1)`` i.i.d., ``argmax_i p_i / E_i`` is distributed as ``p``; it needs one
        random number per token and no cumulative sum. Seeded rows draw theirs from their own
        generator so that they are reproducible whatever else is in the batch.

        upstream: vllm/v1/sample/ops/topk_topp_sampler.py:232 @ v0.11.0
        """
        noise = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            noise.exponential_()
        for row, gen in generators.items():
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)
