"""What travels between an engine-core client and the engine core: requests in, step news out.

Every message is a msgspec ``Struct`` encoded as msgpack (:mod:`mini_vllm.engine.serial_utils`),
never pickle: a message is data, so a peer can send nothing that runs code, and each field is
checked against its type as it is decoded. A message to the core is the
:class:`EngineCoreRequestType` byte, then the payload's frames (none for ``SHUTDOWN``); one from
the core is an :class:`EngineCoreOutputs`'s frames.

upstream: vllm/v1/engine/__init__.py:43 @ v0.11.0
"""

from __future__ import annotations

import enum

import msgspec

from mini_vllm.metrics.loggers import EngineLoad
from mini_vllm.outputs import EngineCoreOutput
from mini_vllm.request import RequestStatus
from mini_vllm.sampling_params import SamplingParams

__all__ = ["EngineCoreAbort", "EngineCoreOutputs", "EngineCoreRequest", "EngineCoreRequestType"]


class EngineCoreRequestType(enum.Enum):
    """The first frame of a message to the core: what the payload is.

    upstream: vllm/v1/engine/__init__.py:177 @ v0.11.0
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    SHUTDOWN = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine request as the core needs it: token ids (the client tokenized the prompt) and
    the child's own sampling parameters (the client fanned ``n`` out).

    upstream: vllm/v1/engine/__init__.py:43 @ v0.11.0
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class EngineCoreAbort(msgspec.Struct, array_like=True):
    """Finish these requests in the scheduler (their blocks go back) with this status:
    ``FINISHED_ABORTED`` (the client went away) or ``FINISHED_STOPPED`` (a stop string, which
    only the client's detokenizer sees).

    upstream: none (upstream sends a bare list of ids and always aborts)
    """

    request_ids: list[str]
    status: RequestStatus


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the core sends after a step, and between steps.

    * a step: ``outputs`` (the requests that gained tokens), ``load`` (the engine's state after
      it), ``timestamp`` (``time.monotonic()``, one clock for every process on the machine);
    * a failure: ``error`` says why and ``failed`` names the requests that failed with it;
      ``error_kind`` is ``"refused"`` (the scheduler refused an add: those requests only) or
      ``"step"`` (a step raised: the core aborted everything it held and serves on);
    * a heartbeat (``load`` is ``None``): the core is alive; ``step_age`` says how long the step
      it is in has run (0 between steps), for the client's step timeout;
    * ``fatal``: the core is going away (it failed to start, or its loop died): ``error`` says why.

    upstream: vllm/v1/engine/__init__.py:146 @ v0.11.0
    """

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    load: EngineLoad | None = None
    failed: list[str] | None = None
    error: str | None = None
    error_kind: str | None = None
    step_age: float = 0.0
    fatal: bool = False
