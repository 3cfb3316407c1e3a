"""Orca-style KV reservation: how much KV memory a request claims when it is admitted.

Before vLLM, serving systems gave each request one contiguous KV region on admission and kept it
until the request finished, because they could not grow it later. The region had to cover the
longest the request could become, which the server does not know, so it guessed:

* ``"max"``: the model's whole ``max_model_len`` (always safe, mostly wasted);
* ``"pow2"``: the next power of two of the request's final length (a buddy allocator's classes);
* ``"oracle"``: exactly the final length (a bound no real server reaches: it needs the future).

Paged memory (``"paged"``) claims one block at a time as the request grows, so a running request
holds at most one partly filled block it does not use yet.

Lab 02-02 replays traces through these policies in a simulator; lab 03-06 runs them in the real
engine (``SchedulerConfig.kv_reservation``), where the scheduler claims the reserved blocks at
admission. There the reservation is made of the engine's own blocks, so it has no external
fragmentation: it is a best case for reservation (a contiguous allocator also loses the holes
between regions, as lab 02-02 measures).

upstream: none (course-only: vLLM pages its KV and has no reservation mode; the policies are the
baselines of the PagedAttention paper, section 6)
"""

from __future__ import annotations

__all__ = ["admission_lookahead", "reservation_size"]


def reservation_size(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """KV slots a contiguous-reservation system sets aside for a request on admission.

    ``"max"``: ``max_model_len``; ``"pow2"``: the smallest power of two that holds
    ``prompt_len + output_len``, capped at ``max_model_len``; ``"oracle"``: exactly
    ``prompt_len + output_len``. ``ValueError`` for an unknown policy, lengths below 1, or a
    request longer than ``max_model_len``.

    upstream: none (the Orca baselines of the PagedAttention paper; see the module docstring)
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"lengths must be >= 1, got prompt {prompt_len}, output {output_len}")
    final_len = prompt_len + output_len
    if final_len > max_model_len:
        raise ValueError(f"request of {final_len} tokens exceeds max_model_len={max_model_len}")
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(1 << (final_len - 1).bit_length(), max_model_len)
    if policy == "oracle":
        return final_len
    raise ValueError(f"unknown reservation policy {policy!r}; use 'max', 'pow2' or 'oracle'")


def admission_lookahead(
    policy: str, prompt_len: int, max_tokens: int, num_tokens_after_step: int, max_model_len: int
) -> int:
    """Slots beyond this step's tokens that a request claims on admission under ``policy``.

    ``"paged"`` claims nothing ahead (0). A reservation policy claims its whole
    :func:`reservation_size` now, minus the ``num_tokens_after_step`` slots the step takes
    anyway; the final length is ``prompt_len + max_tokens`` capped at ``max_model_len`` (so the
    ``"oracle"`` is exact for a request that runs to ``max_tokens``, as the load benchmark's
    requests do with ``ignore_eos``, and over-reserves for one that stops early at EOS).
    Invariant: ``num_tokens_after_step + lookahead`` covers every token the request can reach,
    so a reserving request never needs another block and is never preempted.

    upstream: none (Orca-style admission; vLLM's lookahead slots are for speculative tokens)
    """
    if policy == "paged":
        return 0
    output_len = max(1, min(max_tokens, max_model_len - prompt_len))
    reserved = reservation_size(policy, prompt_len, output_len, max_model_len)
    return max(0, reserved - num_tokens_after_step)
