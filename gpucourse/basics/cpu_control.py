"""Controlling where work runs: torch's intra-op threads, and pinning a process to chosen CPU cores
(used to show one core against several)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator

from ..runtime import check_int


__all__ = ["intra_op_threads", "pinned_to_cpus"]

@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``, then restore the previous setting.

    torch parallelises one large op over its *intra-op* thread pool. When you parallelise with
    your own threads as well, each op should use one thread, or the two levels compete for the
    same cores and the measurement says nothing about either.

    Args:
        n: intra-op threads (>= 1).

    Example::

        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with intra_op_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True

    .. warning::
        ``torch.set_num_threads`` configures the OpenMP/MKL pool of the *calling thread*; a thread
        started later begins with the default (every core) — even though ``torch.get_num_threads()``
        there may report the new value. Threads you start yourself must call
        ``torch.set_num_threads`` again (:func:`parallel_map` does this for its workers). In a
        *forked* child never raise it above 1 (GNU OpenMP's pool does not survive ``fork``).
    """
    import torch

    check_int("n", n, 1)
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def pinned_to_cpus(cpus: Iterable[int]) -> Iterator[set[int]]:
    """Run the block (and every thread or process it starts) on the given CPU cores only (Linux).

    Pinning two workers to one core shows *time-slicing*: both make progress, by taking turns
    on that core, so nothing finishes sooner — concurrency without parallelism.

    Args:
        cpus: core ids to allow, a subset of ``os.sched_getaffinity(0)``.

    Yields:
        the set of cores the block runs on.

    Example::

        >>> import os
        >>> if hasattr(os, "sched_setaffinity"):           # Linux
        ...     before = os.sched_getaffinity(0)
        ...     with pinned_to_cpus([min(before)]) as cores:
        ...         pinned = os.sched_getaffinity(0) == cores and len(cores) == 1
        ...     restored = os.sched_getaffinity(0) == before
        ... else:
        ...     pinned = restored = True
        >>> pinned, restored
        (True, True)

    .. warning::
        Linux only (``RuntimeError`` elsewhere). Affinity is per thread: it applies to the calling
        thread and to threads and processes started inside the block, not to threads that already
        exist (such as torch's intra-op pool).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(f"pinned_to_cpus needs os.sched_setaffinity, which {sys.platform} does "
                           "not have (it is Linux-only); skip the pinned measurement here")
    allowed = os.sched_getaffinity(0)
    wanted = set(cpus)
    if not wanted or not wanted <= allowed:
        raise ValueError(f"cpus must be a non-empty subset of the cores this process may use "
                         f"{sorted(allowed)}, got {sorted(wanted)}")
    os.sched_setaffinity(0, wanted)
    try:
        yield wanted
    finally:
        os.sched_setaffinity(0, allowed)
