"""Lab 02-02 reference: a replay simulator that measures where KV-cache memory goes.

Lab-only material (not part of the engine). A trace of requests, each with a prompt length and an
output length, is replayed through one memory strategy at a time, under continuous batching:
requests are admitted first come, first served while memory allows, every running request writes
the KV of one more token per step, and a request leaves when it reaches its final length.

Strategies:

* contiguous reservation, as in the serving systems before vLLM: on admission a request gets one
  contiguous range of KV slots from a first-fit allocator and keeps it until it finishes. The size
  is ``max_model_len`` (``"max"``), the next power of two of its final length (``"pow2"``), or
  exactly its final length (``"oracle"``, which needs to know the future);
* paging (``"paged-8"``, ``"paged-16"``, ``"paged-32"``): blocks of the real
  :class:`~mini_vllm.core.block_pool.BlockPool`, taken one at a time as the request grows; when the
  pool runs dry the most recently admitted request is preempted (its blocks are freed and it is
  recomputed later), as in vLLM.

While requests are waiting (the system is limited by memory) every step's KV memory is split into
*token states* (slots holding the KV of a token that exists), *reserved* (slots held for tokens
the request will still write), *internal fragmentation* (held slots it will never write) and
*external fragmentation* (free slots that the next request cannot use because no free range is
large enough, although there are enough free slots in total).

Run ``python solution.py --plot fragmentation.png`` from the lab folder for the table and bars.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import KVCacheBlock
from mini_vllm.core.sched.reservation import reservation_size

__all__ = [
    "TRACES_PATH",
    "STRATEGIES",
    "ContiguousAllocator",
    "FragmentationReport",
    "LengthDist",
    "PagedKV",
    "ReservedKV",
    "SimRequest",
    "TraceSpec",
    "format_table",
    "generate_trace",
    "load_trace_specs",
    "main",
    "make_backend",
    "plot_reports",
    "replay",
    "reservation_size",
    "run_all",
    "slot_breakdown",
]

TRACES_PATH = Path(__file__).resolve().parent / "traces.json"
STRATEGIES = ("max", "pow2", "oracle", "paged-8", "paged-16", "paged-32")


# ------------------------------------------------------------------------------ traces (given)


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length: ``round(exp(N(log(median), sigma)))`` clipped to ``[min, max]``."""

    median: float
    sigma: float
    min: int
    max: int

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return max(self.min, min(self.max, value))


@dataclass(frozen=True)
class TraceSpec:
    """A named, seeded trace: how many requests, their length distributions, and the KV memory
    (``budget``, in token slots) it is replayed in."""

    name: str
    description: str
    num_requests: int
    seed: int
    budget: int
    prompt: LengthDist
    output: LengthDist
    max_model_len: int


def load_trace_specs(path: Path = TRACES_PATH) -> dict[str, TraceSpec]:
    """The traces shipped with the lab (``traces.json``), by name."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {
        name: TraceSpec(
            name=name,
            description=t["description"],
            num_requests=t["num_requests"],
            seed=t["seed"],
            budget=t["budget"],
            prompt=LengthDist(**t["prompt"]),
            output=LengthDist(**t["output"]),
            max_model_len=data["max_model_len"],
        )
        for name, t in data["traces"].items()
    }


def generate_trace(spec: TraceSpec) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` per request; the same spec always gives the same trace.

    A request longer than ``max_model_len`` keeps its prompt and has its output cut to fit.
    """
    rng = random.Random(spec.seed)
    trace = []
    for _ in range(spec.num_requests):
        prompt = spec.prompt.sample(rng)
        output = spec.output.sample(rng)
        trace.append((prompt, max(1, min(output, spec.max_model_len - prompt))))
    return trace


# ------------------------------------------------------------------------------ task 1


# reservation_size is imported from mini_vllm.core.sched.reservation above: the policies live once,
# there, because the engine reserves with them too (lab 03-06).


# ------------------------------------------------------------------------------ task 2


