"""When does more arithmetic hardware help? Throughput, arithmetic intensity and the roofline.

A GPU (or a CPU's matrix unit such as Intel AMX) has far more arithmetic units than a CPU core —
but arithmetic units only help when they can be kept fed. Whether they can is one number of the
operation, its **arithmetic intensity**: floating-point operations per byte it must move between
memory and the chip.

* ``n × n`` matrix product: ``2 n³`` FLOPs over ``3 n²`` numbers moved → intensity grows with
  ``n``. Big products are *compute-bound*: faster arithmetic (more ALUs, bf16) makes them faster.
* element-wise ``a + b``: 1 FLOP per 3 numbers moved → intensity is a small constant. It is
  *memory-bound*: more ALUs sit idle; only memory bandwidth (and caches) make it faster.

The **roofline** model says how fast an operation can go on a machine with peak arithmetic
``P`` (FLOP/s) and memory bandwidth ``B`` (bytes/s): ``min(P, intensity × B)``.
:func:`measure_throughput` measures real points; :func:`plot_roofline` puts them under the roof.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime import measure
from ..runtime import check_int

__all__ = ["OPS", "matmul_flops", "op_cost", "arithmetic_intensity", "ThroughputPoint",
           "measure_throughput", "roofline", "plot_throughput", "plot_roofline"]

#: operations :func:`measure_throughput` knows: ``size`` is ``n`` of an n×n product, or a length
OPS = ("matmul", "add")


def matmul_flops(n: int, m: int | None = None, k: int | None = None) -> int:
    """Floating-point operations of ``(n, k) @ (k, m)``: ``2·n·m·k`` (a multiply and an add each).

    Args:
        n: rows of the left matrix; ``m`` and ``k`` default to ``n`` (square product).

    Example::

        >>> matmul_flops(1024)              # ~2.1 GFLOP
        2147483648
        >>> matmul_flops(8, 4, 2)
        128
    """
    m = n if m is None else m
    k = n if k is None else k
    for name, v in (("n", n), ("m", m), ("k", k)):
        check_int(name, v, 1)
    return 2 * n * m * k


def op_cost(op: str, size: int, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of one ``op`` of ``size``: arithmetic done and the least memory traffic.

    ``"matmul"``: ``(n, n) @ (n, n)`` reads two matrices and writes one. ``"add"``: ``a + b`` on
    ``size`` elements reads two tensors and writes one.

    Example::

        >>> op_cost("add", 1000)            # 1000 FLOPs, 3 x 1000 x 4 bytes
        (1000, 12000)
        >>> op_cost("matmul", 64, torch.bfloat16)
        (524288, 24576)
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    check_int("size", size, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    item = torch.empty((), dtype=dtype).element_size()
    if op == "matmul":
        return matmul_flops(size), 3 * size * size * item
    return size, 3 * size * item


def arithmetic_intensity(op: str, size: int, dtype: torch.dtype = torch.float32) -> float:
    """FLOPs per byte of memory traffic of one ``op`` (see :func:`op_cost`).

    Example::

        >>> arithmetic_intensity("add", 10**6)                 # 1 FLOP per 12 bytes, at any size
        0.08333333333333333
        >>> arithmetic_intensity("matmul", 1024)               # 2n^3 / (3 n^2 * 4) = n / 6
        170.66666666666666
        >>> arithmetic_intensity("matmul", 1024, torch.bfloat16)   # half the bytes: twice the intensity
        341.3333333333333

    .. warning::
        This counts each number moved *once* — the best case, reached only when the operands fit
        in cache or the kernel tiles well. Real traffic is higher, real intensity lower.
    """
    flops, nbytes = op_cost(op, size, dtype)
    return flops / nbytes


@dataclass(frozen=True)
class ThroughputPoint:
    """One measured operation: what it was, how long it took, and what rates that means."""

    op: str
    size: int
    dtype: str
    device: str
    seconds: float       # median time of one op
    flops: int
    bytes: int

    @property
    def gflops(self) -> float:
        """Achieved arithmetic rate, GFLOP/s."""
        return self.flops / self.seconds / 1e9

    @property
    def gbytes_per_s(self) -> float:
        """Achieved memory traffic rate (of the least traffic), GB/s."""
        return self.bytes / self.seconds / 1e9

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes


def measure_throughput(op: str, sizes: Iterable[int], *, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", repeats: int = 5,
                       min_time: float = 2e-3) -> list[ThroughputPoint]:
    """Measure ``op`` at each size and return the achieved rates.

    Each timed sample runs the op back-to-back enough times to last ``min_time`` seconds, so
    tiny ops are not drowned by the clock and Python overhead of one call; the point keeps the
    median per-op time of ``repeats`` samples. Outputs are preallocated (``out=``), so no time
    goes to memory allocation.

    Args:
        op: ``"matmul"`` (``size`` = ``n`` of an ``n × n`` product) or ``"add"`` (``size`` =
            number of elements).
        sizes: the sizes to measure.
        dtype: a floating-point dtype (``torch.float32``, ``torch.bfloat16`` …).
        device: where to run (``"cpu"``, ``"cuda"``); GPU work is synchronised before each
            clock read.
        repeats: samples per size (>= 1).
        min_time: seconds each sample should last at least.

    Example::

        >>> import torch
        >>> pts = measure_throughput("add", [1000, 10**5], repeats=2)
        >>> [(p.op, p.size, p.dtype, p.flops) for p in pts]
        [('add', 1000, 'float32', 1000), ('add', 100000, 'float32', 100000)]
        >>> all(p.gflops > 0 for p in pts)
        True

    .. warning::
        torch uses all cores for one large op unless told otherwise (``torch.get_num_threads()``);
        say which you measured. Numbers from a busy machine are low and noisy.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    check_int("repeats", repeats, 1)
    device = torch.device(device)
    points = []
    for size in sizes:
        flops, nbytes = op_cost(op, size, dtype)
        g = torch.Generator().manual_seed(size)
        shape = (size, size) if op == "matmul" else (size,)
        a = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(shape, device=device, dtype=dtype)
        fn = torch.matmul if op == "matmul" else torch.add

        def block(fn=fn, a=a, b=b, out=out, inner=1):
            for _ in range(inner):
                fn(a, b, out=out)

        single = measure(block, repeats=1, warmup=1).median
        inner = max(1, math.ceil(min_time / max(single, 1e-9)))

        t = measure(functools.partial(block, inner=inner), repeats=repeats, warmup=0)
        points.append(ThroughputPoint(op, size, str(dtype).removeprefix("torch."), str(device),
                                      t.median / inner, flops, nbytes))
    return points


