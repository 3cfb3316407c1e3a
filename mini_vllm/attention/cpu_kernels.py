"""The engine's compiled CPU path in C: the paged cache write, decode attention (fp32), and the
linear layers' products for small batches (fp32, bf16, or GGUF's Q4_1 / Q8_0 blocks).

Lab 02-04's PyTorch ops are the engine's reference pieces: every PyTorch operation of a decode
step is a separate call that allocates its result, and the op gathers each sequence's context
into a contiguous copy before it can multiply it. On a CPU with a small model that overhead, not
arithmetic, is most of a decode step. ``cpu_kernels.c`` does the same two jobs in one call each,
reading every block where it lies (as lab 02-06's CUDA kernel does on a GPU, and as upstream's
CPU backend does), which is what keeps the engine near a plain contiguous-cache loop
(``benchmarks/engine_vs_plain.py``).

Decode on a CPU is bound by the bytes of weights read per token: every step reads every weight
once for a few rows of activations. :func:`linear` streams them in 4-row x 4-token blocks split
over the OpenMP threads (PyTorch's own fp32 matrix-vector product reads them at about half the
memory's speed here, and its bf16 one, on a CPU without bf16 instructions, is slower still), and
takes weights in bf16 as well, widened to fp32 as they are read: half the bytes per token, or
as GGUF's quantized blocks (Q4_1: 5 bits a weight; Q8_0: 8.5), dequantized in registers.
The kernels share PyTorch's OpenMP runtime (PyTorch is imported first and loads ``libgomp``), so
``torch.set_num_threads`` sets their threads too.

The C file is compiled once, on first use, with the system C compiler (``$CC`` or ``cc``) into
``$MINI_VLLM_CACHE`` (default ``~/.cache/mini_vllm``), keyed by a hash of the source, the flags
and the CPU (it is built for the CPU it runs on). Without a working compiler, or with
``MINI_VLLM_DISABLE_CPU_KERNELS=1``, :func:`load` returns ``None`` and the engine runs the
PyTorch ops; nothing else changes. The engine also runs the PyTorch ops
whenever a student's own lab 02-04 piece stands in for the reference one (``python -m course
engine``), so that it is the student's code that runs.

upstream: csrc/cpu/attention.cpp:256 @ v0.11.0 (the decode)
upstream: csrc/cpu/cache.cpp:42 @ v0.11.0 (the cache write)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -march=native: this CPU's vector width (the cache key includes the CPU, see _build).
# -ffp-contract=off: a * b + c rounds twice wherever the compiler puts it, so an output is the
# same bits whichever loop variant (token block, tail) computed it.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")
BLOCK_SIZE = 16  # the decode's one block size, as upstream's CPU kernel (BS in cpu_kernels.c)
MAX_HEAD_SIZE = 256  # MV_MAX_HEAD_SIZE
_ERRORS = {
    1: "seq_lens[{bad}] is negative or longer than its block table row holds",
    2: "block_tables row {bad} names a block outside the cache",
    3: "slot_mapping[{bad}] is beyond the cache (num_blocks * block_size slots)",
    4: "out of memory for the decode's logits",
}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_lib: object = None  # None: not tried yet; False: unavailable


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """The CPU's model and features: ``-march=native`` code is only reused on the same CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.machine() + platform.processor()
    return "\n".join(line for line in info.splitlines()
                     if line.startswith(("model name", "flags", "Features", "CPU part")))


def _build(cc: str) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode()
                            + _cpu_identity().encode()).hexdigest()
    cache = Path(os.environ.get("MINI_VLLM_CACHE") or Path.home() / ".cache" / "mini_vllm")
    target = cache / f"cpu_kernels-{digest[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Compile to a private name and rename: processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        # A compiler that does not know -march=native or OpenMP gets a second try without them
        # (the kernels then run on one thread).
        for flags in (FLAGS, tuple(f for f in FLAGS if f not in ("-march=native", "-fopenmp"))):
            try:
                subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if "-march=native" not in flags:
                    raise
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; ``None`` where they cannot be (with a warning
    saying why, once) or are turned off with ``MINI_VLLM_DISABLE_CPU_KERNELS=1``.

    upstream: none (vLLM compiles its CPU kernels when its wheel is built, not at run time)
    """
    global _lib
    if os.environ.get("MINI_VLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        return None
    if _lib is None:
        cc = _compiler()
        try:
            if cc is None:
                raise OSError("no C compiler (set CC, or install cc)")
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()[-1:]
            warnings.warn(f"mini_vllm: the compiled CPU kernels are unavailable "
                          f"({' '.join(detail) or type(exc).__name__}); "
                          "the engine uses the PyTorch ops, which give the same tokens, slower",
                          RuntimeWarning, stacklevel=2)
            _lib = False
        else:
            lib.mv_reshape_and_cache_f32.argtypes = [
                _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                ctypes.POINTER(_i64)]
            lib.mv_paged_decode_f32.argtypes = [
                _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64,
                ctypes.c_float, ctypes.POINTER(_i64)]
            for fn in (lib.mv_linear_f32, lib.mv_linear_bf16, lib.mv_linear_q4_1,
                       lib.mv_linear_q8_0):
                fn.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64]
                fn.restype = None
            for fn in (lib.mv_dequantize_q4_1, lib.mv_dequantize_q8_0):
                fn.argtypes = [_ptr, _ptr, _i64, _i64]
                fn.restype = None
            lib.mv_decode_step.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
                                           _i64, _ptr, ctypes.POINTER(_i64)]
            _lib = lib
    return _lib or None


def supports(query_dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernels serve these caches: contiguous fp32 on the CPU (``x`` = 4), block
    size 16, a head size up to 256 (what the engine allocates for an fp32 model by default).

    upstream: none (vLLM's CPU build serves every cache it allocates with its own kernels)
    """
    return (query_dtype == torch.float32 and key_cache.dtype == torch.float32
            and value_cache.dtype == torch.float32 and key_cache.device.type == "cpu"
            and key_cache.dim() == 5 and key_cache.shape[3:] == (BLOCK_SIZE, 4)
            and key_cache.shape[2] * 4 <= MAX_HEAD_SIZE
            and key_cache.is_contiguous() and value_cache.is_contiguous())


