"""How many cores each of kvfuse's threads computes with: the engine all of them, helpers one.

The model runs on one thread (the engine's loop, or the caller's) with ``compute_threads()``
OpenMP threads: the cores the configuration gives it (``threads``; PyTorch's default when 0).
Everything else kvfuse runs beside it (the saver, the loaders, the prefetcher, the tiers'
writers and I/O pools, the vLLM connector's workers) is a *helper*: it copies, encodes and
decodes KV with PyTorch too, but must not compete with the model for cores.

Why it matters, measured (SmolLM2 on 2 cores, docs/bench/gguf_serving.json): once the saver
thread had copied one finished turn's KV with a 2-thread PyTorch op, libgomp kept a second
OpenMP team for that thread, and from then on every decode step of the engine's team took twice
as long (10.7 ms, then 20-25 ms for every later request: its threads waited in libgomp's team
start and barrier, not computing). With the helper at one thread the steps stay at 10.5-11 ms.
So a helper calls ``serial()`` before its first PyTorch op (``helper_thread`` and
``helper_pool`` do it for it): with one thread its ops run inline and no second team exists.

PyTorch keeps one process-wide count, and ``set_num_threads`` sets it as well as the calling
thread's own. A thread takes the process-wide count at its first PyTorch op (or
``get_num_threads``), whatever it set before: a helper that set one thread and then ran its first
op after the engine set two would compute with two; an engine thread that started after a
helper set one would compute with one. So ``_use`` makes the thread take the process-wide count
first and then sets its own, and the engine's thread sets its count (``use_compute_threads()``)
when it starts to compute, from the count recorded here (``set_compute_threads``, called when the
configuration is applied; otherwise the count of the thread that first imported this module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

_compute = torch.get_num_threads()


def set_compute_threads(n: int) -> None:
    """Record the engine's thread count (``n`` >= 1) and use it on the calling thread."""
    global _compute
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    _compute = n
    _use(n)


def compute_threads() -> int:
    """The count the engine's thread computes with."""
    return _compute


def use_compute_threads() -> None:
    """On the calling thread (the engine's): compute with ``compute_threads()`` threads."""
    _use(_compute)


def serial() -> None:
    """On the calling thread (a helper's): run PyTorch ops on this thread alone."""
    _use(1)


def _use(n: int) -> None:
    """The calling thread computes with ``n`` threads from now on (see the module docstring)."""
    torch.get_num_threads()  # the thread takes the process-wide count now, not at its first op
    torch.set_num_threads(n)


def helper_thread(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread (not started) that runs ``target(*args)`` serially (``serial()``)."""

    def run() -> None:
        serial()
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def helper_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose workers run serially (``serial()``)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=serial)
