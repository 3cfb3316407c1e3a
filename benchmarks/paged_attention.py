"""Benchmark decode attention over the paged KV cache: µs, achieved GB/s, % of copy bandwidth.

Kernels: mini_vllm's CUDA naive (lab 02-06's task 0, contexts up to about 12K tokens), v1, v2
and GQA-aware kernels (``mini_vllm/csrc``), PyTorch's scaled_dot_product_attention over K/V
gathered into contiguous tensors (the gather is timed: it is what a framework without a paged
kernel pays), FlexAttention over the same physical pool
through PyTorch's paged-attention helper, one cache block per KV tile (when this PyTorch has
them), and any extra kernels a caller passes (the lab's bench.py adds the student's).

Method: every kernel's output is first checked against mini_vllm.attention's PyTorch v1 (a kernel
that is wrong is reported, not timed). Then each kernel is captured in a CUDA graph, so that one
replay launches all of its work and no Python or launch overhead sits between the events (a kernel
that cannot be captured is timed as it is called, and its record says "eager" under "timing"); it is
warmed up and timed with CUDA events, with the L2 cache flushed (a write over a buffer twice its
size, queued before the start event) before every run; the median is reported, and the output is
checked again after the timed runs. The physical block pool is at least four times the L2 size and
every sequence's block table is a random draw of distinct blocks, so K/V come from HBM as in
serving. Bandwidth counts the bytes a decode step must read at least once (each KV head's K and V of
every context token, the queries) plus the output; ``pct_of_read_bandwidth`` compares it with the
read-only bandwidth measured at the start (a sum over a buffer of 8 x L2: a decode kernel reads and
hardly writes, so this is its ceiling), ``pct_of_copy_bandwidth`` with the device-to-device copy
bandwidth (read + write bytes of a large copy). A shape or kernel that runs out of GPU memory is
reported as "skipped: out of memory" and the sweep goes on.

FP8 cache rows (``--kv-cache-dtype fp8``, or ``both`` for each shape twice): the caches hold
e4m3 bytes with one scale per cache (x = 16), the mini_vllm kernels read them directly, and
the bytes counted are one per K/V element, half of fp16's. The PyTorch baselines have no fp8
read: the gathered-SDPA baseline dequantizes what it gathers (timed), FlexAttention reads a
dequantized copy made before timing, so their rows measure a model-dtype read.

    python benchmarks/paged_attention.py                      # upstream's default shape
    python benchmarks/paged_attention.py --kv-cache-dtype both   # fp16 and fp8 cache rows
    python benchmarks/paged_attention.py --sweep --json out.json   # + out.roofline.png
    python benchmarks/paged_attention.py --roofline out.json       # redraw it, no GPU needed

Without a CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PARTITION_SIZE = 512
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    num_seqs: int = 8  # upstream's benchmark defaults: 8 x 4096 tokens, 64 q / 8 kv heads,
    context_len: int = 4096  # head size 128, block 16, fp16
    num_heads: int = 64
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "fp16"
    kv_cache_dtype: str = "auto"  # "fp8": an e4m3 cache read with k_scale / v_scale


def useful_bytes(s: Shape) -> int:
    """Bytes a decode step must move at least once: K and V of every context token of every KV
    head (one byte per element for an fp8 cache), the queries, the output."""
    elem = torch.empty((), dtype=DTYPES[s.dtype]).element_size()
    kv_elem = 1 if s.kv_cache_dtype == "fp8" else elem
    kv = 2 * s.num_seqs * s.context_len * s.num_kv_heads * s.head_size * kv_elem
    return kv + 2 * s.num_seqs * s.num_heads * s.head_size * elem


def useful_flops(s: Shape) -> int:
    """Floating-point operations of a decode step: q . k and p * v for every query head and
    context token, a multiply and an add per element of each (the softmax is negligible)."""
    return 2 * 2 * s.num_seqs * s.num_heads * s.context_len * s.head_size


def sweep_shapes(base: Shape) -> list[Shape]:
    """The default shape, then batch 1..256 at its context, then context 128..32K at its batch."""
    shapes = [base]
    for b in (1, 2, 4, 16, 32, 64, 128, 256):
        shapes.append(Shape(**{**asdict(base), "num_seqs": b}))
    for c in (128, 256, 512, 1024, 2048, 8192, 16384, 32768):
        shapes.append(Shape(**{**asdict(base), "context_len": c}))
    return shapes


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------


class Batch:
    """One decode batch in the paged layout, with every buffer the kernels write."""

    def __init__(self, shape: Shape, device: str, l2_bytes: int, seed: int = 0):
        self.shape = s = shape
        dtype = DTYPES[s.dtype]
        gen = torch.Generator(device=device).manual_seed(seed)
        elem = torch.empty((), dtype=dtype).element_size()
        self.fp8 = s.kv_cache_dtype == "fp8"
        kv_elem = 1 if self.fp8 else elem
        x = 16 // kv_elem
        blocks_per_seq = -(-s.context_len // s.block_size)
        needed = s.num_seqs * blocks_per_seq
        block_bytes = 2 * s.num_kv_heads * s.head_size * s.block_size * kv_elem  # K and V
        pool = max(needed, -(-4 * l2_bytes // block_bytes))
        self.num_blocks = pool
        keys = torch.randn(pool, s.num_kv_heads, s.head_size // x, s.block_size, x,
                           generator=gen, device=device)
        values = torch.randn(pool, s.num_kv_heads, s.head_size, s.block_size, generator=gen,
                             device=device)
        if self.fp8:
            # One scale per cache from its largest magnitude, as a calibration pass would.
            self.k_scale = float(keys.abs().amax()) / 448.0
            self.v_scale = float(values.abs().amax()) / 448.0
            self.key_cache = (keys / self.k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            self.value_cache = (values / self.v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            self.kv_args: tuple = ("fp8", self.k_scale, self.v_scale)
        else:
            self.key_cache, self.value_cache = keys.to(dtype), values.to(dtype)
            self.kv_args = ()
        del keys, values
        perm = torch.randperm(pool, generator=gen, device=device)[:needed]
        self.block_tables = perm.view(s.num_seqs, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((s.num_seqs,), s.context_len, dtype=torch.int32, device=device)
        self.query = torch.randn(s.num_seqs, s.num_heads, s.head_size, generator=gen,
                                 device=device).to(dtype)
        self.scale = s.head_size**-0.5
        self.out = torch.empty_like(self.query)
        parts = -(-s.context_len // PARTITION_SIZE)
        self.exp_sums = torch.empty(s.num_seqs, s.num_heads, parts, device=device)
        self.max_logits = torch.empty_like(self.exp_sums)
        self.tmp_out = torch.empty(s.num_seqs, s.num_heads, parts, s.head_size, dtype=dtype,
                                   device=device)
        self.elem = elem
        self.kv_elem = kv_elem

    def useful_bytes(self) -> int:
        return useful_bytes(self.shape)

    def v1_args(self) -> tuple:
        """v1's arguments; an fp8 cache adds ("fp8", k_scale, v_scale)."""
        return (self.out, self.query, self.key_cache, self.value_cache, self.shape.num_kv_heads,
                self.scale, self.block_tables, self.seq_lens, self.shape.block_size,
                self.shape.context_len, None, *self.kv_args)

    def naive_args(self) -> tuple:
        """The naive kernel's: v1's for a cache in the model's dtype (it reads no fp8 cache)."""
        if self.fp8:
            raise NotImplementedError("the naive kernel reads a cache in the model's dtype only")
        return self.v1_args()[:11]

    def v2_args(self) -> tuple:
        return (self.out, self.exp_sums, self.max_logits, self.tmp_out, *self.v1_args()[1:])

    def gqa_args(self) -> tuple:
        """The GQA-aware kernel's: v2's, then partition_size (0: 512 tokens), then the cache's."""
        v2 = self.v2_args()
        return (*v2[: len(v2) - len(self.kv_args)], 0, *self.kv_args)

    def dequantized(self, t: torch.Tensor, scale: float) -> torch.Tensor:
        """A cache tensor in the model's dtype (an fp8 one times its scale)."""
        return (t.float() * scale).to(self.query.dtype) if self.fp8 else t