def _library() -> ctypes.CDLL:
    if _lib:
        return _lib  # type: ignore[return-value]
    lib = load()
    if lib is None:
        raise RuntimeError("the compiled CPU kernels are not available here (see load())")
    return lib


def _check(code: int, bad: ctypes.c_int64) -> None:
    if code:
        raise ValueError(_ERRORS.get(code, "error {bad}").format(bad=bad.value))


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t [tokens, heads, dims]`` as the C code reads it: heads and dims contiguous."""
    if t.dim() != 3 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a 3-D float32 CPU tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def _check_caches(key_cache, value_cache, num_kv_heads: int, head_size: int, what: str) -> int:
    """The caches' number of blocks, after checking them against the kernels' layout."""
    num_blocks = key_cache.shape[0] if key_cache.dim() == 5 else -1
    if (not supports(torch.float32, key_cache, value_cache) or head_size % 4
            or key_cache.shape != (num_blocks, num_kv_heads, head_size // 4, BLOCK_SIZE, 4)
            or value_cache.shape != (num_blocks, num_kv_heads, head_size, BLOCK_SIZE)):
        raise ValueError(
            f"{what}: the kernels take contiguous fp32 CPU caches [num_blocks, {num_kv_heads}, "
            f"{head_size // 4}, {BLOCK_SIZE}, 4] and [num_blocks, {num_kv_heads}, {head_size}, "
            f"{BLOCK_SIZE}] (head_size a multiple of 4, at most {MAX_HEAD_SIZE}); got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)} of {key_cache.dtype}; "
            "use the PyTorch ops of mini_vllm.attention for anything else")
    return num_blocks


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache_ops.reshape_and_cache`` for fp32 caches (``kv_cache_dtype="auto"``), in C.

    Checks the shapes and every slot's range before writing. Unlike the lab's op it does not
    look for two tokens sharing a slot: the engine's slots are distinct by construction (one per
    token position, in blocks the block pool gives one request at a time).

    upstream: csrc/cpu/cache.cpp:42 @ v0.11.0
    """
    lib = _library()
    key, value = _rows(key, "key"), _rows(value, "value")
    num_tokens, kv_heads, head_size = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    num_blocks = _check_caches(key_cache, value_cache, kv_heads, head_size, "reshape_and_cache")
    slots = slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    if slots.dim() != 1 or slots.shape[0] > num_tokens:
        raise ValueError(f"slot_mapping must be 1-D with at most {num_tokens} entries, got "
                         f"shape {tuple(slots.shape)}")
    bad = _i64(-1)
    _check(lib.mv_reshape_and_cache_f32(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), slots.data_ptr(), slots.shape[0], kv_heads, head_size,
        BLOCK_SIZE, num_blocks * BLOCK_SIZE, ctypes.byref(bad)), bad)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                 scale: float) -> torch.Tensor:
    """``paged_attn.forward_decode`` (no ALiBi) for fp32 caches, in C; returns the output.

    Checks every used block id and length before computing; table columns past a sequence's
    end are never read.

    upstream: csrc/cpu/attention.cpp:256 @ v0.11.0
    """
    lib = _library()
    query = _rows(query, "query")
    num_seqs, num_heads, head_size = query.shape
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}")
    num_blocks = _check_caches(key_cache, value_cache, num_kv_heads, head_size, "paged_decode")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
            or block_tables.shape[0] < num_seqs or seq_lens.dtype != torch.int32
            or seq_lens.shape != (num_seqs,)):
        raise ValueError(f"block_tables must be int32 [>= {num_seqs}, cols] and seq_lens int32 "
                         f"[{num_seqs}]; got {block_tables.dtype} {tuple(block_tables.shape)} "
                         f"and {seq_lens.dtype} {tuple(seq_lens.shape)}")
    query = query.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(query)
    bad = _i64(-1)
    _check(lib.mv_paged_decode_f32(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), num_seqs,
        num_heads, num_kv_heads, head_size, num_blocks, scale, ctypes.byref(bad)), bad)
    return out


