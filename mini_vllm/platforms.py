"""The machine the engine runs on: which device it may use and how many CPU threads.

upstream: vllm/platforms/ (vLLM picks its platform once, at import; mini_vllm checks the device
``LLM`` is given and sizes the CPU's thread pool)
"""

from __future__ import annotations

import os

import torch

__all__ = ["MAX_DEFAULT_THREADS", "SMALL_MODEL_PARAMS", "check_device", "default_num_threads"]


# Models with fewer parameters than this run fastest on one thread: each operation is a few
# microseconds of work, and splitting it over threads costs more in synchronisation than it saves
# (and on a busy machine a thread that waits for a descheduled sibling stalls every operation).
SMALL_MODEL_PARAMS = 20_000_000


MAX_DEFAULT_THREADS = 8


def default_num_threads(model: torch.nn.Module) -> int:
    """The thread count ``LLM`` uses when none is given.

    ``OMP_NUM_THREADS``, when set, wins. Otherwise 1 for a small model (below 20M parameters),
    and for a larger one the CPU cores this process may use that are not already busy (the
    one-minute load average says how many are), at least 1 and at most 8: an OpenMP thread that
    waits for a sibling the OS has descheduled stalls every operation, so oversubscribing a busy
    machine is far slower than using fewer threads.

    upstream: none (vLLM's CPU backend binds its OpenMP threads in its CPU worker)
    """
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(cores - busy, MAX_DEFAULT_THREADS))


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` saying why it cannot be used here.

    upstream: none (vLLM picks its platform once, in vllm/platforms)
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"LLM: device {device!r} is not a device name ({exc})") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("this PyTorch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        raise ValueError(f"LLM: device={str(device)!r} but {why}; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"LLM: device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    return dev
