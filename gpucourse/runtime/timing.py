"""Measuring speed honestly: warm-up, several repeats, the median, and ratios to a baseline.

A single timing is noise: the first call pays for lazy initialisation and cold caches, and any run
may be slowed by another program. So every speed claim in the course is

1) a warm-up call (not timed),
2) several timed repeats,
3) the *median* (robust to one slow outlier),
4) a *ratio* to a baseline measured in the same run on the same machine — absolute times differ
   from laptop to laptop, ratios are what the lesson is about.

Notebooks and ``benchmarks/`` share this module so that they measure the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .validate import check_int

__all__ = ["Timing", "measure", "speedup", "format_comparison"]


@dataclass
class Timing:
    """Repeated wall-clock timings of one piece of work (seconds); made by :func:`measure`.

    Example::

        >>> t = Timing("step", [0.30, 0.10, 0.20])
        >>> t.median, t.best, round(t.spread, 2)
        (0.2, 0.1, 1.0)
        >>> print(t)
        step: 200.0 ms (median of 3, spread 100%)
    """

    name: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self._measured())

    @property
    def best(self) -> float:
        return min(self._measured())

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree."""
        times = self._measured()
        return (max(times) - min(times)) / self.median if self.median > 0 else 0.0

    def _measured(self) -> list[float]:
        if not self.times:
            raise ValueError(f"Timing {self.name!r} has no measurements: make it with "
                             "gc.measure(fn), or give it times=[seconds, ...]")
        return self.times

    def __str__(self) -> str:
        return f"{self.name}: {_human(self.median)} (median of {len(self.times)}, spread {self.spread:.0%})"


def _human(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock


def measure(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1, name: str | None = None) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    Example::

        >>> t = measure(lambda: sum(range(1000)), repeats=3, name="sum")
        >>> len(t.times), t.name, t.median > 0
        (3, 'sum', True)
    """
    check_int("repeats", repeats, 1)
    check_int("warmup", warmup, 0)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return Timing(name or getattr(fn, "__name__", "fn"), times)


def speedup(baseline: Timing, other: Timing) -> float:
    """How many times faster ``other`` is than ``baseline`` (ratio of medians; > 1 is faster).

    Example::

        >>> speedup(Timing("serial", [2.0, 2.2, 1.9]), Timing("parallel", [1.0, 1.1, 0.9]))
        2.0
    """
    if other.median <= 0:
        raise ValueError(f"speedup: {other.name!r} took {other.median} s, too little to divide by; "
                         "time more work per call")
    return baseline.median / other.median


def format_comparison(baseline: Timing, *others: Timing) -> str:
    """A small table: each timing and its speed-up over the baseline.

    Example::

        >>> print(format_comparison(Timing("1 thread", [0.2]), Timing("2 threads", [0.1])))
        1 thread   200.0 ms  1.00x (baseline)
        2 threads  100.0 ms  2.00x
    """
    width = max(len(t.name) for t in (baseline, *others)) + 2
    lines = [f"{baseline.name:<{width}}{_human(baseline.median):>8}  1.00x (baseline)"]
    for t in others:
        lines.append(f"{t.name:<{width}}{_human(t.median):>8}  {speedup(baseline, t):.2f}x")
    return "\n".join(lines)
