"""What a MiniDDP step looked like: when backward ran, when each bucket's all-reduce was launched and done —
recorded by :class:`~gpucourse.MiniDDP` with ``trace=True`` and drawn by :func:`plot_step_trace`."""

from __future__ import annotations

from dataclasses import dataclass, field


__all__ = ["StepTrace", "plot_step_trace"]

@dataclass
class StepTrace:
    """Wall-clock events of one training step of a traced :class:`MiniDDP` (``perf_counter`` seconds).

    Attributes:
        backward_start: when the gradient reached the model's output (backward begins).
        backward_end: when autograd finished (the end-of-backward callback ran).
        comms: per all-reduce, ``(label, bytes, launched, finished)``.
        synced: when the gradients were ready for ``optimizer.step()``.

    Example::

        >>> import torch, gpucourse as gc
        >>> def traced(rank, world_size):
        ...     model = gc.MiniDDP(gc.MLP(8, 16, 2), bucket_cap_mb=25, trace=True)
        ...     model(torch.randn(4, 8)).sum().backward()
        ...     t = model.traces[-1]
        ...     return [label for label, *_ in t.comms], t.backward_start <= t.backward_end <= t.synced
        >>> gc.launch(traced, 2)[0]
        (['bucket 0'], True)

    .. warning::
        ``perf_counter`` values are per process: compare times within one rank's trace, not
        across ranks.
    """

    backward_start: float | None = None
    backward_end: float | None = None
    comms: list[tuple[str, int, float, float | None]] = field(default_factory=list)
    synced: float | None = None


def _human_bytes(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.1f} MB"
    return f"{n / 2**10:.0f} KB" if n >= 2**10 else f"{n} B"


def plot_step_trace(trace: StepTrace, ax=None, title: str | None = None):
    """Draw one traced backward pass: the compute on top, each all-reduce in flight on a row below.

    Times are in milliseconds from the start of backward. An all-reduce bar spans from its launch
    to its completion; bars that lie under the backward bar were in flight *while* gradients were
    still being computed — the overlap that buckets buy.

    Args:
        trace: a :class:`StepTrace` from ``MiniDDP(..., trace=True).traces``.
        ax: a matplotlib ``Axes`` to draw into (default: a new figure).
        title: the plot's title.

    Returns:
        The ``Axes``.

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> t = StepTrace(backward_start=0.0, backward_end=0.010, synced=0.012,
        ...               comms=[("bucket 0", 4096, 0.004, 0.006), ("bucket 1", 4096, 0.010, 0.012)])
        >>> ax = plot_step_trace(t, title="two buckets")
        >>> [label.get_text() for label in ax.get_yticklabels()]
        ['bucket 1, 4 KB', 'bucket 0, 4 KB', 'backward']

    .. warning::
        On a CPU the "communication" is gloo's threads copying through loopback sockets and
        competing with the compute for the same cores; the picture shows *when* things happen,
        not what a GPU with its own NCCL streams would achieve.
    """
    import matplotlib.pyplot as plt

    if not isinstance(trace, StepTrace) or trace.backward_start is None or trace.synced is None:
        raise ValueError("trace must be a complete StepTrace (from MiniDDP(..., trace=True).traces)")
    rows = len(trace.comms) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.9 + 0.3 * rows))
    t0 = trace.backward_start

    def ms(t):
        return (t - t0) * 1e3

    ax.broken_barh([(0, ms(trace.backward_end))], (rows - 1, 0.8), color="tab:blue")
    labels = ["backward"]
    for i, (label, nbytes, launched, finished) in enumerate(trace.comms):
        end = finished if finished is not None else trace.synced
        ax.broken_barh([(ms(launched), max(ms(end) - ms(launched), 1e-3))], (rows - 2 - i, 0.8),
                       color=("tab:orange", "tab:red")[i % 2])
        labels.append(f"{label}, {_human_bytes(nbytes)}")
    ax.axvline(ms(trace.synced), color="k", linestyle="--", linewidth=1)
    ax.set_yticks([r + 0.4 for r in range(rows)], labels[::-1])
    ax.set_xlabel("ms since backward started (dashed: gradients ready for optimizer.step)")
    if title:
        ax.set_title(title)
    return ax
