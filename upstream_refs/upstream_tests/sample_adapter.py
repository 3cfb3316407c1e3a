"""The sampling half of the stand-in ``vllm`` package: today's rejection-sampler API around
mini_vllm's :class:`~mini_vllm.sample.rejection_sampler.RejectionSampler`.

vLLM 0.33.0's ``tests/v1/sample/test_rejection_sampler.py`` calls
``RejectionSampler(sampler)(spec_decode_metadata, draft_probs, logits, sampling_metadata)``:
flat target logits in, a ``[num_requests, max_spec_len + 1]`` tensor of emitted tokens out
(``-1`` after a rejection). mini_vllm's sampler takes the target's *probabilities* and each
request's draft list. The wrapper below only converts between the two:

* the bonus tokens come from the ``sampler`` the test hands in (as upstream's forward does);
* the target logits become probabilities through mini_vllm's own
  :meth:`~mini_vllm.sample.sampler.Sampler.compute_probs` (temperature, top-k, top-p; a greedy
  row is one-hot at its argmax), each request's settings repeated over its draft rows;
* the accept/reject/recover decisions are mini_vllm's, with each request's generator;
  ``sample_recovered_tokens`` draws from mini_vllm's recovered distribution.

Whatever mini_vllm leaves out raises ``LeftOutError`` when a test uses it: penalties, bad
words, allowed-token masks, logits processors, log-probabilities of the verified tokens, and
today's other verification methods (FLy, synthetic acceptance rates).

upstream: none (course-only: the bridge to the newest release's tests)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from mini_vllm.sample import rejection_sampler as mv_rejection
from mini_vllm.sample import sampler as mv_sampler

# A request whose temperature is this is greedy, in today's sampling metadata.
GREEDY_TEMPERATURE = 0.0


def build(left_out_error: type[Exception]) -> dict[str, dict[str, Any]]:
    """Module name -> {upstream name: object} for the rejection sampler's tests."""

    @dataclass
    class SamplingMetadata:
        """Today's per-batch sampling settings, held as given; the rejection sampler below
        reads the ones mini_vllm has and refuses the others when they are set."""

        temperature: torch.Tensor | None
        all_greedy: bool
        all_random: bool
        top_p: torch.Tensor | None
        top_k: torch.Tensor | None
        generators: dict[int, torch.Generator]
        max_num_logprobs: int | None
        no_penalties: bool
        prompt_token_ids: torch.Tensor | None
        frequency_penalties: torch.Tensor
        presence_penalties: torch.Tensor
        repetition_penalties: torch.Tensor
        output_token_ids: list[list[int]]
        allowed_token_ids_mask: torch.Tensor | None
        bad_words_token_ids: dict[int, list[list[int]]]
        logitsprocs: Any = None
        logprob_token_ids: dict[int, list[int]] | None = None
        spec_token_ids: list[list[int]] | None = None
        thinking_budget_state_holder: Any = None

    @dataclass
    class SpecDecodeMetadata:
        """Where each request's draft tokens and logits rows are in a flat batch (a container
        of today's shape; mini_vllm's runner keeps the same facts as lists)."""

        draft_token_ids: torch.Tensor  # [num_draft_tokens], requests one after another
        num_draft_tokens: list[int]
        cu_num_draft_tokens: torch.Tensor
        cu_num_sampled_tokens: torch.Tensor
        target_logits_indices: torch.Tensor  # logits rows of the draft positions
        bonus_logits_indices: torch.Tensor  # logits row after each request's last draft
        logits_indices: torch.Tensor
        max_spec_len: int = field(init=False)

        def __post_init__(self) -> None:
            self.max_spec_len = max(self.num_draft_tokens)

        @classmethod
        def make_dummy(cls, draft_token_ids: list[list[int]],
                       device: torch.device) -> SpecDecodeMetadata:
            lengths = [len(ids) for ids in draft_token_ids]
            flat = [t for ids in draft_token_ids for t in ids]
            cumsum = torch.tensor(lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
            return cls(
                draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
                num_draft_tokens=lengths,
                cu_num_draft_tokens=cumsum.to(device),
                cu_num_sampled_tokens=(cumsum + torch.arange(1, len(lengths) + 1,
                                                             dtype=torch.int32)).to(device),
                target_logits_indices=torch.zeros(len(flat), dtype=torch.int32, device=device),
                bonus_logits_indices=torch.zeros(len(lengths), dtype=torch.int32,
                                                 device=device),
                logits_indices=torch.zeros(len(flat) + len(lengths), dtype=torch.int32,
                                           device=device))

    @dataclass
    class SamplerOutput:
        sampled_token_ids: torch.Tensor
        logprobs_tensors: Any

    class Sampler:
        """Only a spec for ``Mock(spec=Sampler)``: the tests hand the rejection sampler a mock
        that returns the bonus tokens. Calling this one raises."""

        logprobs_mode = "raw_logprobs"

        def __call__(self, *args: Any, **kwargs: Any) -> SamplerOutput:
            raise left_out_error("today's Sampler API is not bridged; only the rejection "
                                 "sampler's is")

    class LogitsProcessors:
        """Today's container of logits processors: mini_vllm has none, so only an empty one
        is accepted."""

        def __init__(self, processors: Any = None) -> None:
            if processors:
                raise left_out_error("logits processors are left out of mini_vllm")

    class RejectionSampler(torch.nn.Module):
        """``RejectionSampler(sampler, spec_config=None, device=None)``; calling it verifies a
        batch (see the module docstring)."""

        def __init__(self, sampler: Any, spec_config: Any = None,
                     device: torch.device | None = None) -> None:
            super().__init__()
            method = getattr(spec_config, "rejection_sample_method", None)
            if method not in (None, "standard", "strict"):
                raise left_out_error(f"the {method!r} verification method is left out of "
                                     "mini_vllm")
            self.sampler = sampler
            self.verify = mv_rejection.RejectionSampler()

        def forward(self, metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None,
                    logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
            m = sampling_metadata
            used = [what for what, on in (
                ("penalties", not m.no_penalties),
                ("bad words", bool(m.bad_words_token_ids)),
                ("allowed-token masks", m.allowed_token_ids_mask is not None),
                ("log-probabilities of the verified tokens", m.max_num_logprobs is not None),
            ) if on]
            if used:
                raise left_out_error(f"{', '.join(used)} in the rejection sampler: left out "
                                     "of mini_vllm")
            bonus = self.sampler(logits=logits[metadata.bonus_logits_indices.long()],
                                 sampling_metadata=m).sampled_token_ids
            target_logits = logits[metadata.target_logits_indices.long()].float()
            batch = len(metadata.num_draft_tokens)
            if m.all_greedy:
                temperature = torch.zeros(batch)
            else:
                temperature = m.temperature.float().cpu()
            top_k = m.top_k.cpu() if m.top_k is not None else torch.zeros(batch, dtype=torch.long)
            top_p = m.top_p.float().cpu() if m.top_p is not None else torch.ones(batch)
            # One row of settings per draft token: its request's.
            repeats = torch.tensor(metadata.num_draft_tokens)
            probs = mv_sampler.Sampler().compute_probs(target_logits, mv_sampler.SamplingMetadata(
                temperature=temperature.repeat_interleave(repeats),
                top_k=top_k.long().repeat_interleave(repeats),
                top_p=top_p.repeat_interleave(repeats),
                all_greedy=m.all_greedy))
            flat = metadata.draft_token_ids.tolist()
            drafts, start = [], 0
            for n in metadata.num_draft_tokens:
                drafts.append(flat[start:start + n])
                start += n
            out = self.verify(
                drafts, probs, bonus.reshape(-1).tolist(),
                [bool(t == GREEDY_TEMPERATURE) for t in temperature.tolist()],
                draft_probs=draft_probs,
                generators=[m.generators.get(i) for i in range(batch)])
            # Today's output is max_spec_len + 1 wide, int32, on the logits' device.
            width = metadata.max_spec_len + 1
            padded = torch.full((batch, width), mv_rejection.PLACEHOLDER_TOKEN_ID,
                                dtype=torch.int32)
            padded[:, :out.shape[1]] = out.to(torch.int32)
            return SamplerOutput(sampled_token_ids=padded.to(logits.device),
                                 logprobs_tensors=None)

        @staticmethod
        def parse_output(output_token_ids: torch.Tensor, vocab_size: int,
                         **kwargs: Any) -> list[list[int]]:
            if kwargs:
                raise left_out_error(f"parse_output's {sorted(kwargs)} are left out of "
                                     "mini_vllm")
            return mv_rejection.RejectionSampler.parse_output(output_token_ids)

    def sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                                cu_num_draft_tokens: torch.Tensor,
                                draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                                target_probs: torch.Tensor, sampling_metadata: SamplingMetadata,
                                device: torch.device, use_fp64_gumbel: bool = False):
        """The token each draft position would emit if rejected: a draw from mini_vllm's
        :func:`~mini_vllm.sample.rejection_sampler.recovered_distribution`, with the request's
        generator (mini_vllm draws it only where a rejection happens; today's kernel draws it
        for every position)."""
        if use_fp64_gumbel:
            raise left_out_error("the fp64 exponential race is left out of mini_vllm")
        out = torch.empty_like(draft_token_ids)
        row = 0
        for request, n in enumerate(num_draft_tokens):
            generator = sampling_metadata.generators.get(request)
            for _ in range(n):
                residual = mv_rejection.recovered_distribution(
                    target_probs[row].float().cpu(),
                    None if draft_probs is None else draft_probs[row].float().cpu(),
                    int(draft_token_ids[row]))
                out[row] = int(torch.multinomial(residual, 1, generator=generator))
                row += 1
        return out

    # The machine: a CPU, one device (the tests size their parameter lists from it).
    current_platform = SimpleNamespace(
        device_type="cpu", device_name="cpu", device_count=lambda: 1,
        is_cuda=lambda: False, is_rocm=lambda: False, is_cpu=lambda: True,
        is_cuda_alike=lambda: False, is_xpu=lambda: False, is_tpu=lambda: False)

    return {
        "vllm.platforms": {"current_platform": current_platform},
        "vllm.v1.sample.metadata": {"SamplingMetadata": SamplingMetadata},
        "vllm.v1.sample.logits_processor": {"LogitsProcessors": LogitsProcessors},
        "vllm.v1.sample.sampler": {"Sampler": Sampler, "SamplerOutput": SamplerOutput},
        "vllm.v1.outputs": {"SamplerOutput": SamplerOutput},
        "vllm.v1.sample.rejection_sampler": {
            "RejectionSampler": RejectionSampler,
            "PLACEHOLDER_TOKEN_ID": mv_rejection.PLACEHOLDER_TOKEN_ID,
            "sample_recovered_tokens": sample_recovered_tokens,
        },
        "vllm.v1.spec_decode.metadata": {"SpecDecodeMetadata": SpecDecodeMetadata},
    }
