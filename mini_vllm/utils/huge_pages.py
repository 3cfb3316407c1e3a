"""A CPU model's weights moved onto 2 MB memory pages, where the kernel offers them.

A decode step reads every weight once, front to back, at the speed the memory and the CPU's
prefetchers allow. On ordinary 4 KB pages the prefetchers stop at every page boundary and the
CPU's TLB misses every 4 KB; on 2 MB pages ("transparent huge pages", which Linux gives to a
region that asks for them with ``madvise(MADV_HUGEPAGE)`` when
``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always`` or ``madvise``) a stream of
weights runs faster (one stream of SmolLM2's fp32 weights, 1 thread, about 5% on the course's
machine, in four alternating runs; no gain seen at 2 threads). Where the kernel does not offer
them (another OS, THP ``never``) the engine leaves the weights where they are (:func:`offered`).

upstream: none (vLLM leaves weight placement on the CPU to PyTorch's allocator)
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def offered() -> bool:
    """Whether this OS gives huge pages to a region that asks (Linux, THP ``always`` or
    ``madvise``): only then is moving the weights worth its copy."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in setting or "[madvise]" in setting)


def _arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory starting on a 2 MB boundary, advised onto huge pages."""
    # Private: a shared anonymous mapping is shmem, which THP serves under another setting.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: ordinary pages
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def move_weights_to_huge_pages(model: torch.nn.Module, extra: list[torch.Tensor]) -> int:
    """Copy every CPU parameter of ``model``, and the tensors of ``extra`` (fused
    weights the model keeps outside its parameters), into one arena of huge pages, keeping which
    tensors share memory: each tensor becomes the same view of its storage's new copy (a fused
    weight's parts stay views of it; a tied head stays tied). Parameters keep their objects,
    names and values (``param.data`` is swapped, as ``model.to()`` does). Returns the bytes moved.

    ``extra`` is updated in place: entry ``i`` becomes its moved view.
    """
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    tensors = [*params, *extra]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // 64) * 64  # cache-line aligned
    if not total:
        return 0
    arena = _arena(total)
    for ptr, storage in storages.items():
        arena[offsets[ptr]:offsets[ptr] + storage.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8).set_(storage))
    whole = arena.untyped_storage()

    def rehome(t: torch.Tensor) -> torch.Tensor:
        start = arena.storage_offset() + offsets[t.untyped_storage().data_ptr()]  # bytes
        return torch.empty(0, dtype=t.dtype).set_(
            whole, start // t.element_size() + t.storage_offset(), t.size(), t.stride())

    with torch.no_grad():
        for p in params:
            p.data = rehome(p.data)
        for i, t in enumerate(extra):
            extra[i] = rehome(t)
    return total
