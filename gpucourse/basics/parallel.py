"""Chunk → run at the same time → merge safely: the recipe for putting several cores to work.

Every way of using more than one core for a compute-heavy job takes the same three steps:

1) **split** the work into chunks (:func:`chunk_sizes`, :func:`split_into_chunks`);
2) **run** the chunks at the same time, in threads or in processes (:func:`parallel_map`);
3) **merge** the results so that no update is lost. Three safe ways, all used in this module:

   * *ordered merge* — every worker writes only its own result slot (:func:`parallel_map`);
   * *reduction* — every worker returns a partial result, the caller combines them
     (:func:`parallel_reduce`; this is what an all-reduce does across GPUs);
   * *locking* — shared state is updated under a lock (:class:`SharedTotal` with ``lock=True``).

Threads or processes? In CPython (≤ 3.12, and 3.13+ unless built free-threaded):

* **threads** share memory, so handing work out and merging is cheap — but only one thread at a
  time runs Python bytecode (the *GIL*, global interpreter lock). Pure-Python work in threads takes
  turns: concurrency without speed-up. Work that releases the GIL — a large enough torch op, I/O —
  runs truly in parallel.
* **processes** each have their own interpreter and GIL, so pure-Python work runs in parallel too,
  but nothing is shared: inputs and results are copied, and starting them costs time on every
  call. Children are forked like :func:`~gpucourse.launch` does, so a function defined in a
  notebook cell works, and each child runs with one intra-op torch thread.

Example::

    >>> import gpucourse as gc
    >>> gc.parallel_map(lambda x: x * x, range(7), workers=2, backend="process")
    [0, 1, 4, 9, 16, 25, 36]
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .timeline import ChunkRecord, Trace
from ..runtime import check_int

__all__ = ["BACKENDS", "chunk_sizes", "split_into_chunks", "parallel_map", "parallel_reduce", "SharedTotal", "accumulate_in_threads"]

#: where :func:`parallel_map` runs the chunks
BACKENDS = ("serial", "thread", "process")


# --------------------------------------------------------------------------------------------
# 1) split
# --------------------------------------------------------------------------------------------

def chunk_sizes(n: int, num_chunks: int) -> list[int]:
    """Split ``n`` items into ``num_chunks`` contiguous chunks as evenly as possible.

    The first ``n % num_chunks`` chunks get one item more — the same sizes as
    ``torch.tensor_split`` and ``numpy.array_split``. There are always exactly ``num_chunks``
    sizes; some are 0 when ``n < num_chunks``.

    Args:
        n: number of items (>= 0).
        num_chunks: number of chunks (>= 1).

    Example::

        >>> chunk_sizes(10, 3)
        [4, 3, 3]
        >>> chunk_sizes(2, 4)
        [1, 1, 0, 0]

    .. warning::
        ``torch.chunk`` is different: it makes chunks of ``ceil(n / num_chunks)`` and may return
        *fewer* chunks (``torch.arange(5).chunk(4)`` gives 3). Uneven chunks make the slowest
        worker set the pace: 10 items on 3 workers take as long as 4 items on one.
    """
    check_int("n", n, 0)
    check_int("num_chunks", num_chunks, 1)
    base, extra = divmod(n, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


def split_into_chunks(items: Iterable, num_chunks: int) -> list[list]:
    """Cut ``items`` into ``num_chunks`` contiguous lists with :func:`chunk_sizes` sizes.

    Args:
        items: any iterable (it is read once into a list).
        num_chunks: number of chunks (>= 1).

    Example::

        >>> split_into_chunks("abcdefg", 3)
        [['a', 'b', 'c'], ['d', 'e'], ['f', 'g']]

    .. warning::
        A tensor is split into its rows (``list(tensor)``); for tensors ``torch.tensor_split``
        gives the same chunks as views, without copying.
    """
    items = list(items)
    chunks, start = [], 0
    for size in chunk_sizes(len(items), num_chunks):
        chunks.append(items[start:start + size])
        start += size
    return chunks


# --------------------------------------------------------------------------------------------
# 2) run — each worker runs its chunks, records when, and returns (chunk index, result, record)
# --------------------------------------------------------------------------------------------

def _run_chunk(fn, chunk, op, index: int, worker: int):
    start, cpu0 = time.perf_counter(), time.thread_time()
    if op is None:
        result = [fn(x) for x in chunk]
    else:
        result = functools.reduce(op, map(fn, chunk))
    record = ChunkRecord(index, worker, start, time.perf_counter(), time.thread_time() - cpu0)
    return result, record


def _assignment(num_chunks: int, workers: int) -> list[list[int]]:
    """Chunk ``c`` goes to worker ``c % workers`` (a static, round-robin schedule)."""
    return [list(range(w, num_chunks, workers)) for w in range(workers)]


def _process_worker(rank, world_size, fn, chunks, assignment, op):
    """Body of one child process (module level, so ``spawn`` can find it where fork is missing)."""
    return [(c, *_run_chunk(fn, chunks[c], op, c, rank)) for c in assignment[rank]]


def _wait_until_exited(threads, limit: float = 1.0) -> None:
    """Wait (at most ``limit`` s) until the joined ``threads`` have left the operating system too.

    ``Thread.join()`` returns once a thread's Python state is gone, but its OS thread still runs the
    C libraries' per-thread clean-up (torch's, MKL's, OpenMP's thread-local state) — some of it under
    a lock. A process forked in that moment (``backend="process"``, ``gc.launch``) inherits the lock
    held by a thread it does not have, and its first matrix product can wait for it forever: lesson
    01 timed threads, then processes, and once in a few hundred forks a rank hung in ``x @ q``.
    Linux lists a process's threads in ``/proc/self/task``; elsewhere this returns at once.
    """
    ids = [t.native_id for t in threads if getattr(t, "native_id", None)]
    if not ids or not os.path.isdir("/proc/self/task"):
        return
    deadline = time.monotonic() + limit
    while any(os.path.exists(f"/proc/self/task/{i}") for i in ids) and time.monotonic() < deadline:
        time.sleep(0.0002)


def _run_threads(fn, chunks, assignment, op, timeout):
    results: list[Any] = [None] * len(chunks)
    records: list[Any] = [None] * len(chunks)
    errors: dict[int, BaseException] = {}
    # torch.set_num_threads only configures the *calling* thread's OpenMP/MKL pool: a new thread
    # starts with the default (all cores). Give every worker the caller's setting.
    torch = sys.modules.get("torch")
    intra_op = torch.get_num_threads() if torch is not None else None

    def body(worker: int) -> None:
        if intra_op is not None:
            torch.set_num_threads(intra_op)
        for c in assignment[worker]:
            try:
                # ordered merge: this worker is the only one writing slot c, so no lock is needed
                results[c], records[c] = _run_chunk(fn, chunks[c], op, c, worker)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
                errors[c] = e
                return

    threads = [threading.Thread(target=body, args=(w,), name=f"gpucourse-worker{w}", daemon=True)
               for w in range(len(assignment))]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [w for w, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(
            f"parallel_map: thread worker(s) {stuck} did not finish within {timeout:g} s. Python "
            "threads cannot be stopped from outside: they keep running in the background until "
            "fn returns. Pass a larger timeout=, or use backend='process' (which can be killed).")
    _wait_until_exited(threads)
    if errors:
        first = min(errors)
        err = errors[first]
        err.add_note(f"(raised by fn in chunk {first}, thread worker {first % len(threads)}, "
                     "of parallel_map)")
        raise err
    return results, records


def _check_common(fn, workers, backend, num_chunks, timeout):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    check_int("workers", workers, 1)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if num_chunks is not None:
        check_int("num_chunks", num_chunks, 1)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def _run(fn, items, op, workers, backend, num_chunks, timeout, trace):
    """Split, run on ``backend``, and return the per-chunk results in chunk order."""
    _check_common(fn, workers, backend, num_chunks, timeout)
    if trace is not None and not isinstance(trace, Trace):
        raise TypeError(f"trace must be a gpucourse.Trace or None, got {type(trace).__name__}")
    chunks = [c for c in split_into_chunks(items, num_chunks or workers) if c]  # drop empty chunks
    if not chunks:
        return []
    if backend == "serial":
        workers = 1
    assignment = _assignment(len(chunks), min(workers, len(chunks)))
    if backend == "process":
        from ..runtime import launch

        per_worker = launch(_process_worker, len(assignment), args=(fn, chunks, assignment, op),
                            init_process_group=False, timeout=timeout)
        results, records = [None] * len(chunks), [None] * len(chunks)
        for triples in per_worker:          # ordered merge: put each chunk back in its slot
            for c, result, record in triples:
                results[c], records[c] = result, record
    elif backend == "thread":
        results, records = _run_threads(fn, chunks, assignment, op, timeout)
    else:
        results, records = zip(*(_run_chunk(fn, chunk, op, c, 0) for c, chunk in enumerate(chunks)))
    if trace is not None:
        for record in records:
            trace.add(record)
    return list(results)


def parallel_map(fn: Callable[[Any], Any], items: Iterable, *, workers: int = 2,
                 backend: str = "thread", num_chunks: int | None = None, timeout: float = 60.0,
                 trace: Trace | None = None) -> list:
    """``[fn(x) for x in items]``, computed by ``workers`` threads or processes.

    1) split ``items`` into ``num_chunks`` contiguous chunks (default: one per worker);
    2) worker ``w`` runs chunks ``w, w + workers, …`` one after the other;
    3) each chunk's results go to that chunk's own slot, and the slots are joined in order —
       an *ordered merge*: no shared state, so no lock, and the same order as the serial map.

    Args:
        fn: a function of one item. For ``backend="process"`` its return values must be picklable.
        items: the inputs (any iterable; read once into a list).
        workers: number of threads or processes (>= 1).
        backend: ``"thread"``, ``"process"`` or ``"serial"`` (the baseline: one worker, no
            threads).
        num_chunks: number of chunks (>= 1); more chunks than workers balances uneven work.
        timeout: seconds to wait for all workers before raising ``TimeoutError``.
        trace: a :class:`~gpucourse.Trace` that receives one record per chunk (when and how long
            each ran, and its CPU time), for :func:`~gpucourse.plot_timelines`.

    Returns:
        the list ``[fn(x) for x in items]``, in the order of ``items``.

    Raises:
        the exception ``fn`` raised (thread and serial back-ends; a note names the chunk), or
        :class:`~gpucourse.WorkerError` naming the worker (process back-end); ``TimeoutError``.

    Example::

        >>> parallel_map(str.upper, ["a", "b", "c"], workers=2)
        ['A', 'B', 'C']
        >>> parallel_map(lambda x: x + 1, range(5), workers=3, backend="process")
        [1, 2, 3, 4, 5]

    .. warning::
        Threads only speed up work that releases the GIL (large torch ops, I/O); pure-Python
        work in threads takes turns and runs no faster than serially — use
        ``backend="process"``. torch ops may also use several intra-op threads each: measure with
        :func:`intra_op_threads` ``(1)`` so the two kinds of parallelism do not fight for the cores
        (each worker thread gets the caller's ``torch.get_num_threads()``).
        The process back-end pays a start-up cost on every call (forking the processes, setting
        them up, copying results back — tens of milliseconds on a typical machine; measure it
        with ``gc.measure`` on a call that does no work), so give it chunks that take much
        longer than that.
    """
    per_chunk = _run(fn, items, None, workers, backend, num_chunks, timeout, trace)
    return [y for chunk in per_chunk for y in chunk]


def parallel_reduce(fn: Callable[[Any], Any], items: Iterable,
                    op: Callable[[Any, Any], Any] = operator.add, *, workers: int = 2,
                    backend: str = "thread", num_chunks: int | None = None, timeout: float = 60.0,
                    trace: Trace | None = None):
    """``fn(x0) op fn(x1) op …`` with a *reduction merge*: partial results per chunk, combined once.

    Each worker reduces its own chunks locally (no shared state); the caller then combines the
    partial results in chunk order. This is the safe merge that also works across processes —
    and across GPUs, where it is called all-reduce.

    Args:
        fn: a function of one item.
        items: the inputs (at least one).
        op: an associative function of two partial results (default ``operator.add``).
        workers, backend, num_chunks, timeout, trace: as in :func:`parallel_map`.

    Example::

        >>> parallel_reduce(lambda x: x * x, range(10), workers=3)   # 0 + 1 + 4 + … + 81
        285
        >>> parallel_reduce(abs, [-3, 7, -1], max, backend="process")
        7

    .. warning::
        ``op`` must be associative, but it need not be exact: floating-point addition in another
        grouping rounds differently, so a parallel float sum can differ from the serial one in the
        last bits (compare with ``torch.testing.assert_close``, not ``==``). The grouping is fixed
        by the chunking, so the result does not change from run to run.
    """
    if not callable(op):
        raise TypeError(f"op must be a function of two partial results, got {type(op).__name__}")
    partials = _run(fn, items, op, workers, backend, num_chunks, timeout, trace)
    if not partials:
        raise ValueError("parallel_reduce() of an empty sequence has no value: pass at least one item")
    return functools.reduce(op, partials)


# --------------------------------------------------------------------------------------------
# 3) merge into shared state: safely with a lock, or racing without one
# --------------------------------------------------------------------------------------------

class SharedTotal:
    """A running total that several threads add to — the merge step, with or without a lock.

    ``add`` is a *read-modify-write*: read ``value``, compute ``value + amount``, write it back.
    Without a lock another thread can run between the read and the write; its update is then
    overwritten — a *lost update*. With ``lock=True`` only one thread at a time runs the three
    steps.

    Args:
        initial: the starting value (a number or a tensor).
        lock: protect ``add`` with a ``threading.Lock`` (the default, and the only correct choice
            when several threads call ``add``).

    Example::

        >>> total = SharedTotal(0)
        >>> for x in [1, 2, 3]:
        ...     total.add(x)
        >>> total.value
        6

    .. warning::
        A missing lock often *looks* fine: with plain ints CPython 3.11 rarely switches threads in
        the middle of ``value + amount``, so tests pass. Once the addition releases the GIL — a
        torch tensor, a NumPy array, free-threaded Python 3.13t — updates get lost silently (see
        :func:`accumulate_in_threads`). And in *processes* nothing is shared at all: each child adds
        into its own copy, and the parent's total never changes — merge by returning partial
        results instead (:func:`parallel_reduce`).
    """

    def __init__(self, initial: Any = 0, *, lock: bool = True):
        if not isinstance(lock, bool):
            raise TypeError(f"lock must be True or False, got {lock!r}")
        self.value = initial
        self._lock = threading.Lock() if lock else None

    @property
    def locked(self) -> bool:
        return self._lock is not None

    # A child process gets its own copy with its own lock, whether it was forked (the lock's
    # memory is copied) or spawned (pickled, as launch() does once CUDA is loaded: a lock cannot
    # be pickled, so a fresh one is made there). Either way nothing is shared with the parent.
    def __getstate__(self) -> dict:
        return {"value": self.value, "lock": self._lock is not None}

    def __setstate__(self, state: dict) -> None:
        self.value = state["value"]
        self._lock = threading.Lock() if state["lock"] else None

    def add(self, amount: Any) -> None:
        """``value = value + amount`` — atomically if the total has a lock."""
        if self._lock is None:
            self.value = self.value + amount        # read … add (may release the GIL) … write
            return
        with self._lock:
            self.value = self.value + amount

    def __repr__(self) -> str:
        return f"SharedTotal({self.value!r}, lock={self.locked})"


def accumulate_in_threads(values: Sequence, *, workers: int = 2, lock: bool = True,
                          initial: Any = 0, timeout: float = 60.0):
    """Add up ``values`` with ``workers`` threads that all ``add`` into one :class:`SharedTotal`.

    The "merge results into shared state" version of the recipe. With ``lock=False`` it is a
    real race: when the values are tensors, ``value + amount`` releases the GIL, the other thread
    reads the same old value, and one of the two updates is lost.

    Args:
        values: the numbers or tensors to add.
        workers: number of threads (>= 1).
        lock: whether the shared total is protected by a lock.
        initial: the starting value.
        timeout: seconds to wait for the threads.

    Returns:
        the final total.

    Example::

        >>> import torch
        >>> ones = [torch.ones(())] * 1000
        >>> accumulate_in_threads(ones, workers=2, lock=True).item()
        1000.0

    .. warning::
        With ``lock=False`` the result is wrong by a different amount on every run, and may even
        be right on a lucky run — which is exactly why races are hard to find by testing.
    """
    total = SharedTotal(initial, lock=lock)
    parallel_map(total.add, values, workers=workers, backend="thread", timeout=timeout)
    return total.value


# --------------------------------------------------------------------------------------------
# The execution environment of a measurement
# --------------------------------------------------------------------------------------------


