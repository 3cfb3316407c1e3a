"""The CUDA extension's functions, run by the emulator: same names, same arguments, CPU tensors.

``EmulatedOps`` stands where ``load_ops()`` returns the torch extension module on a GPU. It fills
in what ``bindings.cpp`` computes from the tensors (sizes, strides, dtype codes) and runs the op
in an emulator process built for exactly the instantiation the call needs.

upstream: none (the emulation's stand-in for bindings.cpp, which follows vllm's _custom_ops)
"""

from __future__ import annotations

import torch

from mini_vllm.csrc.emulation.build import KV_CACHE_DTYPE_CODES, Build, Variant
from mini_vllm.csrc.emulation.run import Arg, run_op

_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


def _kv_cache_dtype(name: str) -> str:
    """The emulation's name of a checked ``kv_cache_dtype`` ("fp8_e4m3" is "fp8")."""
    return "auto" if name == "auto" else "fp8"
PARTITION_SIZE = 512


class EmulatedOps:
    """Runs the kernels of `build` on the CPU; ``device`` picks the modelled GPU
    (None: $MINI_VLLM_EMU_DEVICE, else "default")."""

    def __init__(self, build: Build, device: str | None = None):
        self.build = build
        self.device = device
        self._executables: dict[Variant, object] = {}

    def __repr__(self) -> str:
        return f"EmulatedOps({self.build.name!r}, flavor={self.build.flavor!r})"

    def executable(self, variant: Variant):
        exe = self._executables.get(variant)
        if exe is None:
            exe = self._executables[variant] = self.build.executable(variant)
        return exe

    def _run(self, variant: Variant, op: str, buffers: dict, scalars: dict) -> None:
        run_op(self.executable(variant), op, buffers, scalars, device=self.device,
               own_files=self.build.own_files)

    # ---- attention ---------------------------------------------------------------------------

    def _attention(self, op, out, query, key_cache, value_cache, num_kv_heads, scale,
                   block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                   partition_buffers=None, partition_size=0, probe=None,
                   kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0) -> None:
        dtype = _DTYPE[query.dtype]
        kv = _kv_cache_dtype(kv_cache_dtype)
        variant = Variant((dtype,), (query.shape[2],), (int(block_size),), (kv,))
        buffers = {
            "query": Arg(query),
            "key_cache": Arg(key_cache),
            "value_cache": Arg(value_cache),
            "block_tables": Arg(block_tables),
            "seq_lens": Arg(seq_lens),
        }
        if out is not None:
            buffers["out"] = Arg(out, writable=True)
        if alibi_slopes is not None:
            buffers["alibi_slopes"] = Arg(alibi_slopes)
        scalars = {
            "dtype": _CODE[dtype],
            "num_seqs": query.shape[0],
            "num_heads": query.shape[1],
            "num_kv_heads": int(num_kv_heads),
            "head_size": query.shape[2],
            "block_size": int(block_size),
            "max_num_blocks_per_seq": block_tables.shape[1],
            "max_seq_len": int(max_seq_len),
            "q_stride": query.stride(0),
            "kv_block_stride": key_cache.stride(0),
            "kv_head_stride": key_cache.stride(1),
            "scale": float(scale),
            "kv_cache_dtype": KV_CACHE_DTYPE_CODES[kv],
            "k_scale": float(k_scale),
            "v_scale": float(v_scale),
        }
        if partition_buffers is not None:
            exp_sums, max_logits, tmp_out = partition_buffers
            buffers["exp_sums"] = Arg(exp_sums, writable=True)
            buffers["max_logits"] = Arg(max_logits, writable=True)
            buffers["tmp_out"] = Arg(tmp_out, writable=True)
            scalars["max_num_partitions"] = exp_sums.shape[2]
            scalars["partition_size"] = int(partition_size)
        if probe is not None:  # (writable buffers, scalars) of a probe
            buffers.update({name: Arg(t, writable=True) for name, t in probe[0].items()})
            scalars.update(probe[1])
        self._run(variant, op, buffers, scalars)

    def paged_attention_naive(self, out, query, key_cache, value_cache, num_kv_heads, scale,
                              block_tables, seq_lens, block_size, max_seq_len,
                              alibi_slopes=None) -> None:
        self._attention("paged_attention_naive", out, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes)

    def paged_attention_v1(self, out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len,
                           alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0,
                           v_scale=1.0) -> None:
        self._attention("paged_attention_v1", out, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)

    def paged_attention_v2(self, out, exp_sums, max_logits, tmp_out, query, key_cache,
                           value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                           max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0,
                           v_scale=1.0) -> None:
        self._attention("paged_attention_v2", out, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                        (exp_sums, max_logits, tmp_out), kv_cache_dtype=kv_cache_dtype,
                        k_scale=k_scale, v_scale=v_scale)

    def paged_attention_gqa(self, out, exp_sums, max_logits, tmp_out, query, key_cache,
                            value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                            max_seq_len, alibi_slopes=None, partition_size=0,
                            kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0) -> None:
        self._attention("paged_attention_gqa", out, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                        (exp_sums, max_logits, tmp_out), partition_size,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)

    # ---- lab 02-06's probes: steps 1 and 2 of the decode kernels alone ----------------------

    def qk_logits_probe(self, logits, range_max, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                        range_tokens) -> None:
        probe = ({"logits": logits, "range_max": range_max},
                 {"logits_stride": logits.shape[2], "num_ranges": range_max.shape[2],
                  "range_tokens": int(range_tokens)})
        self._attention("qk_logits_probe", None, query, key_cache, value_cache, num_kv_heads,
                        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                        probe=probe)

    def softmax_probe(self, rows, lengths, stats) -> None:
        self._run(self._CACHE_VARIANT, "softmax_probe", {
            "rows": Arg(rows, writable=True),
            "lengths": Arg(lengths),
            "stats": Arg(stats, writable=True),
        }, {"num_rows": rows.shape[0], "width": rows.shape[1]})

    # ---- cache kernels -----------------------------------------------------------------------

    _CACHE_VARIANT = Variant()  # every dtype, no attention instantiation

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping,
                          kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0) -> None:
        kv = _kv_cache_dtype(kv_cache_dtype)
        self._run(self._CACHE_VARIANT, "reshape_and_cache", {
            "key": Arg(key),
            "value": Arg(value),
            "key_cache": Arg(key_cache, writable=True),
            "value_cache": Arg(value_cache, writable=True),
            "slot_mapping": Arg(slot_mapping),
        }, {
            "dtype": _CODE[_DTYPE[key.dtype]],
            "num_tokens": slot_mapping.shape[0],  # the real tokens; key may be padded
            "num_kv_heads": key.shape[1],
            "head_size": key.shape[2],
            "block_size": key_cache.shape[3],
            "num_blocks": key_cache.shape[0],
            "key_stride": key.stride(0),
            "value_stride": value.stride(0),
            "kv_cache_dtype": KV_CACHE_DTYPE_CODES[kv],
            "k_scale": float(k_scale),
            "v_scale": float(v_scale),
        })

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        if not key_caches or block_mapping.shape[0] == 0:
            return
        buffers = {"block_mapping": Arg(block_mapping.contiguous())}
        for i, (k, v) in enumerate(zip(key_caches, value_caches)):
            buffers[f"key_cache_{i}"] = Arg(k, writable=True)
            buffers[f"value_cache_{i}"] = Arg(v, writable=True)
        first = key_caches[0]
        self._run(self._CACHE_VARIANT, "copy_blocks", buffers, {
            "num_layers": len(key_caches),
            "num_pairs": block_mapping.shape[0],
            "bytes_per_block": first.stride(0) * first.element_size(),
        })

    def swap_blocks(self, src, dst, block_mapping) -> None:
        self._run(self._CACHE_VARIANT, "swap_blocks", {
            "src": Arg(src),
            "dst": Arg(dst, writable=True),
            "block_mapping": Arg(block_mapping.contiguous()),
        }, {
            "num_pairs": block_mapping.shape[0],
            "bytes_per_block": src.stride(0) * src.element_size(),
            "kind": 4,  # cudaMemcpyDefault: in the emulation every buffer is host memory
        })