# ------------------------------------------------------------------------------------------
# Kernels: each is make(batch) -> a zero-argument callable that writes batch.out
# ------------------------------------------------------------------------------------------

KernelFactory = Callable[[Batch], Callable[[], None]]


def bound_call(fn: Callable, args: tuple) -> Callable[[], None]:
    """fn(*args) as a timed thunk; `args` is computed when the kernel is set up, so that a batch
    the kernel cannot take (naive_args() on an fp8 cache) reports "not implemented" there."""
    return lambda: fn(*args)


def mini_vllm_kernels() -> dict[str, KernelFactory]:
    """The raw extension functions (no Python input checks inside the timed region)."""
    from mini_vllm.csrc import load_ops

    ops = load_ops(backend="cuda")  # timings are of the GPU kernels, whatever the default
    return {
        "mini_vllm_naive": lambda b: bound_call(ops.paged_attention_naive, b.naive_args()),
        "mini_vllm_v1": lambda b: (lambda: ops.paged_attention_v1(*b.v1_args())),
        "mini_vllm_v2": lambda b: (lambda: ops.paged_attention_v2(*b.v2_args())),
        "mini_vllm_gqa": lambda b: (lambda: ops.paged_attention_gqa(*b.gqa_args())),
    }


GQA_PARTITION_CHOICES = ("64", "128", "256", "512", "auto")


