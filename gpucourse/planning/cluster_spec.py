"""What a cluster *is* to the planner: devices, memory and FLOP/s per device, two links (α, β).

Every communication time in the planner is chapter 05's α-β model (``gc.AlphaBeta``): a group of
ranks that fits inside one node talks over ``intra`` (NVLink), a group that spans nodes over
``inter`` (InfiniBand, Ethernet) — each ring waits for its slowest hop.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from ..cluster import LINKS, AlphaBeta, fit_alpha_beta, measure_point_to_point
from ..runtime import check_choice, check_int, check_number, check_positive, launch

__all__ = ["ClusterSpec"]

GB = 10 ** 9
GiB = 2 ** 30

#: Nominal figures. H100 SXM5: 80 GB HBM3, 989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s per direction,
#: one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s) — NVIDIA H100 datasheet, DGX H100 user guide.
#: A100 SXM4 80 GB: 312 TFLOP/s dense bf16, NVLink 3 at 300 GB/s per direction, one 200 Gb/s HDR NIC
#: per GPU (25 GB/s) — NVIDIA A100 datasheet, DGX A100 user guide.
#: "1gbe": the seed articles' set-up — one 24 GB consumer GPU (RTX 3090: 71 TFLOP/s dense bf16 with
#: fp32 accumulate, GA102 whitepaper) per machine, machines joined by 1 Gbit/s Ethernet (gc.LINKS["1 GbE"]).
#: With one GPU per machine nothing crosses ``intra``; it holds PCIe 4.0 x16 (32 GB/s nominal, about
#: 25 GB/s achieved, ~10 µs), what a second consumer GPU in the box would get — such cards have no
#: NVLink switch.
_PRESETS = {
    "h100-sxm-8": dict(devices_per_node=8, memory_bytes=80 * GiB, peak_flops=989e12,
                       intra=(3e-6, 450e9), inter=(5e-6, 50e9)),
    "a100-80g-8": dict(devices_per_node=8, memory_bytes=80 * GiB, peak_flops=312e12,
                       intra=(3e-6, 300e9), inter=(5e-6, 25e9)),
    "1gbe": dict(devices_per_node=1, memory_bytes=24 * GiB, peak_flops=71e12,
                 intra=(10e-6, 25e9),
                 inter=(LINKS["1 GbE"].alpha, LINKS["1 GbE"].bandwidth)),
}


def _link(name: str, value, label: str) -> AlphaBeta:
    if isinstance(value, AlphaBeta):
        return value
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(f"{name} must be (alpha_seconds, bytes_per_second) or a gc.AlphaBeta, got {value!r}")
    alpha, bw = value
    check_number(f"{name} alpha", alpha, 0)
    check_positive(f"{name} bytes_per_s", bw)
    return AlphaBeta(alpha, 1 / bw, label)


@dataclass(frozen=True, init=False)
class ClusterSpec:
    """``nodes × devices_per_node`` devices, each with ``memory_bytes`` and ``peak_flops``.

    Args:
        nodes, devices_per_node: the layout.
        memory_bytes: memory per device.
        peak_flops: FLOP/s per device for the training dtype (the datasheet's dense figure, or
            measured with :meth:`measure`).
        intra, inter: links inside a node and between nodes, ``(alpha_seconds, bytes_per_second)``
            or a ``gc.AlphaBeta``; stored as ``AlphaBeta`` (``.intra.alpha``, ``.intra.beta``).
        name: a label.

    Example::

        >>> c = ClusterSpec.preset("h100-sxm-8", nodes=2)
        >>> c.devices, round(c.memory_bytes / 2**30), c.intra.bandwidth / 1e9, c.inter.bandwidth / 1e9
        (16, 80, 450.0, 50.0)
        >>> c.link_for(stride=1, size=8).name, c.link_for(stride=8, size=2).name
        ('intra', 'inter')

    .. warning::
        Datasheet peaks are not reachable: real training kernels reach 50-75% of them, and
        published runs report 38-52% MFU. The planner's compute time is a lower bound.
    """

    nodes: int
    devices_per_node: int
    memory_bytes: int
    peak_flops: float
    intra: AlphaBeta
    inter: AlphaBeta
    name: str

    def __init__(self, nodes: int, devices_per_node: int, memory_bytes: float, peak_flops: float, *,
                 intra=(3e-6, 300e9), inter=(5e-6, 25e9), name: str = "cluster"):
        check_int("nodes", nodes, 1)
        check_int("devices_per_node", devices_per_node, 1)
        check_positive("memory_bytes", memory_bytes)
        check_positive("peak_flops", peak_flops)
        for k, v in (("nodes", nodes), ("devices_per_node", devices_per_node), ("memory_bytes", memory_bytes),
                     ("peak_flops", peak_flops), ("intra", _link("intra", intra, "intra")),
                     ("inter", _link("inter", inter, "inter")), ("name", name)):
            object.__setattr__(self, k, v)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link_for(self, stride: int, size: int) -> AlphaBeta:
        """The link a group of ``size`` ranks, ``stride`` ranks apart, talks over.

        Ranks are numbered node by node; the group ``{r, r + stride, …}`` stays inside a node when
        ``stride · size ≤ devices_per_node``.
        """
        check_int("stride", stride, 1)
        check_int("size", size, 1)
        return self.intra if stride * size <= self.devices_per_node else self.inter

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1) -> ClusterSpec:
        """``"h100-sxm-8"``, ``"a100-80g-8"`` (8 GPUs per node, NVLink inside, InfiniBand between)
        or ``"1gbe"`` (one GPU per machine, 1 GbE between) — figures cited in ``_PRESETS``'s comment.

        Example::

            >>> round(ClusterSpec.preset("1gbe", nodes=4).inter.bandwidth / 1e6)      # 125 MB/s
            125
        """
        check_choice("name", name, tuple(_PRESETS))
        return cls(nodes, name=name, **_PRESETS[name])

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def measure(cls, nprocs: int = 2, *, matmul_size: int = 512, repeats: int = 5,
                timeout: float = 120.0) -> ClusterSpec:
        """This machine as a cluster: one process per "device", one node.

        ``peak_flops``: the median over ranks of the FLOP/s of a timed ``matmul_size``-square fp32
        matmul, one thread per process, with all ``nprocs`` processes running at once (they share the
        cores and the memory bus, as they will in training). Links: chapter 05's ``gc.fit_alpha_beta``
        on a loopback ping-pong (``gc.measure_point_to_point``), used for ``intra`` and ``inter``.
        ``memory_bytes``: the machine's RAM divided by ``nprocs``.

        Example::

            >>> c = ClusterSpec.measure(2, matmul_size=64, repeats=1)
            >>> c.devices, c.peak_flops > 1e6, c.intra.alpha < 0.1
            (2, True, True)

        .. warning::
            Measured while other programs run, both numbers are low and noisy; measure on a quiet machine.
        """
        check_int("nprocs", nprocs, 1, maximum=64)
        check_int("matmul_size", matmul_size, 8)
        check_int("repeats", repeats, 1)
        rates = launch(_matmul_rate, nprocs, args=(matmul_size, repeats), timeout=timeout)
        sizes = [8, 4096, 64 * 1024, 1 << 20, 4 << 20]
        link = fit_alpha_beta(sizes, measure_point_to_point(sizes, repeats=max(repeats, 3), timeout=timeout),
                              "loopback")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(1, nprocs, ram // nprocs, statistics.median(rates), intra=link, inter=link,
                   name=f"this machine ({nprocs} processes)")


def _matmul_rate(rank, world_size, n, repeats):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b                                            # warm-up
    dist.barrier()                                   # every process computes at once
    inner = max(1, int(5e8 // (2 * n ** 3)))         # ~0.5 GFLOP per timed block
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        times.append((time.perf_counter() - start) / inner)
    return 2 * n ** 3 / statistics.median(times)
