"""What each worker did and when: a timeline of chunks, and how busy each worker really was.

Concurrency and parallelism look the same from outside — several tasks are "in progress" at once —
and differ in one number: how much of its wall-clock time a worker spent *computing*.

* **parallel** (each worker on its own core): a worker's CPU time ≈ its wall time, busy ≈ 100 %.
* **concurrent, time-sliced** (threads taking turns for the GIL, or more processes than cores):
  each worker waits for its turn, so its CPU time is only a share of its wall time, busy ≈ 1/k.

:func:`~gpucourse.parallel_map` records one :class:`ChunkRecord` per chunk into a :class:`Trace`
when asked (``trace=``); :func:`plot_timelines` draws traces on one time axis, one row per worker,
each bar filled in proportion to the time it really computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["ChunkRecord", "Trace", "plot_timelines"]


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk of work as a worker ran it.

    Attributes:
        chunk: index of the chunk in the split (0 … num_chunks-1).
        worker: the thread or process (0 … workers-1) that ran it.
        start, end: ``time.perf_counter()`` at its start and end, seconds. On Linux and macOS this
            clock is system-wide, so records from different processes share one time axis.
        cpu: CPU time the worker's thread spent on it (``time.thread_time()``), seconds.
    """

    chunk: int
    worker: int
    start: float
    end: float
    cpu: float

    @property
    def wall(self) -> float:
        """Wall-clock seconds from start to end."""
        return self.end - self.start


class Trace:
    """The :class:`ChunkRecord` s of one or more :func:`~gpucourse.parallel_map` calls.

    Args:
        name: a label for plots (``"2 threads, pure Python"``).

    Example::

        >>> import gpucourse as gc
        >>> trace = gc.Trace("squares")
        >>> gc.parallel_map(lambda x: x * x, range(6), workers=2, trace=trace)
        [0, 1, 4, 9, 16, 25]
        >>> len(trace), sorted(r.worker for r in trace)
        (2, [0, 1])
        >>> sorted(trace.busy_fraction())
        [0, 1]

    .. warning::
        ``busy_fraction`` counts the CPU time of the thread that ran a chunk. Work that thread hands
        to *other* threads (torch's intra-op pool when ``torch.get_num_threads() > 1``) is not
        counted, so measure with :func:`~gpucourse.intra_op_threads` ``(1)`` when that matters.
    """

    def __init__(self, name: str = ""):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
        self.name = name
        self.records: list[ChunkRecord] = []

    def add(self, record: ChunkRecord) -> None:
        """Append one record (``parallel_map`` calls this)."""
        if not isinstance(record, ChunkRecord):
            raise TypeError(f"expected a ChunkRecord, got {type(record).__name__}")
        self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[ChunkRecord]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self.records)} chunks)"

    @property
    def start(self) -> float:
        return min(r.start for r in self._nonempty())

    @property
    def wall(self) -> float:
        """Seconds from the first chunk's start to the last chunk's end."""
        return max(r.end for r in self._nonempty()) - self.start

    def busy_fraction(self) -> dict[int, float]:
        """``{worker: CPU time / wall time}`` over that worker's chunks.

        ≈ 1.0: the worker computed all the time (it had a core to itself). ≈ 0.5: it spent half
        its time waiting for its turn — for the GIL, or for a core shared with another worker.
        """
        cpu: dict[int, float] = {}
        wall: dict[int, float] = {}
        for r in self._nonempty():
            cpu[r.worker] = cpu.get(r.worker, 0.0) + r.cpu
            wall[r.worker] = wall.get(r.worker, 0.0) + r.wall
        return {w: (cpu[w] / wall[w] if wall[w] > 0 else 1.0) for w in sorted(cpu)}

    def _nonempty(self) -> list[ChunkRecord]:
        if not self.records:
            raise ValueError(f"trace {self.name!r} is empty: pass it to parallel_map(..., trace=trace) "
                             "first")
        return self.records


def plot_timelines(traces: Sequence[Trace], *, ax=None, title: str | None = None):
    """Draw traces on one time axis: a row per (trace, worker), a bar per chunk.

    The solid part of each bar is the share of that chunk's wall time the worker spent computing
    (CPU time / wall time); the pale rest is time spent waiting for a turn.

    Args:
        traces: the :class:`Trace` s to compare; each starts at time 0.
        ax: a matplotlib ``Axes`` to draw into (default: a new figure).
        title: the plot title.

    Returns:
        the matplotlib ``Axes``.

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import gpucourse as gc
        >>> t = gc.Trace("demo")
        >>> _ = gc.parallel_map(abs, [-1, 2, -3], workers=2, trace=t)
        >>> ax = gc.plot_timelines([t])
        >>> [label.get_text() for label in ax.get_yticklabels()]
        ['demo · worker 0', 'demo · worker 1']

    .. warning::
        Bars of different processes share an axis only because ``time.perf_counter`` is
        system-wide on Linux and macOS; on Windows compare the lengths, not the positions.
    """
    import matplotlib.pyplot as plt

    traces = list(traces)
    if not traces or not all(isinstance(t, Trace) for t in traces):
        raise TypeError(f"traces must be a non-empty list of Trace objects, got {traces!r}")
    if ax is None:
        rows = sum(len({r.worker for r in t._nonempty()}) for t in traces)
        _, ax = plt.subplots(figsize=(8, 0.45 * rows + 1.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels, row = [], 0
    for i, trace in enumerate(traces):
        color = colors[i % len(colors)]
        t0 = trace.start
        for worker in sorted({r.worker for r in trace}):
            for r in (r for r in trace if r.worker == worker):
                busy = r.cpu / r.wall if r.wall > 0 else 1.0
                ax.barh(row, r.wall * 1e3, left=(r.start - t0) * 1e3, height=0.7, color=color,
                        alpha=0.25, edgecolor=color)
                ax.barh(row, min(busy, 1.0) * r.wall * 1e3, left=(r.start - t0) * 1e3, height=0.7,
                        color=color)
            labels.append(f"{trace.name} · worker {worker}" if trace.name else f"worker {worker}")
            row += 1
    ax.set_yticks(range(row), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time since the trace's first chunk started (ms)  —  solid: computing, pale: waiting")
    if title:
        ax.set_title(title)
    return ax