def roofline(intensity, peak_gflops: float, bandwidth_gbs: float):
    """The roofline bound ``min(peak, intensity × bandwidth)`` in GFLOP/s.

    Args:
        intensity: FLOPs per byte (a number or an array).
        peak_gflops: the machine's peak arithmetic rate, GFLOP/s.
        bandwidth_gbs: its memory bandwidth, GB/s.

    Example::

        >>> roofline(0.25, peak_gflops=100.0, bandwidth_gbs=20.0)   # memory-bound: 0.25 x 20
        5.0
        >>> roofline(50.0, peak_gflops=100.0, bandwidth_gbs=20.0)   # compute-bound: the peak
        100.0

    .. warning::
        The ridge point ``peak / bandwidth`` (FLOPs per byte needed to use all the arithmetic)
        is far higher on a GPU than on a CPU core, and higher for bf16 than for fp32: the faster
        the arithmetic, the more work per byte an operation needs to profit from it.
    """
    for name, v in (("peak_gflops", peak_gflops), ("bandwidth_gbs", bandwidth_gbs)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name} must be a number > 0, got {v!r}")
    x = np.asarray(intensity, dtype=float)
    if (x < 0).any() or np.isnan(x).any():
        raise ValueError(f"intensity must be >= 0, got {intensity!r}")
    out = np.minimum(peak_gflops, x * bandwidth_gbs)
    return float(out) if out.ndim == 0 else out


def _check_series(series) -> dict:
    if not isinstance(series, Mapping) or not series:
        raise TypeError("series must be a non-empty dict {label: list of ThroughputPoint}")
    for label, pts in series.items():
        if not pts or not all(isinstance(p, ThroughputPoint) for p in pts):
            raise TypeError(f"series[{label!r}] must be a non-empty list of ThroughputPoint")
    return dict(series)


def plot_throughput(series: Mapping[str, Sequence[ThroughputPoint]], *, ax=None):
    """Achieved GFLOP/s against size, one line per series (log-log).

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> pts = measure_throughput("matmul", [8, 32], repeats=1)
        >>> ax = plot_throughput({"fp32": pts})
        >>> ax.get_ylabel()
        'achieved GFLOP/s'
    """
    import matplotlib.pyplot as plt

    series = _check_series(series)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, pts in series.items():
        ax.plot([p.size for p in pts], [p.gflops for p in pts], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (n of an n×n product, or elements)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return ax


def plot_roofline(series: Mapping[str, Sequence[ThroughputPoint]], *,
                  roofs: Mapping[str, tuple[float, float]], ax=None):
    """Measured points against arithmetic intensity, under one or more rooflines.

    Args:
        series: ``{label: points}`` from :func:`measure_throughput`.
        roofs: ``{label: (peak GFLOP/s, bandwidth GB/s)}``; one roof line each.
        ax: a matplotlib ``Axes`` (default: a new figure).

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> pts = measure_throughput("add", [1000], repeats=1)
        >>> ax = plot_roofline({"add": pts}, roofs={"fp32": (100.0, 20.0)})
        >>> ax.get_xlabel()
        'arithmetic intensity (FLOP / byte)'
    """
    import matplotlib.pyplot as plt

    series = _check_series(series)
    if not isinstance(roofs, Mapping) or not roofs:
        raise TypeError("roofs must be a non-empty dict {label: (peak GFLOP/s, bandwidth GB/s)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.intensity for pts in series.values() for p in pts]
    x = np.logspace(np.log10(min(xs) / 3), np.log10(max(xs) * 3), 200)
    for i, (label, (peak, bw)) in enumerate(roofs.items()):
        ax.plot(x, roofline(x, peak, bw), color="0.3", ls=["-", "--", ":", "-."][i % 4], lw=1.2,
                label=f"roof {label}: {peak:.0f} GFLOP/s, {bw:.0f} GB/s")
    for label, pts in series.items():
        ax.plot([p.intensity for p in pts], [p.gflops for p in pts], "o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
