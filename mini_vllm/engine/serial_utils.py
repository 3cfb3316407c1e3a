"""msgpack with tensors out of band: the encoding of every engine-core message.

A message encodes to a list of frames: the msgpack body first, then one raw buffer per tensor
(a tensor in the body is only a reference: dtype, shape, buffer index). ZeroMQ sends the frames
as they are, so a tensor's bytes are never copied into the body nor parsed on arrival: the
decoder wraps the received buffer (``torch.frombuffer``; a read-only frame, such as the
``bytes`` a plain receive gives, is copied once into a writable buffer first).

upstream: vllm/v1/serial_utils.py:98 @ v0.11.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

__all__ = ["TENSOR_EXT", "MsgpackDecoder", "MsgpackDecoderBase", "MsgpackEncoder",
           "MsgpackEncoderBase"]

TENSOR_EXT = 1  # msgpack extension code of a tensor reference


class MsgpackEncoderBase:
    """Encode a message into frames. Not thread-safe: one encoder per sending thread.

    The given half (lab 04-01): ``encode`` collects the tensors' buffers that ``_enc_hook``
    (the subclass's) lays aside while msgspec encodes the body.

    upstream: vllm/v1/serial_utils.py:98 @ v0.11.0
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffers: list[memoryview] | None = None

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """``[body, *tensor buffers]``."""
        self._buffers = []
        try:
            body = self._encoder.encode(obj)
            return [body, *self._buffers]
        finally:
            self._buffers = None


class MsgpackEncoder(MsgpackEncoderBase):
    """The encoder, with its tensor hook: a tensor leaves the body as a reference to a frame.

    upstream: vllm/v1/serial_utils.py:98 @ v0.11.0
    """

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and self._buffers is not None:
            flat = obj.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            index = len(self._buffers)
            self._buffers.append(memoryview(flat.numpy()))
            meta = (str(obj.dtype).removeprefix("torch."), list(obj.shape), index)
            return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode(meta))
        raise TypeError(f"cannot send a {type(obj).__name__} to or from the engine core: "
                        "messages carry msgspec Structs, dataclasses, builtins and tensors")


class MsgpackDecoderBase:
    """Decode frames into an object of type ``t`` (checked as it is decoded).

    The given half (lab 04-01): ``decode`` hands the subclass's ``_ext_hook`` the frames after
    the body, where the tensors' bytes are.

    upstream: vllm/v1/serial_utils.py:272 @ v0.11.0
    """

    def __init__(self, t: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook)
        self._buffers: Sequence[Any] = ()

    def decode(self, frames: Sequence[bytes | memoryview]) -> Any:
        self._buffers = frames[1:]
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._buffers = ()


class MsgpackDecoder(MsgpackDecoderBase):
    """The decoder, with its tensor hook: a tensor reference becomes a tensor over its frame.

    upstream: vllm/v1/serial_utils.py:272 @ v0.11.0
    """

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != TENSOR_EXT:
            raise ValueError(f"unknown msgpack extension {code} in an engine-core message")
        dtype, shape, index = msgspec.msgpack.decode(data)
        raw = self._buffers[index]
        if not len(raw):
            return torch.empty(shape, dtype=getattr(torch, dtype))
        if memoryview(raw).readonly:  # bytes: a tensor over it would write through them
            raw = bytearray(raw)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