class ContiguousAllocator:
    """First-fit allocator of contiguous ranges in ``[0, capacity)``.

    Invariants: ``holes`` is a sorted list of disjoint, non-adjacent ``(start, size)`` free
    ranges (adjacent holes are always merged); ``allocated`` maps each range's start to its size;
    free plus allocated slots equal ``capacity``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.holes: list[tuple[int, int]] = [(0, capacity)]
        self.allocated: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        """Start of a new range of ``size`` slots in the lowest hole that fits, or ``None``."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                if hole == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + size, hole - size)
                self.allocated[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        """Return the range that starts at ``start`` and merge it with free neighbours."""
        if start not in self.allocated:
            raise ValueError(f"no allocated range starts at {start}")
        size = self.allocated.pop(start)
        i = bisect.bisect_left(self.holes, (start, 0))
        # Merge with the hole right after, then with the hole right before.
        if i < len(self.holes) and self.holes[i][0] == start + size:
            size += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:
            prev_start, prev_size = self.holes[i - 1]
            self.holes[i - 1] = (prev_start, prev_size + size)
        else:
            self.holes.insert(i, (start, size))

    def free_slots(self) -> int:
        """Free slots in all holes together."""
        return sum(size for _, size in self.holes)

    def largest_hole(self) -> int:
        """The largest request that ``allocate`` can serve right now."""
        return max((size for _, size in self.holes), default=0)


# ------------------------------------------------------------------------------ task 3


def slot_breakdown(allocated: int, num_tokens: int, final_len: int) -> tuple[int, int, int]:
    """Split a request's ``allocated`` slots into ``(token_states, reserved, internal)``.

    The request holds ``num_tokens`` tokens now and will end with ``final_len``: token states
    are the slots of existing tokens, reserved the allocated slots it will still fill, internal
    fragmentation the allocated slots it never fills. ``ValueError`` unless
    ``0 <= num_tokens <= min(allocated, final_len)``.
    """
    if not 0 <= num_tokens <= min(allocated, final_len):
        raise ValueError(
            f"need 0 <= num_tokens ({num_tokens}) <= allocated ({allocated}) and final_len "
            f"({final_len})"
        )
    used_eventually = min(allocated, final_len)
    return num_tokens, used_eventually - num_tokens, allocated - used_eventually


# ------------------------------------------------------------------------------ backends


@dataclass(eq=False)
class SimRequest:
    """One request in the replay: its lengths and how many tokens it holds now."""

    rid: int
    prompt_len: int
    output_len: int
    num_tokens: int = 0
    num_preemptions: int = 0

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


class Backend(Protocol):
    def admit(self, req: SimRequest) -> bool: ...
    def grow(self, req: SimRequest, running: list[SimRequest]) -> list[SimRequest]: ...
    def release(self, req: SimRequest) -> None: ...
    def allocated(self, req: SimRequest) -> int: ...
    def free_slots(self) -> int: ...


class ReservedKV:
    """Contiguous reservation: one range per request for its whole life (given)."""

    def __init__(self, policy: str, budget: int, max_model_len: int) -> None:
        self.policy = policy
        self.max_model_len = max_model_len
        self.allocator = ContiguousAllocator(budget)
        self.ranges: dict[int, tuple[int, int]] = {}  # rid -> (start, size)

    def slots_needed(self, req: SimRequest) -> int:
        return reservation_size(self.policy, req.prompt_len, req.output_len, self.max_model_len)

    def admit(self, req: SimRequest) -> bool:
        size = self.slots_needed(req)
        start = self.allocator.allocate(size)
        if start is None:
            return False
        self.ranges[req.rid] = (start, size)
        return True

    def grow(self, req: SimRequest, running: list[SimRequest]) -> list[SimRequest]:
        # The reservation already holds the final length: growing never needs memory.
        return []

    def release(self, req: SimRequest) -> None:
        start, _ = self.ranges.pop(req.rid)
        self.allocator.free(start)

    def allocated(self, req: SimRequest) -> int:
        return self.ranges[req.rid][1]

    def free_slots(self) -> int:
        return self.allocator.free_slots()


# ------------------------------------------------------------------------------ task 4


class PagedKV:
    """Paging with the real ``BlockPool`` (no prefix caching): blocks on demand.

    Invariant: a running request with ``n`` tokens holds exactly ``cdiv(n, block_size)`` blocks,
    taken with ``get_new_blocks`` and returned with ``free_blocks`` (last block first).
    """

    def __init__(self, block_size: int, budget: int) -> None:
        if block_size < 1 or budget < block_size:
            raise ValueError(f"need 1 <= block_size ({block_size}) <= budget ({budget})")
        self.block_size = block_size
        # One extra block: block 0 is the pool's null block and never holds KV.
        self.pool = BlockPool(budget // block_size + 1, enable_caching=False)
        self.tables: dict[int, list[KVCacheBlock]] = {}

    def admit(self, req: SimRequest) -> bool:
        """Take the blocks for the request's current tokens, or return ``False``."""
        num_blocks = -(-req.num_tokens // self.block_size)
        if num_blocks > self.pool.get_num_free_blocks():
            return False
        self.tables[req.rid] = self.pool.get_new_blocks(num_blocks)
        return True

    def grow(self, req: SimRequest, running: list[SimRequest]) -> list[SimRequest]:
        """Make room for the request's next token; return the requests preempted to do so.

        A new block is needed only when the last one is full. If the pool is empty, preempt the
        most recently admitted running request (the end of ``running``; possibly ``req``
        itself), release its blocks and remove it from ``running``, until a block is free or
        ``req`` itself was preempted.
        """
        preempted: list[SimRequest] = []
        if req.num_tokens % self.block_size != 0:
            return preempted
        while self.pool.get_num_free_blocks() == 0:
            victim = running.pop()
            self.release(victim)
            victim.num_preemptions += 1
            preempted.append(victim)
            if victim is req:
                return preempted
        self.tables[req.rid].extend(self.pool.get_new_blocks(1))
        return preempted

    def release(self, req: SimRequest) -> None:
        """Free the request's blocks, last block first."""
        self.pool.free_blocks(reversed(self.tables.pop(req.rid)))

    def allocated(self, req: SimRequest) -> int:
        """KV slots the request holds: its blocks times the block size."""
        return len(self.tables[req.rid]) * self.block_size

    def free_slots(self) -> int:
        """KV slots in the pool's free blocks."""
        return self.pool.get_num_free_blocks() * self.block_size


def make_backend(strategy: str, budget: int, max_model_len: int) -> ReservedKV | PagedKV:
    """The memory backend for a strategy name of ``STRATEGIES``."""
    if strategy.startswith("paged-"):
        return PagedKV(int(strategy.removeprefix("paged-")), budget)
    if strategy in ("max", "pow2", "oracle"):
        return ReservedKV(strategy, budget, max_model_len)
    raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


# ------------------------------------------------------------------------------ replay (given)


@dataclass(frozen=True)
class FragmentationReport:
    """Where the committed KV memory went while requests were waiting, for one strategy.

    ``token_states + reserved + internal + external == 1`` (fractions of the committed memory:
    allocated slots plus external fragmentation, summed over the memory-bound steps).
    """

    strategy: str
    token_states: float
    reserved: float
    internal: float
    external: float
    mean_batch: float
    max_batch: int
    steps: int
    num_preemptions: int

    @property
    def waste(self) -> float:
        return 1.0 - self.token_states


def replay(
    trace: Sequence[tuple[int, int]], strategy: str, budget: int, max_model_len: int
) -> FragmentationReport:
    """Replay ``trace`` (all requests waiting at step 0) through one strategy.

    Each step: admit waiting requests in order while the head fits; if some are still waiting,
    record the memory split; then every running request writes one token and those that reach
    their final length leave.
    """
    backend = make_backend(strategy, budget, max_model_len)
    waiting = deque(SimRequest(i, p, o, num_tokens=p) for i, (p, o) in enumerate(trace))
    running: list[SimRequest] = []
    totals = [0, 0, 0, 0]  # token states, reserved, internal, external
    bound_steps = batch_sum = max_batch = steps = preemptions = 0
    while waiting or running:
        while waiting and backend.admit(waiting[0]):
            running.append(waiting.popleft())
        if not running:
            head = waiting[0]
            raise ValueError(f"request {head.rid} ({head.final_len} tokens) can never fit")
        max_batch = max(max_batch, len(running))
        if waiting:  # memory-bound step: this is where the strategies differ
            bound_steps += 1
            batch_sum += len(running)
            for req in running:
                split = slot_breakdown(backend.allocated(req), req.num_tokens, req.final_len)
                for k in range(3):
                    totals[k] += split[k]
            # Free slots while a request waits are slots the allocator could not hand out:
            # holes too small for the next reservation, or too few free blocks for its prompt.
            totals[3] += backend.free_slots()
        steps += 1
        # Make room for every running request's next token, oldest first. Preemption takes
        # requests from the end of `running`, so the ones already handled are never victims.
        i = 0
        while i < len(running):
            req = running[i]
            victims = backend.grow(req, running)
            for victim in victims:
                waiting.appendleft(victim)
            preemptions += len(victims)
            if victims and victims[-1] is req:
                break  # req and everything after it went back to the queue
            i += 1
        # Every running request writes one token; finished ones leave.
        still_running = []
        for req in running:
            req.num_tokens += 1
            if req.num_tokens == req.final_len:
                backend.release(req)
            else:
                still_running.append(req)
        running = still_running
    committed = sum(totals) or 1
    return FragmentationReport(
        strategy=strategy,
        token_states=totals[0] / committed,
        reserved=totals[1] / committed,
        internal=totals[2] / committed,
        external=totals[3] / committed,
        mean_batch=batch_sum / bound_steps if bound_steps else 0.0,
        max_batch=max_batch,
        steps=steps,
        num_preemptions=preemptions,
    )


def run_all(
    trace: Sequence[tuple[int, int]],
    budget: int,
    max_model_len: int,
    strategies: Sequence[str] = STRATEGIES,
) -> list[FragmentationReport]:
    """One report per strategy, in the order given."""
    return [replay(trace, s, budget, max_model_len) for s in strategies]


def format_table(reports: Sequence[FragmentationReport]) -> str:
    """A plain-text table: percentages of committed KV memory, and batch sizes."""
    head = (
        f"{'strategy':<10} {'token states':>12} {'reserved':>9} {'internal':>9} "
        f"{'external':>9} {'mean batch':>10} {'max batch':>9} {'preempt':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(
            f"{r.strategy:<10} {r.token_states:>12.1%} {r.reserved:>9.1%} {r.internal:>9.1%} "
            f"{r.external:>9.1%} {r.mean_batch:>10.1f} {r.max_batch:>9d} {r.num_preemptions:>7d}"
        )
    return "\n".join(lines)


def plot_reports(reports: Sequence[FragmentationReport], path: str | Path | None = None) -> Any:
    """Stacked bars per strategy (token states, reserved, internal, external); returns the
    matplotlib figure, and also writes it to ``path`` when one is given."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r.strategy for r in reports]
    bottom = [0.0] * len(reports)
    parts = (
        ("token states", "token_states", "#2b8a3e"),
        ("reserved", "reserved", "#f59f00"),
        ("internal frag.", "internal", "#e8590c"),
        ("external frag.", "external", "#c92a2a"),
    )
    for label, attr, color in parts:
        values = [100 * getattr(r, attr) for r in reports]
        ax.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("% of committed KV memory")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("Where the KV cache goes")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the table for a shipped trace; ``--plot PATH`` also writes bars."""
    specs = load_trace_specs()
    parser = argparse.ArgumentParser(description="Measure KV-cache fragmentation on a trace.")
    parser.add_argument("--trace", default="chat", choices=sorted(specs))
    parser.add_argument("--budget", type=int, help="KV slots in total (default: the trace's)")
    parser.add_argument("--requests", type=int, help="replay only the first N requests")
    parser.add_argument("--plot", metavar="PATH", help="write the bar chart to PATH (PNG)")
    args = parser.parse_args(argv)
    spec = specs[args.trace]
    trace = generate_trace(spec)[: args.requests]
    budget = args.budget or spec.budget
    reports = run_all(trace, budget, spec.max_model_len)
    print(f"trace {spec.name!r}: {len(trace)} requests, budget {budget} KV slots")
    print(format_table(reports))
    if args.plot:
        plot_reports(reports, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
