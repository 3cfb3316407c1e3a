"""FP8 (e4m3) KV cache: the dtype names, the per-layer scales and the two conversions.

A quantized cache stores ``fp8(x / scale)`` and attention reads ``fp8_value * scale``, with one
float scale per layer for keys (``k_scale``) and one for values (``v_scale``), as upstream's
``Attention`` layer keeps ``_k_scale``/``_v_scale``. e4m3 is the format upstream uses for
``kv_cache_dtype="fp8"``: 4 exponent bits, 3 mantissa bits, no infinities, largest finite value
448. Within its normal range (``|x / scale|`` from ``2**-6`` to 448) rounding to the nearest of 8
mantissa steps costs at most half a step, a relative error of ``2**-4``; below it (subnormals)
the error is absolute, at most ``2**-10 * scale``; above it the value *saturates* to
``+-448 * scale`` (upstream clamps before converting; so do we, rather than trust a cast).

Everything here is plain PyTorch (float8 dtypes work on the CPU) and validates before it
computes, so bad input raises ``ValueError`` and changes nothing.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "KV_CACHE_DTYPES",
    "K_SCALE_CONSTANT",
    "V_SCALE_CONSTANT",
    "check_kv_scale",
    "is_fp8",
    "kv_cache_torch_dtype",
    "scaled_fp8_dequant",
    "scaled_fp8_quant",
]

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value: 1.75 * 2**8 (torch.finfo(torch.float8_e4m3fn).max).
FP8_E4M3_MAX = 448.0
# The kv_cache_dtype names this course accepts: "auto" keeps the model's dtype; "fp8" is
# e4m3, as upstream (fp8_e5m2, also upstream's, is left out: see upstream_refs/left_out).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Upstream's calibration divides a layer's first-batch amax by these, not by 448, leaving
# headroom for later tokens larger than the calibration batch's (vllm/envs.py defaults).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(kv_cache_dtype: str) -> bool:
    """True for the names of the FP8 cache (``"fp8"``, ``"fp8_e4m3"``); checks the name.

    upstream: vllm/config/cache.py:25 @ v0.11.0
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r} "
            "(fp8_e5m2 is not supported: this course implements e4m3)"
        )
    return kv_cache_dtype != "auto"


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors: the model's for ``"auto"``, e4m3 for ``"fp8"``.

    upstream: vllm/config/cache.py:53 @ v0.11.0
    """
    return FP8_DTYPE if is_fp8(kv_cache_dtype) else model_dtype


def check_kv_scale(name: str, scale: float | torch.Tensor) -> float:
    """``scale`` as a Python float, or ``ValueError`` unless it is one finite number > 0.

    Accepts an int or float (not a bool) or a one-element floating tensor (upstream passes
    ``k_scale``/``v_scale`` as float32 tensors).

    upstream: none (upstream's ops trust the scales they are given)
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be one float (or a one-element float tensor), got a "
                f"{scale.dtype} tensor of shape {tuple(scale.shape)}"
            )
        value = float(scale.item())
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        value = float(scale)
    else:
        raise ValueError(f"{name} must be a float, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"{name} must be finite and > 0 (the cache stores x / {name}), got {value}"
        )
    return value


def scaled_fp8_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``fp8_e4m3(clamp(x / scale, -448, 448))``: what a quantized cache stores for ``x``.

    The division and the clamp run in float32 (as upstream's kernel converts through float);
    the cast rounds to the nearest e4m3 value. NaN stays NaN; +-inf saturates like any value
    beyond ``448 * scale``. ``scale`` must already be checked (:func:`check_kv_scale`).

    upstream: csrc/quantization/fp8/common.cuh:41 @ v0.11.0
    """
    y = x.to(torch.float32) / scale
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def scaled_fp8_dequant(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the value a quantized cache entry stands for.

    The product is taken in float32, then cast to ``dtype`` (for float32 that is one rounding).

    upstream: csrc/quantization/fp8/nvidia/quant_utils.cuh:529 @ v0.11.0
    """
    return (q.to(torch.float32) * scale).to(dtype)