# Rows (tokens) up to which :func:`linear` takes a product, by weight dtype or block format: a
# decode step's handful. Past a few fp32 rows PyTorch's (MKL's) blocked GEMM is as fast, and a
# prefill is bound by arithmetic, where it wins; bf16 and quantized weights stay here longer,
# because PyTorch would first have to widen the whole weight (three or six times the bytes).
LINEAR_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 32, "q4_1": 32, "q8_0": 32}
# GGUF's (llama.cpp's) block formats: QUANT_BLOCK consecutive weights of a row per block, and the
# bytes of one block (Q4_1: fp16 scale, fp16 minimum, 16 bytes of 4-bit codes; Q8_0: fp16 scale,
# 32 int8 codes). A quantized weight [N, K] is a uint8 tensor [N, K // 32 * bytes].
QUANT_BLOCK = 32
QUANT_BYTES = {"q4_1": 20, "q8_0": 34}


def check_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> None:
    """Raise ``ValueError`` unless ``blocks`` is a contiguous uint8 CPU tensor of whole ``fmt``
    blocks for rows of ``in_features`` weights (a multiple of 32).

    upstream: none (vLLM's GGUF layers keep the file's blocks as a uint8 parameter too)
    """
    if fmt not in QUANT_BYTES:
        raise ValueError(f"unknown block format {fmt!r}; known: {sorted(QUANT_BYTES)}")
    row_bytes = in_features // QUANT_BLOCK * QUANT_BYTES[fmt]
    if (in_features % QUANT_BLOCK or blocks.dtype != torch.uint8 or blocks.dim() != 2
            or blocks.shape[1] != row_bytes or blocks.device.type != "cpu"
            or not blocks.is_contiguous()):
        raise ValueError(f"{fmt} weights of rows of {in_features} must be a contiguous uint8 CPU "
                         f"tensor [rows, {row_bytes}] ({in_features} a multiple of "
                         f"{QUANT_BLOCK}); got {blocks.dtype} {tuple(blocks.shape)}")


def linear_supported(x: torch.Tensor, weight: torch.Tensor, fmt: str | None = None) -> bool:
    """Whether :func:`linear` takes these: fp32 activations on the CPU, a contiguous fp32 or
    bf16 weight (or ``fmt``'s blocks), no autograd, at most :data:`LINEAR_MAX_ROWS` rows, and
    the kernels built.

    upstream: none (vLLM's CPU backend multiplies through oneDNN)
    """
    kind = fmt if fmt is not None else weight.dtype
    if fmt is not None:
        in_ok = weight.dtype == torch.uint8 and weight.dim() == 2 and (
            weight.shape[1] * QUANT_BLOCK == x.shape[-1] * QUANT_BYTES.get(fmt, 0))
    else:
        in_ok = weight.dim() == 2 and x.shape[-1] == weight.shape[1]
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and kind in LINEAR_MAX_ROWS and in_ok
            and weight.device.type == "cpu" and weight.is_contiguous()
            and x.numel() <= LINEAR_MAX_ROWS[kind] * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and load() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fmt: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in C, fp32 out, for :func:`linear_supported` inputs; a bf16
    weight is widened to fp32 as it is read, ``fmt``'s blocks (``"q4_1"``, ``"q8_0"``) are
    dequantized in registers to exactly :func:`dequantize`'s values. Each output is summed in
    the same order whatever the batch, the thread count and the weight's format (a token's
    result never depends on its neighbours; quantized weights give the bits fp32 weights of the
    same values give).

    upstream: none (vLLM's CPU backend multiplies through oneDNN)
    """
    lib = _library()
    in_features = x.shape[-1]
    if fmt is not None:
        check_blocks(weight, fmt, in_features)
        fn = getattr(lib, f"mv_linear_{fmt}")
    else:
        fn = lib.mv_linear_bf16 if weight.dtype == torch.bfloat16 else lib.mv_linear_f32
    out_features = weight.shape[0]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
        bias = bias.to(torch.float32).reshape(out_features)
    if bias is not None:
        bias = bias.contiguous()  # held here: C reads it after data_ptr() returns
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    fn(out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], weight.data_ptr(),
       None if bias is None else bias.data_ptr(), out_features, in_features)
    return out.view(*x.shape[:-1], out_features)


def dequantize(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """``fmt``'s blocks as an fp32 weight ``[rows, in_features]``, in C: the values gguf's
    ``dequantize`` gives, bit for bit (what a product of many rows hands to PyTorch's GEMM).

    upstream: none (vLLM dequantizes GGUF weights in its CUDA kernels)
    """
    check_blocks(blocks, fmt, in_features)
    out = torch.empty(blocks.shape[0], in_features, dtype=torch.float32)
    getattr(_library(), f"mv_dequantize_{fmt}")(out.data_ptr(), blocks.data_ptr(),
                                                 blocks.shape[0], in_features)
    return out


if __name__ == "__main__":  # python -m mini_vllm.attention.cpu_kernels: build and say where
    lib = load()
    print(f"compiled CPU kernels: {lib._name if lib else 'unavailable'}", file=sys.stderr)