def gqa_partitioned(gqa_op: Callable, size: str, num_sms: int) -> KernelFactory:
    """The GQA-aware kernel (the raw op, no Python checks) with `size`-token partitions, or
    "auto": the size ``ops.gqa_partition_size`` picks for the shape on `num_sms` SMs (what the
    engine runs). Its partition buffers are its own, as wide as that size needs; the plain
    ``mini_vllm_gqa`` row always uses 512, the width of v2's buffers."""
    from mini_vllm.csrc.ops import gqa_num_partitions, gqa_partition_size

    def make(b: Batch) -> Callable[[], None]:
        s = b.shape
        tokens = (gqa_partition_size(s.num_seqs, s.num_heads, s.num_kv_heads, s.context_len,
                                     num_sms) if size == "auto" else int(size))
        parts = gqa_num_partitions(s.context_len, tokens)
        exp_sums = torch.empty(s.num_seqs, s.num_heads, parts, device=b.out.device)
        tmp_out = torch.empty(s.num_seqs, s.num_heads, parts, s.head_size, dtype=b.out.dtype,
                              device=b.out.device)
        v2 = b.v2_args()
        head = (b.out, exp_sums, torch.empty_like(exp_sums), tmp_out,
                *v2[4: len(v2) - len(b.kv_args)])
        args = (*head, tokens, *b.kv_args)
        return lambda: gqa_op(*args)

    return make


