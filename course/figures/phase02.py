"""Phase 02's pictures: block tables and the free queue, a prefix hit, fork and copy-on-write,
fragmentation bars, the key cache's x-split layout, and v2's partitions with their merge.

Everything is drawn from the course's real classes, looked up when a function is called
(``kv_cache_manager.KVCacheManager``), so a notebook's ``YOURS`` switch draws the student's pieces.
Labs whose code is not part of mini_vllm (02-02's simulator, 02-05's sharing manager) come from
``pieces.module(lab_id)`` when a notebook passes its pieces, else from the lab's solution.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course.figures import lab_module
from mini_vllm import request
from mini_vllm.attention import cache_ops, paged_attn
from mini_vllm.core import kv_cache_manager, kv_cache_utils
from mini_vllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
PALETTE = plt.get_cmap("tab10").colors


def make_request(rid: str, tokens: list[int], block_size: int = BLOCK_SIZE):
    """A request whose full blocks are hashed as they fill (prefix caching)."""
    hasher = kv_cache_utils.get_request_block_hasher(block_size, kv_cache_utils.sha256)
    return request.Request(rid, tokens, SamplingParams(), eos_token_id=None, block_hasher=hasher)


def run_prefill(mgr, req) -> None:
    """What the scheduler and the runner do for a new request: look up the prefix cache,
    allocate the rest, compute."""
    hit, num_hit = mgr.get_computed_blocks(req)
    if mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is None:
        raise RuntimeError(f"request {req.request_id} does not fit in the pool")
    req.num_computed_tokens = req.num_tokens


def draw_blocks(mgr, requests: dict, title: str, mark=(), colours: dict | None = None) -> Figure:
    """The pool on top, one cell per physical block: its id above, ``ref_cnt`` inside, the colour
    of each request holding it (split when shared), a dot when cached (its hash is in the
    prefix-cache index), and under a free block its place in the free queue (1 = handed out
    next). Below, each request's block table: column ``i`` is logical block ``i``, labelled with
    its physical block and shaded by how many of its slots hold computed tokens. ``mark``:
    physical blocks to outline."""
    colours = {} if colours is None else colours

    def colour(rid: str):
        return colours.setdefault(rid, PALETTE[len(colours) % len(PALETTE)])

    pool = mgr.block_pool
    block_size = mgr.block_size
    n = pool.num_gpu_blocks
    tables = {rid: [b.block_id for b in blocks] for rid, blocks in mgr.req_to_blocks.items()}
    holders = {b: [rid for rid in sorted(tables) if b in tables[rid]] for b in range(n)}
    queue_pos = {b.block_id: i + 1
                 for i, b in enumerate(pool.free_block_queue.get_all_free_blocks())}
    rows = max(1, len(tables))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(0.55 * n + 1.5, 1.6 + 0.45 * rows),
        gridspec_kw={"height_ratios": [1.4, 0.45 * rows + 0.2]},
    )
    for rid in sorted(tables):
        colour(rid)
    for b in range(n):
        block = pool.blocks[b]
        who = holders[b]
        if block.is_null:
            top.add_patch(Rectangle((b, 0), 1, 1, color="0.3"))
        elif not who:
            top.add_patch(Rectangle((b, 0), 1, 1, fill=False, ec="0.6"))
        else:
            for k, rid in enumerate(who):  # a shared block is split between its holders
                h = 1 / len(who)
                top.add_patch(Rectangle((b, k * h), 1, h, color=colour(rid), alpha=0.8))
        top.add_patch(Rectangle((b, 0), 1, 1, fill=False, ec="black",
                                lw=2.5 if b in mark else 0.5))
        top.text(b + 0.5, 1.15, str(b), ha="center", fontsize=8)
        if not block.is_null:
            top.text(b + 0.5, 0.5, str(block.ref_cnt), ha="center", va="center", fontsize=9)
        if block.block_hash is not None:
            top.plot(b + 0.85, 0.85, "k.", ms=5)
        if b in queue_pos:
            top.text(b + 0.5, -0.35, str(queue_pos[b]), ha="center", fontsize=8,
                     color="tab:red")
    top.text(-0.2, -0.35, "free queue", ha="right", fontsize=8, color="tab:red")
    top.text(-0.2, 0.5, "ref_cnt", ha="right", va="center", fontsize=8)
    top.set_xlim(-2.5, n + 0.2)
    top.set_ylim(-0.6, 1.4)
    top.axis("off")
    top.set_title(title, fontsize=10)
    for row, (rid, ids) in enumerate(sorted(tables.items())):
        y = rows - 1 - row
        filled = requests[rid].num_computed_tokens if rid in requests else 0
        bottom.text(-0.2, y + 0.4, rid, ha="right", va="center", fontsize=9)
        for i, b in enumerate(ids):
            used = min(max(filled - i * block_size, 0), block_size) / block_size
            bottom.add_patch(Rectangle((i, y), 0.9, 0.8, fill=False, ec=colour(rid)))
            bottom.add_patch(Rectangle((i, y), 0.9 * used, 0.8, color=colour(rid), alpha=0.5))
            bottom.text(i + 0.45, y + 0.4, str(b), ha="center", va="center", fontsize=8)
    width = max([len(ids) for ids in tables.values()] + [1])
    bottom.set_xlim(-2.5, max(width, n) + 0.2)
    bottom.set_ylim(-0.2, rows)
    bottom.axis("off")
    return fig


@dataclass
class BlockStory:
    """Requests arrive, grow, finish, and a later one hits the prefix cache, on a pool of 14
    blocks of 4 tokens. Each step changes the manager and returns its picture."""

    mgr: object = None
    requests: dict = field(default_factory=dict)
    colours: dict = field(default_factory=dict)
    hit_blocks: list[int] = field(default_factory=list)
    num_hit: int = 0

    def __post_init__(self) -> None:
        if self.mgr is None:
            self.mgr = kv_cache_manager.KVCacheManager(
                num_blocks=14, block_size=BLOCK_SIZE, max_model_len=64
            )

    def draw(self, title: str, mark=()) -> Figure:
        return draw_blocks(self.mgr, self.requests, title, mark, self.colours)

    def prefill(self) -> Figure:
        """Three prompts of 10, 6 and 9 tokens: A, B and C."""
        for rid, tokens in [("A", list(range(10))), ("B", [50, 51, 52, 53, 54, 55]),
                            ("C", [70, 71, 72, 73, 74, 75, 76, 77, 78])]:
            self.requests[rid] = make_request(rid, tokens)
            run_prefill(self.mgr, self.requests[rid])
        return self.draw("three prompts prefilled: 10, 6 and 9 tokens in blocks of 4")

    def decode(self) -> Figure:
        """A decodes 3 tokens and B 2: a new block only when the last one is full."""
        for rid, steps in (("A", 3), ("B", 2)):
            req = self.requests[rid]
            for step in range(steps):
                req.append_output_token_ids(100 + step)
                if self.mgr.allocate_slots(req, 1) is None:
                    raise RuntimeError("the pool is full")
                req.num_computed_tokens += 1
        return self.draw("A decoded 3 tokens (a fourth block), B decoded 2 (its last block "
                         "filled up, no new block)")

    def finish(self) -> Figure:
        """A finishes: its blocks go to the back of the free queue, tail first."""
        self.mgr.free(self.requests.pop("A"))
        return self.draw("A finished: its blocks join the back of the free queue, tail first; "
                         "full ones stay cached")

    def prefix_hit(self) -> Figure:
        """D repeats A's first 8 tokens and finds A's two full blocks in the prefix cache."""
        d = self.requests["D"] = make_request("D", list(range(8)) + [90, 91, 92])
        hit, self.num_hit = self.mgr.get_computed_blocks(d)
        self.hit_blocks = hit.get_block_ids()[0]
        run_prefill(self.mgr, d)
        return self.draw("D reuses A's cached prefix blocks (outlined)", mark=set(self.hit_blocks))


def _story_until(step: str) -> Figure:
    story = BlockStory()
    fig = None
    for name in ("prefill", "decode", "finish", "prefix_hit"):
        if fig is not None:
            plt.close(fig)
        fig = getattr(story, name)()
        if name == step:
            return fig
    raise ValueError(step)


def blocks_prefill() -> Figure:
    return _story_until("prefill")


def blocks_decode() -> Figure:
    return _story_until("decode")


def blocks_free() -> Figure:
    return _story_until("finish")


def prefix_hit() -> Figure:
    return _story_until("prefix_hit")


@dataclass
class ForkStory:
    """C (9 prompt tokens, one sampled) is forked into two more samples on lab 02-05's sharing
    manager; then every sample writes one token (copy-on-write)."""

    pieces: object = None
    requests: dict = field(default_factory=dict)
    colours: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        sharing = lab_module("02-05", self.pieces)
        self.mgr = sharing.KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, max_model_len=64)

    def fork(self) -> Figure:
        prompt = [70, 71, 72, 73, 74, 75, 76, 77, 78]
        parent = self.requests["C"] = make_request("C", prompt)
        run_prefill(self.mgr, parent)
        parent.append_output_token_ids(1)
        for i, token in ((1, 2), (2, 3)):
            child = make_request(f"C{i}", prompt)
            child.append_output_token_ids(token)
            child.num_computed_tokens = parent.num_computed_tokens
            self.mgr.fork(parent, child)
            self.requests[child.request_id] = child
        return draw_blocks(self.mgr, self.requests, "C forked twice: three tables, one copy of "
                           "the KV", colours=self.colours)

    def write(self) -> Figure:
        for rid in ("C1", "C2", "C"):
            self.copies[rid] = self.mgr.append_slots(self.requests[rid], 1)
            self.requests[rid].num_computed_tokens += 1
        return draw_blocks(self.mgr, self.requests, "after one decode step: two copies, the "
                           "shared full blocks stay shared", colours=self.colours)


def fork() -> Figure:
    return ForkStory().fork()


def copy_on_write() -> Figure:
    story = ForkStory()
    plt.close(story.fork())
    return story.write()


def fragmentation_reports(pieces=None, num_requests: int = 200):
    """Lab 02-02's simulator on the first ``num_requests`` of a smaller ``instruct`` trace
    (the full trace takes longer than a picture should)."""
    frag = lab_module("02-02", pieces)
    spec = dataclasses.replace(frag.load_trace_specs()["instruct"], num_requests=num_requests)
    return frag.run_all(frag.generate_trace(spec), 4096, spec.max_model_len)


def fragmentation(pieces=None, reports=None) -> Figure:
    """Lab 02-02's stacked bars: where the committed KV memory goes, per strategy."""
    reports = reports if reports is not None else fragmentation_reports(pieces)
    return lab_module("02-02", pieces).plot_reports(reports)


