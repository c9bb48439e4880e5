"""Views of a DataParallel step's memory per device: a bar chart, and an interactive explorer (a thin
widget over :func:`~gpucourse.dp_step_memory`)."""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import in_kernel
from .data_parallel import balanced_chunk_sizes
from .memory import PARTS, MemoryReport, dp_step_memory


__all__ = ["plot_memory", "memory_explorer"]

def plot_memory(report: MemoryReport, ax=None, *, title: str | None = None):
    """Stacked bars: what each device holds during the step, with the measured peak as a tick.

    Returns the matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(report.devices), 3.6))
    x = range(len(report.devices))
    bottom = [0.0] * len(report.devices)
    scale, unit = (2**20, "MiB") if max(report.peak + [1]) >= 2**20 else (2**10, "KiB")
    colours = plt.cm.tab10
    for i, part in enumerate(PARTS):
        values = [v / scale for v in report.parts[part]]
        if any(values):
            ax.bar(x, values, bottom=bottom, label=part, color=colours(i), width=0.6)
            bottom = [b + v for b, v in zip(bottom, values)]
    # the peak as a short line over each bar: a line handle fits the legend's frame (a huge "_"
    # scatter marker, sized to the bar, stuck out of it)
    ax.hlines([p / scale for p in report.peak], [i - 0.3 for i in x], [i + 0.3 for i in x],
              colors="black", linewidths=2, zorder=3, label="measured peak")
    ax.set_xticks(list(x), [f"{d}\n{n} rows" for d, n in zip(report.devices, report.chunk_sizes)])
    ax.set_ylabel(unit)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return ax


def memory_explorer(model: nn.Module | None = None, *, max_batch: int = 64, max_devices: int = 4,
                    sample_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, seed: int = 0):
    """An interactive view: batch size, ``gpu0_bsz`` and device count → rows and memory per device.

    A thin view over :func:`~gpucourse.balanced_chunk_sizes`, :func:`dp_step_memory` and
    :func:`plot_memory`: every slider move measures one BalancedDataParallel step on CPU virtual
    devices (with SGD + momentum, so there is optimizer state) and redraws the bars.

    Args:
        model: the model to measure (default ``gc.Net()``).
        max_batch, max_devices: slider ranges.
        sample_shape, num_classes: shape of one input sample and number of classes of the targets.
        seed: seed of the random batch.

    Returns:
        An ``ipywidgets.VBox``; ``.update(batch, gpu0_bsz, devices)`` redraws it without a browser
        and returns the :class:`MemoryReport`.

    Example::

        >>> view = memory_explorer(max_batch=8)
        >>> view.update(batch=8, gpu0_bsz=2, devices=3).chunk_sizes
        [2, 3, 3]
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from ..data import Net

    if model is None:
        torch.manual_seed(seed)
        model = Net(num_classes)
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(max_batch, *sample_shape, generator=g)
    y_all = torch.randint(0, num_classes, (max_batch,), generator=g)
    batch = widgets.IntSlider(value=max_batch, min=1, max=max_batch, description="batch")
    gpu0 = widgets.IntSlider(value=max_batch // 4, min=0, max=max_batch, description="gpu0_bsz")
    devices = widgets.IntSlider(value=min(3, max_devices), min=2, max=max_devices, description="devices")
    out = widgets.Output()

    def update(batch=None, gpu0_bsz=None, devices=None):
        b = batch if batch is not None else box.children[0].value
        g0 = min(gpu0_bsz if gpu0_bsz is not None else box.children[1].value, b)
        n = devices if devices is not None else box.children[2].value
        sizes = balanced_chunk_sizes(b, g0, n)
        report = dp_step_memory(model, x_all[:b], y_all[:b], [torch.device("cpu", i) for i in range(n)],
                                gpu0_bsz=g0, optimizer=torch.optim.SGD(model.parameters(), lr=0.0,
                                                                       momentum=0.9))
        with out:
            if in_kernel():
                out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(1.6 + 1.3 * n, 3.4))
            plot_memory(report, ax, title=f"batch {b} = {' + '.join(map(str, sizes))}")
            plt.show()
            plt.close(fig)
        return report

    def on_change(_):
        gpu0.max = batch.value
        update()

    for slider in (batch, gpu0, devices):
        slider.observe(on_change, names="value")
    box = widgets.VBox([batch, gpu0, devices, out])
    box.update = update
    return box
