"""Pictures of the number formats: the representable range of each dtype, and where a tensor's values
fall on a log2 scale relative to it."""

from __future__ import annotations

import math

import torch

from .number_formats import float_format


__all__ = ["plot_ranges", "plot_log2_histogram"]

def plot_ranges(dtypes=(torch.float32, torch.bfloat16, torch.float16), ax=None):
    """Draw each format's magnitude range on a log2 axis: subnormals light, normals dark.

    Args:
        dtypes: formats to draw, top to bottom.
        ax: matplotlib axes to draw into (a new figure if ``None``).

    Returns the matplotlib ``Axes``.

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = plot_ranges()
        >>> [t.get_text() for t in ax.get_yticklabels()]
        ['fp32', 'bf16', 'fp16']

    .. warning::
        The bars show range only. Precision (eps) is the same across a format's normal range and
        fades in the subnormal part.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * len(dtypes)))
    for row, dtype in enumerate(dtypes):
        f = float_format(dtype)
        lo, mid, hi = (math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max))
        ax.barh(row, mid - lo, left=lo, color="C0", alpha=0.35, height=0.5)
        ax.barh(row, hi - mid, left=mid, color="C0", height=0.5)
        ax.text(hi + 3, row, f"eps = 2^-{f.mantissa_bits}", va="center", fontsize=9)
    ax.set_yticks(range(len(dtypes)), [float_format(d).name for d in dtypes])
    ax.invert_yaxis()
    ax.set_xlabel("log2 |x|   (light: subnormal, dark: normal range)")
    ax.set_title("What each format can represent")
    ax.set_xlim(right=ax.get_xlim()[1] + 25)
    return ax


def plot_log2_histogram(values, dtype: torch.dtype = torch.float16, ax=None, bins: int = 80):
    """Histogram of ``log2 |x|`` for one or several tensors, with ``dtype``'s limits as lines.

    Args:
        values: a tensor, or ``{label: tensor}`` to overlay several (e.g. raw vs scaled gradients).
        dtype: whose smallest subnormal, smallest normal and max are drawn.
        ax: matplotlib axes to draw into (a new figure if ``None``).
        bins: histogram bins.

    Example::

        >>> import matplotlib, torch
        >>> matplotlib.use("Agg")
        >>> ax = plot_log2_histogram({"grads": torch.randn(1000) * 1e-6})
        >>> ax.get_xlabel()
        'log2 |value|'

    .. warning::
        Zeros, infs and NaNs are left out (log2 of them is meaningless), so check
        :func:`cast_report` for counts.
    """
    import matplotlib.pyplot as plt

    if isinstance(values, torch.Tensor):
        values = {"values": values}
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    f = float_format(dtype)
    for label, t in values.items():
        t = t.detach().flatten().double()
        t = t[(t != 0) & torch.isfinite(t)].abs().log2()
        ax.hist(t.numpy(), bins=bins, alpha=0.6, label=label)
    for x, style, text in ((f.smallest_subnormal, ":", "smallest subnormal"),
                           (f.smallest_normal, "--", "smallest normal"), (f.max, "-", "max")):
        ax.axvline(math.log2(x), color="k", linestyle=style, linewidth=1)
        ax.text(math.log2(x), ax.get_ylim()[1] * 0.95, f" {f.name} {text}", rotation=90,
                va="top", fontsize=8)
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("count")
    ax.legend(loc="upper left")
    return ax
