"""Amdahl's law and Gustafson's law: how much faster can ``n`` workers make a job?

A job takes time ``T(1)`` on one worker; a fraction ``s`` of it is *serial* (reading the input,
setting up, merging results), the rest ``1 - s`` splits perfectly over ``n`` workers:

* **Amdahl (fixed problem size)** — ``T(n) = T(1) · (s + (1 - s) / n)``, so the speed-up is
  ``S(n) = 1 / (s + (1 - s) / n)``, which never exceeds ``1 / s``: with 5 % serial work, not even
  a thousand GPUs make the job more than 20× faster.
* **Gustafson (fixed time, the problem grows with n)** — in the time one worker needed, ``n``
  workers do ``n`` times the parallel part: the *scaled* speed-up is ``S(n) = s + (1 - s) · n``,
  which keeps growing. This is what large-scale training does: more GPUs, bigger global batch.

Going the other way, measured speed-ups reveal a job's serial fraction:
``T(n)/T(1) = s + (1 - s)/n`` is a straight line in ``1/n`` — :func:`fit_serial_fraction`
fits it; :func:`karp_flatt` gives the estimate from each single measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..runtime import Timing, measure
from ..runtime import check_int

__all__ = ["amdahl_speedup", "gustafson_speedup", "karp_flatt", "fit_serial_fraction",
           "measure_scaling", "plot_amdahl", "amdahl_widget"]


def _fraction(name: str, value) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if np.isnan(arr).any() or (arr < 0).any() or (arr > 1).any():
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return arr


def _workers(value) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if np.isnan(arr).any() or (arr < 1).any():
        raise ValueError(f"workers must be >= 1, got {value!r}")
    return arr


def _out(arr: np.ndarray):
    return float(arr) if arr.ndim == 0 else arr


def amdahl_speedup(serial_fraction, workers):
    """Amdahl's speed-up ``1 / (s + (1 - s) / n)`` of a fixed-size job on ``n`` workers.

    Args:
        serial_fraction: ``s`` in [0, 1], the share of the one-worker time that cannot be split.
        workers: ``n`` >= 1. Both arguments may be arrays (NumPy broadcasting).

    Returns:
        a float, or an array for array inputs.

    Example::

        >>> amdahl_speedup(0.0, 8)          # perfectly parallel
        8.0
        >>> amdahl_speedup(0.1, 2)
        1.8181818181818181
        >>> round(amdahl_speedup(0.05, 10**6), 2)   # the ceiling 1/s
        20.0

    .. warning::
        ``n`` counts workers that really run at the same time. Threads beyond the number of cores
        (or threads that hold the GIL) are not extra workers — measured speed-ups stop growing
        there, whatever the formula says.
    """
    s, n = _fraction("serial_fraction", serial_fraction), _workers(workers)
    return _out(1.0 / (s + (1.0 - s) / n))


def gustafson_speedup(serial_fraction, workers):
    """Gustafson's scaled speed-up ``s + (1 - s) · n`` when the work grows with ``n``.

    Args:
        serial_fraction: ``s`` in [0, 1], the serial share of the time *on n workers*.
        workers: ``n`` >= 1 (arrays broadcast).

    Example::

        >>> gustafson_speedup(0.1, 8)       # 8 workers do 7.3x the work of one in the same time
        7.3
        >>> gustafson_speedup(0.0, 4)
        4.0

    .. warning::
        Its ``s`` is not Amdahl's ``s``: Gustafson measures the serial share of the parallel run,
        Amdahl that of the one-worker run. The two laws do not disagree; they answer different
        questions (same job faster vs bigger job in the same time).
    """
    s, n = _fraction("serial_fraction", serial_fraction), _workers(workers)
    return _out(s + (1.0 - s) * n)


def karp_flatt(speedup, workers):
    """The serial fraction implied by one measured speed-up: ``(1/S - 1/n) / (1 - 1/n)``.

    Solves Amdahl's law for ``s`` (the Karp–Flatt metric). If it grows with ``n``, the job has
    costs that grow with the number of workers (communication, start-up) — not just a fixed
    serial part.

    Args:
        speedup: measured ``S(n) > 0``.
        workers: ``n > 1`` (at ``n = 1`` every ``s`` fits).

    Example::

        >>> round(karp_flatt(amdahl_speedup(0.2, 4), 4), 12)
        0.2
    """
    S = np.asarray(speedup, dtype=float)
    n = _workers(workers)
    if (S <= 0).any() or np.isnan(S).any():
        raise ValueError(f"speedup must be > 0, got {speedup!r}")
    if (n <= 1).any():
        raise ValueError(f"workers must be > 1 for the Karp-Flatt metric, got {workers!r}")
    return _out((1.0 / S - 1.0 / n) / (1.0 - 1.0 / n))


def fit_serial_fraction(workers: Sequence[float], speedups: Sequence[float]) -> float:
    """Least-squares estimate of ``s`` from measured speed-ups, clipped to [0, 1].

    Amdahl's law in normalised time is a line through a known point:
    ``T(n)/T(1) - 1/n = s · (1 - 1/n)``. With ``x = 1 - 1/n`` and ``y = 1/S - 1/n`` the
    least-squares slope through the origin is ``s = Σ x·y / Σ x²``. Points with ``n = 1`` carry no
    information (``x = 0``) and are ignored.

    Args:
        workers: the worker counts ``n`` measured (>= 1, at least one > 1).
        speedups: the speed-ups ``S(n) = T(1) / T(n)`` measured at those counts (> 0).

    Example::

        >>> n = [1, 2, 4, 8]
        >>> round(fit_serial_fraction(n, [amdahl_speedup(0.3, k) for k in n]), 12)
        0.3

    .. warning::
        Fit only worker counts that can run at the same time (at most one per core, or per GPU).
        Oversubscribed points measure the machine, not the job, and pull ``s`` up.
    """
    n = _workers(list(workers))
    S = np.asarray(list(speedups), dtype=float)
    if n.shape != S.shape or n.ndim != 1:
        raise ValueError(f"workers and speedups must be 1-D and the same length, got "
                         f"{len(n)} and {len(S)}")
    if np.isnan(S).any() or (S <= 0).any():
        raise ValueError(f"speedups must be > 0, got {list(speedups)!r}")
    x = 1.0 - 1.0 / n
    if not (x > 0).any():
        raise ValueError(f"need at least one measurement with more than one worker, got workers="
                         f"{list(workers)!r}")
    y = 1.0 / S - 1.0 / n
    return float(np.clip((x * y).sum() / (x * x).sum(), 0.0, 1.0))


def measure_scaling(job: Callable[[int], object], workers: Iterable[int], *, repeats: int = 5,
                    warmup: int = 1) -> dict[int, Timing]:
    """Time ``job(n)`` for each worker count ``n``: ``{n: Timing}``.

    Speed-ups then follow as ``gc.speedup(timings[1], timings[n])``.

    Args:
        job: runs the whole job with ``n`` workers.
        workers: worker counts to measure (ints >= 1).
        repeats, warmup: as in :func:`~gpucourse.measure` (median of ``repeats``).

    Example::

        >>> import gpucourse as gc
        >>> t = measure_scaling(lambda n: gc.parallel_map(abs, range(100), workers=n), [1, 2],
        ...                     repeats=2)
        >>> sorted(t), t[2].name
        ([1, 2], '2 workers')

    .. warning::
        The counts are measured one after the other; when the machine is busy with something
        else, the later ones suffer. Interleave or repeat the whole sweep when the numbers matter.
    """
    if not callable(job):
        raise TypeError(f"job must be callable as job(workers), got {type(job).__name__}")
    counts = list(workers)
    for n in counts:
        check_int(f"worker count in {counts!r}", n, 1)
    return {n: measure(lambda n=n: job(n), repeats=repeats, warmup=warmup,
                       name=f"{n} worker{'s' if n > 1 else ''}") for n in counts}


def plot_amdahl(serial_fractions: Iterable[float] = (0.0, 0.05, 0.1, 0.25, 0.5), *,
                max_workers: int = 1024, measured: dict[int, float] | None = None,
                fitted: float | None = None, gustafson: bool = False, ax=None):
    """Speed-up against workers (log-log) for several serial fractions — and, optionally, your data.

    Args:
        serial_fractions: the ``s`` values to draw Amdahl curves for.
        max_workers: the right end of the x axis (>= 2).
        measured: ``{workers: measured speed-up}``, drawn as points.
        fitted: a fitted ``s``, drawn as a dashed Amdahl curve through the points.
        gustafson: also draw Gustafson's scaled speed-up for each ``s`` (dotted).
        ax: a matplotlib ``Axes`` (default: a new figure).

    Returns:
        the matplotlib ``Axes``.

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = plot_amdahl([0.1], max_workers=64, measured={1: 1.0, 2: 1.8}, fitted=0.11)
        >>> [line.get_label() for line in ax.get_lines()][:2]
        ['ideal (s = 0)', 'Amdahl s = 0.1 (max 10x)']

    .. warning::
        The curves assume the parallel part splits perfectly and costs nothing to coordinate. Real
        jobs add communication that grows with ``n``; see :func:`karp_flatt`.
    """
    import matplotlib.pyplot as plt

    check_int("max_workers", max_workers, 2)
    fractions = [float(_fraction("serial_fraction", s)) for s in serial_fractions]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    n = np.unique(np.round(np.logspace(0, np.log10(max_workers), 200)))
    ax.plot(n, n, color="0.6", lw=1, label="ideal (s = 0)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(fractions):
        if s == 0:
            continue
        color = colors[i % len(colors)]
        ax.plot(n, amdahl_speedup(s, n), color=color, label=f"Amdahl s = {s:.3g} (max {1 / s:.3g}x)")
        if gustafson:
            ax.plot(n, gustafson_speedup(s, n), color=color, ls=":", label=f"Gustafson s = {s:.3g}")
    if fitted is not None:
        f = float(_fraction("fitted", fitted))
        ax.plot(n, amdahl_speedup(f, n), color="k", ls="--", lw=1.2, label=f"fit: s = {f:.2f}")
    if measured:
        ks = sorted(measured)
        ax.plot(ks, [measured[k] for k in ks], "ko", ms=6, label="measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, max_workers)
    ax.set_ylim(0.8, max_workers * 1.2)
    ax.set_xlabel("workers n")
    ax.set_ylabel("speed-up S(n)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def amdahl_widget(serial_fraction: float = 0.05, workers: int = 16, *, max_workers: int = 1024):
    """Sliders for ``s`` and ``n`` over :func:`plot_amdahl` and :func:`amdahl_speedup`.

    Args:
        serial_fraction, workers: the sliders' start values.
        max_workers: the largest ``n`` on the slider and the plot.

    Returns:
        an ``ipywidgets`` box (display it as a cell's last expression): two sliders and the plot,
        redrawn when a slider moves. Its ``summary`` attribute holds the numbers shown. It is a thin
        view — every number comes from :func:`amdahl_speedup` and :func:`gustafson_speedup`.

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> w = amdahl_widget(0.1, 8)
        >>> [c.description for c in w.children[:2]]
        ['serial s', 'workers n']
        >>> w.summary
        "s = 0.100, n = 8: Amdahl 4.71x, Gustafson 7.30x (Amdahl's ceiling 10.0x)"

    .. warning::
        Widgets need a live kernel: in a static view of the notebook (GitHub, nbviewer) the
        sliders do not move — use :func:`plot_amdahl` there.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    _fraction("serial_fraction", serial_fraction)
    check_int("max_workers", max_workers, 2)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= max_workers:
        raise ValueError(f"workers must be an int in [1, {max_workers}], got {workers!r}")

    s_slider = widgets.FloatSlider(value=serial_fraction, min=0.0, max=0.5, step=0.005,
                                   description="serial s", readout_format=".3f")
    n_slider = widgets.SelectionSlider(options=_worker_options(workers, max_workers), value=workers,
                                       description="workers n")
    out = widgets.Output()
    box = widgets.VBox([s_slider, n_slider, out])

    def redraw(change=None) -> None:
        s, n = s_slider.value, n_slider.value
        amdahl, gustafson = amdahl_speedup(s, n), gustafson_speedup(s, n)
        box.summary = (f"s = {s:.3f}, n = {n}: Amdahl {amdahl:.2f}x, Gustafson {gustafson:.2f}x "
                       f"(Amdahl's ceiling {f'{1 / s:.1f}x' if s > 0 else 'none'})")
        with out:
            if change is not None:           # a slider moved: replace the previous plot
                out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 4.5))
            plot_amdahl([s], max_workers=max_workers, gustafson=True, ax=ax)
            ax.plot([n], [amdahl], "o", color="C0", ms=8)
            ax.plot([n], [gustafson], "s", color="C0", mfc="none", ms=8)
            ax.set_title(box.summary, fontsize=9)
            plt.show()
            plt.close(fig)

    s_slider.observe(redraw, names="value")
    n_slider.observe(redraw, names="value")
    redraw()
    return box


def _worker_options(workers: int, max_workers: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, … up to ``max_workers`` (and ``workers``): even steps on a log axis."""
    options = {1, workers, max_workers}
    k = 1
    while k <= max_workers:
        options.update(v for v in (k, 3 * k // 2) if v <= max_workers)
        k *= 2
    return sorted(options)
