"""One generation request as the engine core sees it: its tokens, its progress, its block hashes.

A ``Request`` owns three growing things that must stay in step:

- ``all_token_ids`` = prompt tokens followed by output tokens (read-only view; grow it only with
  ``append_output_token_ids``);
- ``num_computed_tokens``, how many of those tokens already have KV in the cache (the scheduler
  advances it);
- ``block_hashes``, the hash of every *full* block of ``all_token_ids`` (block ``i`` covers tokens
  ``[i * block_size, (i + 1) * block_size)``), computed by the ``block_hasher`` given at
  construction when the request is created and again each time tokens are appended. The KV cache
  manager never hashes tokens itself; it reads these.

Left out of upstream's class: multimodal inputs, pooling, structured output, prompt embeddings,
speculative tokens, events and KV-transfer parameters (see ``upstream_refs/left_out``).

upstream: vllm/v1/request.py:26 @ v0.11.0
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, overload

from mini_vllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # only for annotations; avoids a hard import cycle with kv_cache_utils
    from mini_vllm.core.kv_cache_utils import BlockHash

T = TypeVar("T")


class ConstantList(Sequence[T]):
    """A read-only view of a list that the owner keeps growing.

    ``Request`` hands out views of its token lists so that nobody appends to them directly: the
    block hashes would silently fall behind the tokens. Slicing returns a fresh ``list``.

    upstream: vllm/v1/utils.py:37 @ v0.11.0
    """

    def __init__(self, x: list[T]) -> None:
        self._x = x

    @overload
    def __getitem__(self, item: int) -> T: ...

    @overload
    def __getitem__(self, item: slice) -> list[T]: ...

    def __getitem__(self, item: int | slice) -> T | list[T]:
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[T]:
        return iter(self._x)

    def __contains__(self, item: object) -> bool:
        return item in self._x

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._x == other._x
        if isinstance(other, list):
            return self._x == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable underneath, like a list

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "this token list is read-only: use Request.append_output_token_ids(...) so that "
            "the request's block hashes stay in step with its tokens"
        )

    append = extend = insert = remove = pop = clear = __setitem__ = __delitem__ = _read_only


@dataclass(frozen=True)
class LoRARequest:
    """The identity of a LoRA adapter, as far as the KV cache cares.

    Two requests with different adapters compute different KV for the same tokens, so the adapter
    id is folded into every block hash (``lora_int_id`` must be >= 1, as upstream).

    upstream: vllm/lora/request.py:10 @ v0.11.0
    """

    lora_name: str
    lora_int_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an int >= 1, got "
                             f"{self.lora_int_id!r}")


class FinishReason(enum.IntEnum):
    """Why a request finished, as reported to the user: stop, length or abort.

    upstream: vllm/v1/engine/__init__.py:24 @ v0.11.0
    """

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Where a request is in its life: waiting, running, preempted, or one of the finished states.

    Unlike upstream (which calls every status after ``PREEMPTED`` finished), "finished" is an
    explicit set here, so that a new non-finished status (for example ``SWAPPED``) can be appended
    at the end without becoming finished by accident.

    upstream: vllm/v1/request.py:205 @ v0.11.0
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    # mini_vllm addition (phase 03, V0-style swap): the request's KV is parked in CPU blocks.
    SWAPPED = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the four ``FINISHED_*`` statuses."""
        return status in _FINISHED_REASON_MAP

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The user-facing reason for a finished status, ``None`` for any other status."""
        return _FINISHED_REASON_MAP.get(status)


# An ignored request had a prompt longer than the model allows: the user sees "length", as in the
# OpenAI API.
_FINISHED_REASON_MAP: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


def _check_token_ids(name: str, token_ids: Sequence[int]) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
        raise ValueError(f"Request: {name} must be non-negative ints, got {list(token_ids)!r}")


class Request:
    """A request's tokens and progress; see the module docstring for the invariants.

    Invariants: ``num_tokens == num_prompt_tokens + num_output_tokens``;
    ``0 <= num_computed_tokens <= num_tokens + num_output_placeholders`` (the scheduler's job);
    with a block hasher, ``len(block_hashes) == num_tokens // block_size`` at all times and
    ``block_hashes[i]`` is the chained hash of block ``i``.

    upstream: vllm/v1/request.py:26 @ v0.11.0
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"Request: request_id must be a non-empty str, got {request_id!r}")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"Request {request_id!r}: sampling_params must be a SamplingParams "
                f"(mini_vllm.sampling_params), got {type(sampling_params).__name__}"
            )
        if prompt_token_ids is None or len(prompt_token_ids) == 0:
            raise ValueError(f"Request {request_id!r}: the prompt must hold at least one token")
        _check_token_ids("prompt_token_ids", prompt_token_ids)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"Request {request_id!r}: cache_salt must be a str or None")

        self.request_id = request_id
        self.priority = priority
        self.sampling_params = sampling_params
        # Each request carries its own EOS id (a LoRA adapter may change it).
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time if arrival_time is not None else time.time()

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Read-only views: all appends go through append_output_token_ids.
        self.output_token_ids: ConstantList[int] = ConstantList(self._output_token_ids)
        self.all_token_ids: ConstantList[int] = ConstantList(self._all_token_ids)

        self.num_computed_tokens = 0
        # Async scheduling: tokens that steps still in flight will sample for this request
        # (num_tokens counts them once they arrive; the scheduler plans past them meanwhile).
        self.num_output_placeholders = 0
        # Draft tokens a proposer guessed after the last token, for the next step to check
        # (speculative decoding); never part of num_tokens.
        self.spec_token_ids: list[int] = []
        # Tokens served from the prefix cache when first scheduled; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0

        self.block_hashes: list[BlockHash] = []
        self.get_hash_new_full_blocks: Callable[[], list[BlockHash]] | None = None
        if block_hasher is not None:
            self.get_hash_new_full_blocks = partial(block_hasher, self)
            self.block_hashes = self.get_hash_new_full_blocks()

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated token(s) and hash any block they complete.

        upstream: vllm/v1/request.py:150 @ v0.11.0
        """
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        _check_token_ids("output token ids", new)
        self._output_token_ids.extend(new)
        self._all_token_ids.extend(new)
        if self.get_hash_new_full_blocks is not None:
            self.block_hashes.extend(self.get_hash_new_full_blocks())

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Prompt plus output tokens plus the draft tokens waiting to be checked."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        """True once the request reached a ``FINISHED_*`` status."""
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        """The user-facing finish reason, or ``None`` while the request is alive."""
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, full_blocks_hashed={len(self.block_hashes)})"
        )
