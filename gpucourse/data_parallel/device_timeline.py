"""A timeline of the device workers: which virtual device ran which task when — recorded around a
DataParallel step with :func:`record_timeline` and drawn with :func:`plot_timeline`."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from .device_workers import _local, _push_hook


__all__ = ["Timeline", "record_timeline", "plot_timeline"]

@dataclass
class Timeline:
    """What ran where and when: ``(row, label, start, end)`` spans in seconds from the start."""

    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def thread_context(self, device: torch.device | None, label: str):
        row = str(device) if device is not None else getattr(_local, "worker_of", None) or "main thread"
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self.spans.append((row, label, start - self._t0, end - self._t0))

    def totals(self) -> dict[str, dict[str, float]]:
        """Seconds spent per label and row: ``{label: {row: seconds}}`` (spans of a row summed).

        For one DataParallel step this splits the time into its stages: ``scatter``,
        ``replicate``, ``gather`` and the waits for ``forward``/``backward`` on the main thread,
        ``forward``/``backward`` on each device.

        Example::

            >>> from gpucourse.data_parallel.device_workers import run_on_devices, span
            >>> with record_timeline() as tl:
            ...     with span("scatter"):
            ...         pass
            ...     _ = run_on_devices(lambda: None, [(), ()], [torch.device("cpu", 0), torch.device("cpu", 1)],
            ...                        label="forward")
            >>> {label: sorted(rows) for label, rows in sorted(tl.totals().items())}
            {'forward': ['cpu:0', 'cpu:1'], 'scatter': ['main thread']}
        """
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for row, label, start, end in self.spans:
                rows = out.setdefault(label, {})
                rows[row] = rows.get(row, 0.0) + (end - start)
        return out

    def overlap(self, label: str) -> float:
        """Seconds during which at least two devices were running ``label`` spans at once."""
        events = sorted([(s, 1) for _, lab, s, e in self.spans if lab == label]
                        + [(e, -1) for _, lab, s, e in self.spans if lab == label])
        busy, last, total = 0, 0.0, 0.0
        for t, delta in events:
            if busy >= 2:
                total += t - last
            busy += delta
            last = t
        return total


@contextlib.contextmanager
def record_timeline():
    """Record every task the device workers run (and DataParallel's steps) while active.

    Example::

        >>> from gpucourse.data_parallel.device_workers import run_on_devices
        >>> with record_timeline() as tl:
        ...     _ = run_on_devices(lambda: None, [(), ()], [torch.device("cpu", 0), torch.device("cpu", 1)],
        ...                        label="forward")
        >>> sorted(row for row, label, start, end in tl.spans)
        ['cpu:0', 'cpu:1']
    """
    timeline = Timeline()
    with _push_hook(timeline):
        yield timeline


def plot_timeline(timeline: Timeline, ax=None, *, title: str | None = None):
    """Draw a timeline: one row per device (plus the main thread), one bar per span.

    Returns the matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len({s[0] for s in timeline.spans})))
    rows = sorted({s[0] for s in timeline.spans}, key=lambda r: (r == "main thread", r))
    labels = sorted({s[1] for s in timeline.spans}, key=lambda lab: (lab.startswith("wait"), lab))
    work = [lab for lab in labels if not lab.startswith("wait")]
    colours = {lab: plt.cm.tab10(work.index(lab) % 10) if lab in work else "0.85" for lab in labels}
    for row, label, start, end in timeline.spans:
        y = rows.index(row)
        ax.barh(y, (end - start) * 1e3, left=start * 1e3, color=colours[label], edgecolor="black",
                linewidth=0.5, height=0.6)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[lab]) for lab in labels]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    if title:
        ax.set_title(title)
    return ax
