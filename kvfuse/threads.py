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

The cause is libgomp's rule for more threads than cores: while the OpenMP teams of all threads
together hold more threads than there are CPUs, a waiting team member spins 100 times (not for
milliseconds) before it sleeps in the kernel, so each of a step's hundreds of parallel regions
starts and ends through futex wake-ups. Any thread that once ran a parallel op keeps its team
(idle, but counted) until it exits or runs a region of one thread. The thread that loaded the
model and then started the engine's loop is such a thread (a server's start-up thread, a
script's main thread): measured the same way, its idle team made every step 14.2 ms instead of
10.8. So ``Engine.start`` calls ``hand_over()``: the calling thread gives its team back
(``release_team``: one empty region of one thread) and computes serially until ``Engine.stop``
(called from the same thread) gives it its count back (``take_back``).

PyTorch keeps one process-wide count, and ``set_num_threads`` sets it as well as the calling
thread's own. A thread takes the process-wide count at its first PyTorch op (or
``get_num_threads``), whatever it set before: a helper that set one thread and then ran its first
op after the engine set two would compute with two; an engine thread that started after a
helper set one would compute with one. So ``_use`` makes the thread take the process-wide count
first and then sets its own, and the engine's thread sets its count (``use_compute_threads()``)
when it starts to compute, from the count recorded here (``set_compute_threads``, called when the
configuration is applied; otherwise the count of the thread that first imported this module).
The CPU kernels split their work with ``kvf::parallel_for`` (``kernels/parallel.h``), not
``at::parallel_for``, for the same reason: the latter's first call on a thread from the
extension takes the process-wide count again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)
_compute = torch.get_num_threads()
_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_empty = _REGION(lambda _: None)


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


def hand_over() -> int:
    """On a thread that computed the model and now lets the engine's thread do it: give back
    its OpenMP team (``release_team``) and compute serially from now on. Returns the thread's
    count before, for ``take_back``."""
    before = torch.get_num_threads()
    serial()
    release_team()
    return before


def take_back(n: int) -> None:
    """On the thread that handed the model over, once the engine's thread stopped: compute with
    ``n`` threads again."""
    _use(n)


def release_team() -> bool:
    """Let libgomp end the calling thread's idle OpenMP team, if it has one: an empty parallel
    region of one thread ends the team's other threads (see the module docstring). Whether
    PyTorch's libgomp was found (another OpenMP runtime has no such rule and nothing to do)."""
    gomp = _libgomp()
    if gomp is None:
        return False
    gomp.GOMP_parallel(_empty, None, ctypes.c_uint(1), ctypes.c_uint(0))
    return True


_gomp: list = []  # [the loaded libgomp, or None], once looked up


def _libgomp() -> ctypes.CDLL | None:
    if not _gomp:
        _gomp.append(_find_libgomp())
    return _gomp[0]


def _find_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (PyTorch's own copy), from ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.GOMP_parallel  # noqa: B018 (the entry point must exist)
        except (OSError, AttributeError):
            continue
        lib.GOMP_parallel.restype = None
        return lib
    log.debug("no libgomp loaded: no OpenMP team to give back")
    return None