def key_cache_layout(head_size: int = 32, block_size: int = 4,
                     dtype: torch.dtype = torch.float16) -> Figure:
    """The memory of one block of one KV head, in the key cache's x-split layout and in the value
    cache's layout, as ``reshape_and_cache`` writes it. Each cell is one element (labelled with
    its dimension d, coloured by token). A thick box is one 16-byte vector of a key (what one
    GPU thread loads at once), and one dimension of every token of a value."""
    x = paged_attn.kv_cache_x(dtype)
    num_blocks, block = 2, 1
    key_cache = torch.zeros(num_blocks, 1, head_size // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, 1, head_size, block_size, dtype=dtype)
    # Token t's element d holds 100 * t + d, so the memory says who put what where.
    tokens = torch.arange(block_size)[:, None, None] * 100 + torch.arange(head_size)[None, None]
    slots = torch.arange(block_size) + block * block_size
    cache_ops.reshape_and_cache(tokens.to(dtype), tokens.to(dtype), key_cache, value_cache,
                                slots)
    key_mem = key_cache[block, 0].flatten().long().tolist()  # memory order
    value_mem = value_cache[block, 0].flatten().long().tolist()
    per_row = block_size * x  # one row of the key picture: one chunk of every token

    fig, axes = plt.subplots(2, 1, figsize=(13, 4.6))
    panels = (
        (axes[0], key_mem, f"key_cache[b, h]  [head_size // x = {head_size // x}, "
         f"block_size = {block_size}, x = {x}]: each token's d in x-wide chunks, chunk 0 of every "
         "token first", x),
        (axes[1], value_mem, f"value_cache[b, h]  [head_size = {head_size}, block_size = "
         f"{block_size}]: one row per d, the tokens side by side", block_size),
    )
    for ax, mem, title, vector in panels:
        rows = len(mem) // per_row
        for i, v in enumerate(mem):
            t, d = divmod(v, 100)
            r, c = divmod(i, per_row)
            y = rows - 1 - r
            ax.add_patch(Rectangle((c, y), 1, 1, color=PALETTE[t], alpha=0.55, lw=0))
            ax.text(c + 0.5, y + 0.5, str(d), ha="center", va="center", fontsize=6.5)
        for i in range(0, len(mem), vector):
            r, c = divmod(i, per_row)
            ax.add_patch(Rectangle((c, rows - 1 - r), vector, 1, fill=False, ec="black", lw=1.2))
        ax.set_xlim(0, per_row)
        ax.set_ylim(0, rows)
        ax.set_yticks([rows - 1 - r + 0.5 for r in range(rows)],
                      [f"+{r * per_row}" for r in range(rows)], fontsize=7)
        ax.set_xticks([])
        ax.set_title(title, fontsize=9, loc="left")
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("memory order (left to right, then down; row labels: element offset)")
    handles = [Rectangle((0, 0), 1, 1, color=PALETTE[t], alpha=0.55) for t in range(block_size)]
    fig.legend(handles, [f"token {t}" for t in range(block_size)], loc="upper right",
               ncol=block_size, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


@dataclass
class V2Run:
    """One decode query over a long context in shuffled physical blocks, through v1 and v2."""

    logits: torch.Tensor  # [seq_len] of head 0
    max_logits: torch.Tensor  # [partitions] of head 0
    exp_sums: torch.Tensor
    tmp_out: torch.Tensor  # [partitions, head_size]
    out_v1: torch.Tensor  # [head_size]
    out_v2: torch.Tensor
    partition_size: int

    @property
    def weights(self) -> torch.Tensor:
        """The reduce's weight of each partition, ``l_p * exp(m_p - M)``, normalised."""
        w = self.exp_sums * torch.exp(self.max_logits - self.max_logits.max())
        return w / w.sum()


def v2_run(seq_len: int = 1300, block_size: int = 16, head_size: int = 64,
           seed: int = 0) -> V2Run:
    """Write a context into a paged cache with ``reshape_and_cache`` and attend one query to it
    with paged attention v1 and v2 (lab 02-04)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads = 2
    num_blocks = -(-seq_len // block_size) + 1
    x = paged_attn.kv_cache_x(torch.float32)
    key_cache = torch.zeros(num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head_size, block_size)
    # Shuffled physical blocks (block 0 is left out, like the null block).
    table = torch.randperm(num_blocks - 1, generator=gen)[: -(-seq_len // block_size)] + 1
    pos = torch.arange(seq_len)
    slots = table[pos // block_size] * block_size + pos % block_size
    keys = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    values = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    cache_ops.reshape_and_cache(keys, values, key_cache, value_cache, slots)

    query = torch.randn(1, num_heads, head_size, generator=gen)
    scale = head_size ** -0.5
    parts = paged_attn.num_partitions(seq_len)
    out_v1, out_v2 = torch.empty_like(query), torch.empty_like(query)
    exp_sums = torch.empty(1, num_heads, parts)
    max_logits = torch.empty(1, num_heads, parts)
    tmp_out = torch.empty(1, num_heads, parts, head_size)
    args = (query, key_cache, value_cache, num_kv_heads, scale, table[None].to(torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), block_size, seq_len)
    paged_attn.paged_attention_v1(out_v1, *args)
    paged_attn.paged_attention_v2(out_v2, exp_sums, max_logits, tmp_out, *args)
    head = 0
    return V2Run(
        logits=(query[0, head] @ keys[:, head].T) * scale,
        max_logits=max_logits[0, head], exp_sums=exp_sums[0, head], tmp_out=tmp_out[0, head],
        out_v1=out_v1[0, head], out_v2=out_v2[0, head], partition_size=paged_attn.PARTITION_SIZE,
    )


def v2_partitions(run: V2Run | None = None) -> Figure:
    """The logits cut into partitions with their maxima, the merge weights, and the partial
    outputs with their merge, which equals v1."""
    run = run or v2_run()
    parts, seq_len = len(run.max_logits), len(run.logits)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.2))
    axes[0].plot(run.logits.numpy(), lw=0.6)
    for p in range(parts):
        lo, hi = p * run.partition_size, min((p + 1) * run.partition_size, seq_len)
        axes[0].axvspan(lo, hi, alpha=0.12, color=PALETTE[p])
        axes[0].hlines(float(run.max_logits[p]), lo, hi, color=PALETTE[p], lw=2)
    axes[0].set_title("logits of head 0; partitions and their max m_p", fontsize=9)
    axes[0].set_xlabel("token")
    axes[1].bar(range(parts), run.weights.numpy(), color=PALETTE[:parts])
    axes[1].set_title("merge weights l_p exp(m_p - M), normalised", fontsize=9)
    axes[1].set_xticks(range(parts))
    axes[1].set_xlabel("partition")
    for p in range(parts):
        axes[2].plot(run.tmp_out[p, :16].numpy(), "o-", ms=3, lw=0.8, color=PALETTE[p],
                     label=f"partition {p}")
    axes[2].plot(run.out_v1[:16].numpy(), "k*", ms=8, label="merged = v1")
    axes[2].set_title("partial outputs and their merge (16 dims)", fontsize=9)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig
