"""Lab 02-02 starter: a replay simulator that measures where KV-cache memory goes.

Fill in the bodies that raise ``NotImplementedError`` (tasks 1-4 of the README); everything else is
given and works once they do. Each docstring is a contract: what goes in, what comes out, what must
hold afterwards, which errors. How to get there is yours to work out; when stuck, climb the hint
ladder: ``python -m course hint 02-02 N`` (a question), then ``--level 2`` (a small case to trace by
hand), ``--level 3`` (the idea, and the tests that check it), then ``--level 4`` (the upstream lines
to read).

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

Run ``python starter.py --plot fragmentation.png`` from the lab folder for the table and bars.
"""

from __future__ import annotations

import argparse
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


def reservation_size(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """KV slots a contiguous-reservation system sets aside for a request when it is admitted.

    Inputs: ``policy`` is ``"max"``, ``"pow2"`` or ``"oracle"``; ``prompt_len >= 1`` and
    ``output_len >= 1``; the final length ``prompt_len + output_len`` is at most
    ``max_model_len``.

    Output: ``"max"``: ``max_model_len`` (enough for any request); ``"pow2"``: the smallest
    power of two that holds the final length (a length that is a power of two already is not
    doubled), but never more than ``max_model_len``; ``"oracle"``: exactly the final length.

    Errors: ``ValueError`` naming what is wrong: the unknown policy, the length below 1, or the
    final length and ``max_model_len`` when the request is too long. Pure, O(1).
    """
    raise NotImplementedError(
        "lab 02-02, task 1: implement reservation_size (hint: python -m course hint 02-02 1)"
    )


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
        """Hand out ``size`` contiguous slots from the lowest hole that has room (first fit).

        Output: the start of the new range, which is the start of the first hole, in address
        order, of at least ``size`` slots. Afterwards that hole has lost its first ``size``
        slots (a hole that fits exactly is gone) and ``allocated[start] == size``. ``None``
        when no single hole is large enough, even if the free slots add up to enough (that is
        external fragmentation); then nothing changes.

        Errors: ``size < 1`` raises ``ValueError`` naming it, and nothing changes.
        O(number of holes).
        """
        raise NotImplementedError(
            "lab 02-02, task 2: implement ContiguousAllocator.allocate "
            "(hint: python -m course hint 02-02 2)"
        )

    def free(self, start: int) -> None:
        """Give back the range that begins at ``start``.

        Afterwards its slots are free and the invariants hold: the range has joined the hole
        that ends where it starts and the hole that starts where it ends, whichever exist, so
        ``holes`` stays sorted, disjoint and without two adjacent holes; ``allocated`` no
        longer has it.

        Errors: a ``start`` where no allocated range begins (never allocated, inside a range,
        freed already) raises ``ValueError`` naming it, and nothing changes.
        O(number of holes).
        """
        raise NotImplementedError(
            "lab 02-02, task 2: implement ContiguousAllocator.free "
            "(hint: python -m course hint 02-02 2)"
        )

    def free_slots(self) -> int:
        """Free slots in all holes together."""
        return sum(size for _, size in self.holes)

    def largest_hole(self) -> int:
        """The largest request that ``allocate`` can serve right now."""
        return max((size for _, size in self.holes), default=0)


# ------------------------------------------------------------------------------ task 3


def slot_breakdown(allocated: int, num_tokens: int, final_len: int) -> tuple[int, int, int]:
    """Split a request's ``allocated`` slots into ``(token_states, reserved, internal)``.

    The request holds ``num_tokens`` tokens now and will stop at ``final_len``. Token states
    are the slots holding the KV of its existing tokens; reserved, the allocated slots it will
    still write before it stops; internal fragmentation, the allocated slots it will never
    write. The three add up to ``allocated``, and none is negative.

    Errors: ``ValueError`` giving the three numbers unless ``0 <= num_tokens <=
    min(allocated, final_len)``. Pure, O(1).
    """
    raise NotImplementedError(
        "lab 02-02, task 3: implement slot_breakdown (hint: python -m course hint 02-02 3)"
    )


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
        """Give a waiting request the blocks for its current ``num_tokens``.

        ``True`` when the pool has enough free blocks (exactly enough is enough): the request's
        table (``tables[req.rid]``) is then its new blocks from ``pool.get_new_blocks``.
        ``False`` otherwise, and then nothing changes (no table, no block taken). O(blocks).
        """
        raise NotImplementedError(
            "lab 02-02, task 4: implement PagedKV.admit (hint: python -m course hint 02-02 4)"
        )

    def grow(self, req: SimRequest, running: list[SimRequest]) -> list[SimRequest]:
        """Make room for the next token of ``req`` (running, with ``num_tokens`` tokens in its
        blocks); return the requests preempted to do so, in the order they were preempted.

        A new block is taken only when ``req``'s blocks are full; otherwise nothing changes and
        the result is ``[]``. When a block is needed and the pool has none free, the most
        recently admitted running request (the end of ``running``, possibly ``req`` itself) is
        preempted: removed from ``running``, its blocks released, its ``num_preemptions``
        increased by one. That repeats until a block is free or ``req`` itself was preempted
        (then ``req`` gets no block). The other requests in ``running`` keep their order.
        O(blocks released).
        """
        raise NotImplementedError(
            "lab 02-02, task 4: implement PagedKV.grow (hint: python -m course hint 02-02 4)"
        )

    def release(self, req: SimRequest) -> None:
        """Give all of ``req``'s blocks back to the pool in one ``free_blocks`` call, last block
        first, and forget its table. O(blocks)."""
        raise NotImplementedError(
            "lab 02-02, task 4: implement PagedKV.release (hint: python -m course hint 02-02 4)"
        )

    def allocated(self, req: SimRequest) -> int:
        """KV slots ``req`` holds: its number of blocks times the block size."""
        raise NotImplementedError(
            "lab 02-02, task 4: implement PagedKV.allocated (hint: python -m course hint 02-02 4)"
        )

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
