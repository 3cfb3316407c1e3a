"""Lab 04-04 solution: the reference lives in ``mini_vllm.spec_decode.ngram_proposer`` (the
n-gram proposer), ``mini_vllm.sample.rejection_sampler`` (the rejection sampler) and
``mini_vllm.core.sched.scheduler`` (the scheduler's drafts)."""

from __future__ import annotations

from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    accepts,
    recovered_distribution,
)
from mini_vllm.spec_decode.ngram_proposer import NgramProposer, propose_ngram_tokens

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "NgramProposer",
    "RejectionSampler",
    "Scheduler",
    "accepts",
    "propose_ngram_tokens",
    "recovered_distribution",
]
