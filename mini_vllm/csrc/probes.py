"""Lab 02-06's probes: step 1 (``qk_logits``) or step 2 (``softmax_in_place``) of the decode
kernels run alone (``attention_probes.cuh``), so that the lab's tests check task 1 before tasks
2 and 3 exist, and task 2 before task 3. Test aids, not part of the decode path.

``check_*`` raise ValueError for inputs the probes cannot take, before anything is written, and
return the resolved backend; the lab's starter.py runs the same checks in front of the
student's build, and ``qk_logits_probe`` / ``softmax_probe`` here run the reference's.

upstream: none (vLLM tests its decode kernels whole: tests/kernels/attention/test_attention.py)
"""

from __future__ import annotations

import torch

from mini_vllm import csrc as _csrc
from mini_vllm.csrc.ops import _require_device, check_attention_inputs

PROBE_THREADS = 128  # kProbeThreads: the threads of one probe block (stats has a row per thread)
MAX_PROBE_FLOATS = 12 * 1024  # a probe keeps a range, or a row, in 48 KB of shared memory


def probe_shapes(max_seq_len: int, block_size: int, range_tokens: int) -> tuple[int, int]:
    """(logits row width, number of ranges) of the step-1 probe: every slot of the longest
    sequence's blocks, cut into ranges of ``range_tokens`` (0: one range over all of it, as v1)."""
    width = -(-max_seq_len // block_size) * block_size
    tokens = range_tokens or width
    return width, -(-width // tokens)


def check_qk_logits_probe(logits, range_max, query, key_cache, value_cache, num_kv_heads,
                          block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                          range_tokens, backend=None) -> tuple[str, int]:
    """Check the step-1 probe's inputs; return (backend, the range's tokens)."""
    # The kernels' own checks want an output like the query; the probe writes none.
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    backend = check_attention_inputs(out, query, key_cache, value_cache, num_kv_heads,
                                     block_tables, seq_lens, block_size, max_seq_len,
                                     alibi_slopes, backend=backend)
    if not isinstance(range_tokens, int) or range_tokens < 0 or range_tokens % block_size:
        raise ValueError(f"range_tokens must be 0 (the whole context) or a positive multiple of "
                         f"block_size={block_size}, got {range_tokens!r}")
    width, ranges = probe_shapes(max_seq_len, block_size, range_tokens)
    tokens = range_tokens or width
    if tokens > MAX_PROBE_FLOATS:
        raise ValueError(f"a range of {tokens} tokens does not fit the probe's 48 KB of shared "
                         "memory: use a shorter context or smaller ranges")
    num_seqs, num_heads, _ = query.shape
    for name, t, shape in (("logits", logits, (num_seqs, num_heads, width)),
                           ("range_max", range_max, (num_seqs, num_heads, ranges))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    _require_device({"query": query, "logits": logits, "range_max": range_max}, "query", backend)
    return backend, tokens


def check_softmax_probe(rows, lengths, stats, backend=None) -> str:
    """Check the step-2 probe's inputs; return the backend."""
    if rows.dtype != torch.float32 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous float32 tensor [num_rows, width], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    num_rows, width = rows.shape
    if width > MAX_PROBE_FLOATS:
        raise ValueError(f"rows of {width} floats do not fit the probe's 48 KB of shared memory")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (num_rows,) or (
            not lengths.is_contiguous()):
        raise ValueError(f"lengths must be a contiguous int32 tensor of shape ({num_rows},), "
                         f"got {lengths.dtype} {tuple(lengths.shape)}")
    if num_rows and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise ValueError(f"every length must be in [1, {width}] (the row width)")
    want = (num_rows, PROBE_THREADS, 2)
    if stats.dtype != torch.float32 or tuple(stats.shape) != want or not stats.is_contiguous():
        raise ValueError(f"stats must be a contiguous float32 tensor of shape {want}, got "
                         f"{stats.dtype} {tuple(stats.shape)}")
    return _require_device({"rows": rows, "lengths": lengths, "stats": stats}, "rows", backend)


def qk_logits_probe(logits, range_max, query, key_cache, value_cache, num_kv_heads, scale,
                    block_tables, seq_lens, block_size, max_seq_len, alibi_slopes=None,
                    range_tokens=0, backend=None) -> None:
    """The reference's step 1 alone: writes every slot's logit to ``logits`` (0 past the end of
    a sequence) and each range's max valid logit to ``range_max``."""
    backend, tokens = check_qk_logits_probe(
        logits, range_max, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, range_tokens, backend)
    _csrc.load_ops(backend=backend).qk_logits_probe(
        logits, range_max, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
        seq_lens, block_size, max_seq_len, alibi_slopes, tokens)


def softmax_probe(rows, lengths, stats, backend=None) -> None:
    """The reference's step 2 alone on each row's first ``lengths[r]`` entries, in place;
    ``stats[r, t]`` is the (max, sum) thread t got."""
    backend = check_softmax_probe(rows, lengths, stats, backend)
    _csrc.load_ops(backend=backend).softmax_probe(rows, lengths, stats)