def gathered_kv(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every sequence as contiguous [num_seqs, num_kv_heads, context, head_size]."""
    s = b.shape
    n = s.num_seqs
    # [seqs, blk, kvh, D/x, B, x] -> [seqs, kvh, blk, B, D/x, x]
    k = b.key_cache[b.block_tables.long()].permute(0, 2, 1, 4, 3, 5)
    k = k.reshape(n, s.num_kv_heads, -1, s.head_size)[:, :, : s.context_len]
    # [seqs, blk, kvh, D, B] -> [seqs, kvh, blk, B, D]
    v = b.value_cache[b.block_tables.long()].permute(0, 2, 1, 4, 3)
    v = v.reshape(n, s.num_kv_heads, -1, s.head_size)[:, :, : s.context_len]
    if b.fp8:
        return b.dequantized(k, b.k_scale), b.dequantized(v, b.v_scale)
    return k, v


def sdpa_gathered(b: Batch) -> Callable[[], None]:
    import torch.nn.functional as F

    def run() -> None:
        k, v = gathered_kv(b)  # every sequence has context_len tokens: no mask needed
        q = b.query.unsqueeze(2)  # [seqs, heads, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=b.scale, enable_gqa=True)
        b.out.copy_(o.squeeze(2))

    return run


def flex_paged(b: Batch) -> Callable[[], None]:
    """FlexAttention reading the physical pool through PyTorch's own paged-attention helper
    (``torch.nn.attention.experimental._paged_attention.PagedAttention``): the pool in
    FlexAttention's layout ``[1, kv_heads, blocks * B, D]``, a page table equal to the block
    tables, and a block mask whose KV tile is one cache block (``page_size = block_size``). Each
    sequence is its own batch row with its one query token, so it reads exactly its own blocks,
    as the paged kernels do (a 128-token tile over randomly placed 16-token blocks would read,
    and compute, tiles made mostly of other sequences' blocks)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = b.shape
    dev = b.query.device
    pool_tokens = b.num_blocks * s.block_size
    # Layout conversion (not timed): FlexAttention reads [batch, kv_heads, tokens, head_size].
    k = b.key_cache.permute(1, 0, 3, 2, 4).reshape(1, s.num_kv_heads, pool_tokens, s.head_size)
    v = b.value_cache.permute(1, 0, 3, 2).reshape(1, s.num_kv_heads, pool_tokens, s.head_size)
    k, v = k.contiguous(), v.contiguous()
    if b.fp8:  # FlexAttention has no fp8 read: it gets a dequantized copy
        k, v = b.dequantized(k, b.k_scale), b.dequantized(v, b.v_scale)
    tables = b.block_tables.long()
    cols = tables.shape[1]
    paged = PagedAttention(b.num_blocks, s.block_size, s.num_seqs, device=str(dev))
    # The helper's own allocator (reserve) would choose other pages: give it the batch's tables.
    paged.page_table[:, :cols] = tables
    paged.physical_to_logical[torch.arange(s.num_seqs, device=dev)[:, None], tables] = (
        torch.arange(cols, device=dev))
    paged.capacity[:] = cols * s.block_size
    seq_lens = b.seq_lens

    def in_context(batch, _head, _q, kv):  # a logical position inside the sequence
        return kv < seq_lens[batch]

    logical = create_block_mask(in_context, s.num_seqs, None, 1, cols * s.block_size,
                                device=str(dev), BLOCK_SIZE=(128, s.block_size))
    mask = paged.convert_logical_block_mask(logical, kv_len=seq_lens)
    # Compiled on a GPU (its Triton decoding kernel); eager elsewhere, which checks the setup.
    attend = torch.compile(flex_attention, dynamic=False) if dev.type == "cuda" else flex_attention
    q = b.query.unsqueeze(2)  # [seqs, heads, 1, D]

    def run() -> None:
        o = attend(q, k, v, block_mask=mask, scale=b.scale, enable_gqa=True)
        b.out.copy_(o.squeeze(2))

    return run


def torch_kernels() -> dict[str, KernelFactory]:
    kernels: dict[str, KernelFactory] = {"torch_sdpa_gathered": sdpa_gathered}
    try:
        import torch.nn.attention.experimental._paged_attention  # noqa: F401
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        pass
    else:
        kernels["torch_flex_paged"] = flex_paged
    return kernels


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------


def expected_output(b: Batch) -> torch.Tensor:
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle

    out = torch.empty_like(b.query)
    oracle(out, *b.v1_args()[1:])
    return out


def capture_graph(fn: Callable[[], None]) -> Callable[[], None] | None:
    """`fn`'s GPU work captured in a CUDA graph: the returned callable replays it with one launch.
    None when it cannot be captured (it synchronizes, copies to the host, or this is no GPU): the
    caller then times `fn` as it is. Warmed up on a side stream first, as capture requires."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - any failure to capture means: time it eagerly
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None
    return graph.replay


def time_gpu(fn: Callable[[], None], flush: torch.Tensor, warmup: int, reps: int) -> float:
    """Median µs of `fn` with CUDA events, L2 flushed before every run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()  # evicts the previous run's K/V from L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def copy_bandwidth_gbps(l2_bytes: int, flush: torch.Tensor, reps: int = 20) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / time of a copy of 8 x L2."""
    n = max(8 * l2_bytes, 256 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = time_gpu(lambda: dst.copy_(src), flush, warmup=3, reps=reps)
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9


def environment() -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                  cwd=REPO_ROOT).stdout.strip()
        except Exception:
            return "unknown"

    props = torch.cuda.get_device_properties(0)
    driver = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "driver": driver.splitlines()[0] if driver else "unknown",
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_revision": run(["git", "rev-parse", "HEAD"]) or "unknown",
        "git_dirty": bool(run(["git", "status", "--porcelain"])),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def read_bandwidth_gbps(l2_bytes: int, flush: torch.Tensor, reps: int = 20,
                        device: str = "cuda", timer=None) -> float:
    """Read-only bandwidth: the bytes of a buffer of 8 x L2 over the time of a sum that reads it
    once. A decode kernel reads K/V and writes almost nothing, so this, not the copy, is its
    ceiling (a copy's writes share the memory bus with its reads)."""
    n = max(8 * l2_bytes, 256 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    us = (timer or time_gpu)(lambda: torch.sum(src, 0, out=total), flush, 3, reps)
    return src.numel() * 4 / (us * 1e-6) / 1e9


def matmul_tflops(dtype: torch.dtype, reps: int = 20) -> float:
    """Measured compute ceiling: TFLOP/s of a large square matmul (fp16: the tensor cores; fp32
    with TF32 off: the CUDA cores' FMA, what v1/v2 compute with)."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        us = time_gpu(lambda: torch.mm(a, b), torch.empty(1, device="cuda"), 3, reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n**3 / (us * 1e-6) / 1e12


SKIPPED_OOM = "skipped: out of memory"


def bench_shape(shape: Shape, kernels: dict[str, KernelFactory], only: set[str] | None,
                l2: int, flush: torch.Tensor, warmup: int, reps: int, roofs: dict[str, float],
                device: str = "cuda", timer=None) -> list[dict]:
    """One record per kernel at `shape`: its time, GB/s and share of each roof in `roofs`
    (name -> GB/s), or why it has none. A shape whose inputs do not fit the device, or a kernel
    that runs out of memory, is reported as skipped and the sweep goes on."""
    from course.labs.numerics import assert_close

    names = [name for name in kernels if not only or name in only]

    def record(name: str) -> dict:
        return {"kernel": name, **asdict(shape), "us": None, "gbps": None, "timing": None,
                **{f"pct_of_{roof}_bandwidth": None for roof in roofs}, "status": "ok"}

    try:
        b = Batch(shape, device, l2)
        expected = expected_output(b)
    except torch.cuda.OutOfMemoryError as exc:
        if device == "cuda":
            torch.cuda.empty_cache()
        why = f"{SKIPPED_OOM} for the inputs ({str(exc).splitlines()[0][:80]})"
        return [{**record(name), "status": why} for name in names]
    records = []
    for name in names:
        rec = record(name)
        try:
            fn = kernels[name](b)
            b.out.fill_(float("nan"))
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            assert_close(b.out, expected, msg=name)
            graphed = capture_graph(fn) if device == "cuda" else None
            rec["timing"] = "cuda graph" if graphed else "eager"
            b.out.fill_(float("nan"))
            us = (timer or time_gpu)(graphed or fn, flush, warmup, reps)
            if device == "cuda":
                torch.cuda.synchronize()
            assert_close(b.out, expected, msg=f"{name} after the timed runs")
            gbps = b.useful_bytes() / (us * 1e-6) / 1e9
            rec.update(us=round(us, 2), gbps=round(gbps, 1))
            rec.update({f"pct_of_{roof}_bandwidth": round(100 * gbps / roof_gbps, 1)
                        for roof, roof_gbps in roofs.items()})
        except NotImplementedError as exc:
            rec["status"] = f"not implemented: {exc}"
        except AssertionError as exc:
            rec["status"] = "WRONG: " + str(exc).splitlines()[0]
        except torch.cuda.OutOfMemoryError as exc:
            rec["status"] = f"{SKIPPED_OOM} ({str(exc).splitlines()[0][:80]})"
        except Exception as exc:  # a baseline this PyTorch cannot run, an unsupported size
            rec["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if device == "cuda" and rec["status"].startswith(SKIPPED_OOM):
            torch.cuda.empty_cache()
        records.append(rec)
    return records


def bench(shapes: list[Shape], kernels: dict[str, KernelFactory], warmup: int, reps: int,
          only: set[str] | None) -> dict:
    env = environment()
    l2 = env["l2_bytes"]
    flush = torch.empty(2 * l2 // 4 + 1, dtype=torch.float32, device="cuda")
    roofs = {"read": read_bandwidth_gbps(l2, flush), "copy": copy_bandwidth_gbps(l2, flush)}
    print(f"{env['device']}  driver {env['driver']}  torch {env['torch']}  "
          f"read bandwidth {roofs['read']:.0f} GB/s  copy bandwidth {roofs['copy']:.0f} GB/s")
    records = []
    header = (f"{'kernel':22} {'seqs':>5} {'ctx':>6} {'q/kv':>7} {'d':>4} {'blk':>4} {'dtype':>5}"
              f" {'kv':>4} {'us':>9} {'GB/s':>7} {'%read':>6} {'%copy':>6}  status")
    print(header)
    print("-" * len(header))
    for shape in shapes:
        for rec in bench_shape(shape, kernels, only, l2, flush, warmup, reps, roofs):
            records.append(rec)
            cells = [f"{rec['us']:9.1f}" if rec["us"] is not None else f"{'-':>9}",
                     f"{rec['gbps']:7.0f}" if rec["gbps"] is not None else f"{'-':>7}"]
            cells += [f"{rec[k]:6.1f}" if rec[k] is not None else f"{'-':>6}"
                      for k in ("pct_of_read_bandwidth", "pct_of_copy_bandwidth")]
            print(f"{rec['kernel']:22} {shape.num_seqs:5} {shape.context_len:6} "
                  f"{f'{shape.num_heads}/{shape.num_kv_heads}':>7} {shape.head_size:4} "
                  f"{shape.block_size:4} {shape.dtype:>5} {shape.kv_cache_dtype:>4} "
                  f"{' '.join(cells)}  {rec['status']}")
        torch.cuda.empty_cache()
    compute = {"fp32": matmul_tflops(torch.float32), "fp16": matmul_tflops(torch.float16)}
    return {**env, "read_bandwidth_gbps": round(roofs["read"], 1),
            "copy_bandwidth_gbps": round(roofs["copy"], 1),
            "matmul_tflops": {k: round(v, 1) for k, v in compute.items()},
            "warmup": warmup, "reps": reps, "records": records}


# ------------------------------------------------------------------------------------------
# The roofline: each kernel's achieved FLOP/s against its arithmetic intensity and the roofs
# ------------------------------------------------------------------------------------------


def roofline_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".roofline.png")


def roofline_points(results: dict) -> list[dict]:
    """One point per measured record: intensity (FLOPs per byte that must be moved) and the
    achieved GFLOP/s, with the kernel and the shape it ran."""
    fields = set(Shape.__dataclass_fields__)
    points = []
    for rec in results["records"]:
        if rec.get("us") is None:
            continue
        shape = Shape(**{k: v for k, v in rec.items() if k in fields})
        points.append({"kernel": rec["kernel"], "shape": shape,
                       "intensity": useful_flops(shape) / useful_bytes(shape),
                       "gflops": useful_flops(shape) / (rec["us"] * 1e-6) / 1e9})
    return points


def draw_roofline(results: dict, path: str | Path) -> Path:
    """The roofline of a results file: the read-bandwidth roof (measured), each measured matmul
    ceiling, and a point per kernel and shape. Decode attention sits far left (2 / element size
    FLOPs per byte for each query head that shares a KV head: one per head in fp16), so the
    bandwidth roof is the one that binds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = roofline_points(results)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [0.1, 1000.0]
    bw = results["read_bandwidth_gbps"]  # GB/s x FLOP/byte = GFLOP/s
    ax.plot(xs, [bw * x for x in xs], "k-", lw=1, label=f"read bandwidth {bw:.0f} GB/s")
    for name, tflops in (results.get("matmul_tflops") or {}).items():
        ax.axhline(tflops * 1000, ls="--", lw=1, label=f"{name} matmul {tflops:.0f} TFLOP/s")
    for kernel in sorted({p["kernel"] for p in points}):
        mine = [p for p in points if p["kernel"] == kernel]
        ax.scatter([p["intensity"] for p in mine], [p["gflops"] for p in mine], s=18,
                   label=kernel)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte a decode step must move)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"Paged decode attention on {results.get('device', '?')}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None,
         extra_kernels: Callable[[], dict[str, KernelFactory]] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--sweep", action="store_true", help="also sweep batch 1-256, context 128-32K")
    p.add_argument("--kernels", nargs="*", help="only these kernels (default: all)")
    p.add_argument("--batch-size", type=int, default=Shape.num_seqs)
    p.add_argument("--context-len", type=int, default=Shape.context_len)
    p.add_argument("--num-heads", type=int, default=Shape.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=Shape.num_kv_heads)
    p.add_argument("--head-size", type=int, default=Shape.head_size)
    p.add_argument("--block-size", type=int, default=Shape.block_size)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=Shape.dtype)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "both"], default="auto",
                   help="the cache: the model's dtype, fp8 (e4m3), or both rows for each shape")
    p.add_argument("--gqa-partitions", nargs="+", default=[], choices=GQA_PARTITION_CHOICES,
                   metavar="SIZE", help="also time the GQA-aware kernel with SIZE-token "
                   "partitions (64, 128, 256, 512) or the size the engine picks (auto), each a "
                   "row mini_vllm_gqa_pSIZE")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--roofline", metavar="JSON",
                   help="only draw the roofline of an existing results file (no GPU needed)")
    args = p.parse_args(argv)

    if args.roofline:
        try:
            results = json.loads(Path(args.roofline).read_text(encoding="utf-8"))
            plot = draw_roofline(results, roofline_path(args.roofline))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"paged_attention benchmark: cannot draw the roofline of {args.roofline} "
                  f"({type(exc).__name__}: {exc}); give a results file this benchmark wrote "
                  "with --json", file=sys.stderr)
            return 2
        print(f"wrote {plot}")
        return 0

    if not torch.cuda.is_available():
        print("paged_attention benchmark: needs a CUDA GPU (torch.cuda.is_available() is False)."
              " Run it on a machine with an NVIDIA GPU; nothing was measured.", file=sys.stderr)
        return 2
    base = Shape(args.batch_size, args.context_len, args.num_heads, args.num_kv_heads,
                 args.head_size, args.block_size, args.dtype)
    shapes = sweep_shapes(base) if args.sweep else [base]
    kv_dtypes = ["auto", "fp8"] if args.kv_cache_dtype == "both" else [args.kv_cache_dtype]
    shapes = [Shape(**{**asdict(sh), "kv_cache_dtype": kv}) for sh in shapes for kv in kv_dtypes]
    kernels: dict[str, KernelFactory] = {}
    if extra_kernels is not None:
        kernels.update(extra_kernels())
    kernels.update(mini_vllm_kernels())
    if args.gqa_partitions:
        from mini_vllm.csrc import load_ops

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        gqa_op = load_ops(backend="cuda").paged_attention_gqa
        for size in args.gqa_partitions:
            kernels[f"mini_vllm_gqa_p{size}"] = gqa_partitioned(gqa_op, size, sms)
    kernels.update(torch_kernels())
    results = bench(shapes, kernels, args.warmup, args.reps, set(args.kernels or ()))
    if args.json:
        given = sys.argv[1:] if argv is None else argv
        command = ["python", "benchmarks/paged_attention.py", *given]
        results = {"command": shlex.join(command), **results}
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        plot = draw_roofline(results, roofline_path(args.json))
        print(f"wrote {args.json} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
