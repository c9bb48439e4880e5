"""The α-β model: how long does communication take, and why is multi-node over 1 GbE slow?

Sending a message of ``n`` bytes over a link costs a fixed start-up time plus a time per byte::

    t(n) = α + β·n          α: latency (s)      β = 1 / bandwidth (s/byte)

A **ring all-reduce** over ``p`` processes (what DDP does with the gradients every step) runs
``2(p−1)`` rounds — ``p−1`` reduce-scatter rounds, then ``p−1`` all-gather rounds — and in each
round every process sends one chunk of ``n/p`` bytes to its neighbour::

    T(n, p) = 2(p−1)·α + 2(p−1)/p · n · β

Two facts fall out. The bandwidth term hardly grows with ``p`` (``2(p−1)/p → 2``): a ring scales.
But every byte of the gradients crosses the *slowest* link of the ring about twice per step, and
across machines that link is the network card: 1 Gbit/s Ethernet moves 125 MB/s, NVLink inside a
GPU server moves hundreds of GB/s.

This module measures α and β on this machine's loopback (:func:`measure_point_to_point`,
:func:`fit_alpha_beta`), holds nominal figures for real links (:data:`LINKS`), and projects the
step time of data-parallel training to several nodes (:func:`predict_step_time`,
:func:`scaling_table`). It ignores the time spent adding numbers during the reduction and any
overlap of communication with the backward pass (DDP's buckets overlap partly): it is a model
for orders of magnitude, which is what the decision "one node or several?" needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..runtime import check_int, check_number

__all__ = ["LINKS", "AlphaBeta", "StepPrediction", "fit_alpha_beta", "predict_step_time",
           "ring_all_reduce_bytes", "ring_all_reduce_time", "scaling_table"]


def ring_all_reduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each process sends in a ring all-reduce of ``nbytes``: ``2(p−1)/p · n``.

    Example::

        >>> ring_all_reduce_bytes(100e6, 8)     # 100 MB of gradients, 8 processes
        175000000.0
    """
    check_number("nbytes", nbytes, 0, finite=False)
    check_int("world_size", world_size, 1)
    return 2 * (world_size - 1) / world_size * nbytes


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """α-β time of a ring all-reduce: ``2(p−1)·α + 2(p−1)/p · n · β`` seconds.

    Args:
        nbytes: size of the tensor being reduced, in bytes (4 × parameters for fp32 gradients).
        world_size: processes in the ring.
        alpha: latency of one message, seconds.
        beta: seconds per byte (1 / bandwidth in bytes/s).

    Example::

        >>> t = ring_all_reduce_time(100e6, 2, alpha=50e-6, beta=1 / 125e6)   # 1 GbE
        >>> round(t, 3)
        0.8

    .. warning::
        With ``p`` processes spread over machines, use the α and β of the slowest link in the
        ring (the network between machines), not of the fast links inside a machine.
    """
    check_number("alpha", alpha, 0, finite=False)
    check_number("beta", beta, 0, finite=False)
    check_int("world_size", world_size, 1)
    return 2 * (world_size - 1) * alpha + ring_all_reduce_bytes(nbytes, world_size) * beta


@dataclass(frozen=True)
class AlphaBeta:
    """A link in the α-β model: ``alpha`` seconds per message, ``beta`` seconds per byte.

    Args:
        alpha: latency, seconds per message.
        beta: seconds per byte (1 / bandwidth in bytes/s).
        name: a label for printing.

    Example::

        >>> gbe = AlphaBeta.from_bandwidth("1 GbE", latency=50e-6, gbit_per_s=1)
        >>> round(gbe.transfer_time(125e6), 4)      # 125 MB: one second plus the latency
        1.0001
        >>> print(gbe)
        1 GbE: α = 50 µs, bandwidth = 0.125 GB/s

    .. warning::
        Nominal bandwidths are upper bounds: TCP over 1 GbE delivers about 94% of 125 MB/s, and
        a busy or shared link much less.
    """

    alpha: float
    beta: float
    name: str = "link"

    def __post_init__(self):
        check_number("alpha", self.alpha, 0, finite=False)
        check_number("beta", self.beta, 0, finite=False)

    @classmethod
    def from_bandwidth(cls, name: str, latency: float, gbit_per_s: float) -> AlphaBeta:
        """A link from its latency (s) and its bandwidth in Gbit/s (as vendors quote it)."""
        check_number("gbit_per_s", gbit_per_s, 0, finite=False)
        if gbit_per_s == 0:
            raise ValueError("gbit_per_s must be > 0")
        return cls(latency, 8 / (gbit_per_s * 1e9), name)

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``1 / beta``)."""
        return math.inf if self.beta == 0 else 1 / self.beta

    def transfer_time(self, nbytes: float) -> float:
        """``α + β·n``: one message of ``nbytes`` from one process to another."""
        check_number("nbytes", nbytes, 0, finite=False)
        return self.alpha + self.beta * nbytes

    def ring_all_reduce_time(self, nbytes: float, world_size: int) -> float:
        """:func:`ring_all_reduce_time` over this link."""
        return ring_all_reduce_time(nbytes, world_size, self.alpha, self.beta)

    def __str__(self) -> str:
        alpha = f"{self.alpha * 1e6:.3g} µs"
        return f"{self.name}: α = {alpha}, bandwidth = {self.bandwidth / 1e9:.3g} GB/s"


#: Nominal figures for common links: vendor bandwidth per direction, typical small-message latency.
#: Orders of magnitude for projections — measure your own cluster before deciding anything.
LINKS: dict[str, AlphaBeta] = {
    "1 GbE": AlphaBeta.from_bandwidth("1 GbE", latency=50e-6, gbit_per_s=1),
    "10 GbE": AlphaBeta.from_bandwidth("10 GbE", latency=20e-6, gbit_per_s=10),
    "100 Gb InfiniBand": AlphaBeta.from_bandwidth("100 Gb InfiniBand", latency=2e-6, gbit_per_s=100),
    "NVLink": AlphaBeta.from_bandwidth("NVLink", latency=3e-6, gbit_per_s=2400),  # A100: 300 GB/s
}


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], name: str = "fitted") -> AlphaBeta:
    """Fit ``t = α + β·n`` to measured one-way times by least squares on the *relative* error.

    Times of small and large messages differ by orders of magnitude; weighting each point by
    ``1/t`` (least squares on the relative error) keeps the small messages (which decide α) from being drowned by the large ones
    (which decide β). A negative intercept (noise) is clipped to 0.

    Args:
        sizes: message sizes in bytes (at least two different ones).
        times: the measured seconds for each size.

    Example::

        >>> m = fit_alpha_beta([0, 1e6, 4e6], [20e-6, 20e-6 + 1e-3, 20e-6 + 4e-3])
        >>> round(m.alpha * 1e6, 3), round(m.bandwidth / 1e9, 3)      # µs, GB/s
        (20.0, 1.0)

    .. warning::
        On a busy machine one slow repeat can bend the line: give it medians of several repeats.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times must have the same length, got {len(sizes)} and "
                         f"{len(times)}")
    for s in sizes:
        check_number("size", s, 0, finite=False)
    for t in times:
        check_number("time", t, 0, finite=False)
        if t == 0:
            raise ValueError("times must be > 0 seconds")
    if len(set(sizes)) < 2:
        raise ValueError(f"need at least two different message sizes to fit α and β, got {list(sizes)}")
    w = [1 / t ** 2 for t in times]  # weights of the squared errors: relative error
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times))
    beta = max(sxy / sxx, 0.0)
    alpha = max(my - beta * mx, 0.0)
    return AlphaBeta(alpha, beta, name)


# --------------------------------------------------------------------------------------------
# Measuring on this machine (loopback between processes)
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Projections
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPrediction:
    """Predicted time of one data-parallel training step (seconds), from :func:`predict_step_time`.

    Args:
        compute, communication, total: seconds per step (``total`` is their sum, or their maximum
            when communication is assumed to overlap).
        world_size: number of processes.

    Example::

        >>> p = StepPrediction(compute=0.1, communication=0.1, total=0.2, world_size=16)
        >>> p.speedup          # 16 processes at half efficiency: 8 times one process
        8.0

    .. warning::
        ``speedup`` assumes every process computes as fast as a lone one: input pipelines,
        stragglers or a shared PCIe switch that slow down at scale are not in the model.
    """

    compute: float
    communication: float
    total: float
    world_size: int

    @property
    def speedup(self) -> float:
        """Samples per second relative to one process: ``world_size × compute / total``."""
        return self.world_size * self.compute / self.total


def predict_step_time(compute_seconds: float, grad_bytes: float, nnodes: int,
                      nproc_per_node: int, inter_node: AlphaBeta,
                      intra_node: AlphaBeta | None = None, *, overlap: bool = False
                      ) -> StepPrediction:
    """Step time of data-parallel training: compute, plus a ring all-reduce of the gradients.

    The ring crosses the network between machines when ``nnodes > 1`` (each step of the ring waits
    for its slowest hop), and only the intra-node link otherwise.

    Args:
        compute_seconds: forward + backward + optimizer step of one process's batch.
        grad_bytes: bytes all-reduced per step (4 × parameters for fp32 gradients).
        nnodes, nproc_per_node: the cluster layout; the ring has ``nnodes × nproc_per_node`` ranks.
        inter_node: the link between machines.
        intra_node: the link between processes on one machine (needed when ``nproc_per_node > 1``).
        overlap: ``True`` assumes communication hides completely behind compute (``max``), the
            best case; ``False`` adds them, the worst case. DDP lands in between.

    Example::

        >>> p = predict_step_time(0.1, 100e6, nnodes=2, nproc_per_node=1, inter_node=LINKS["1 GbE"])
        >>> round(p.communication, 2), round(p.total, 2), round(p.speedup, 2)
        (0.8, 0.9, 0.22)

    .. warning::
        A speed-up below 1 means the job runs *slower* on two machines than on one GPU. That is the
        seeds' experience with 1 GbE: check the prediction before buying nodes.
    """
    check_number("compute_seconds", compute_seconds, 0, finite=False)
    check_number("grad_bytes", grad_bytes, 0, finite=False)
    check_int("nnodes", nnodes, 1)
    check_int("nproc_per_node", nproc_per_node, 1)
    if not isinstance(inter_node, AlphaBeta):
        raise TypeError(f"inter_node must be an AlphaBeta (e.g. gc.LINKS['1 GbE']), got "
                        f"{type(inter_node).__name__}")
    world = nnodes * nproc_per_node
    if nnodes > 1:
        link = inter_node
    elif nproc_per_node > 1:
        if intra_node is None:
            raise ValueError("nproc_per_node > 1 on one node needs intra_node= (e.g. LINKS['NVLink'])")
        link = intra_node
    else:
        link = None
    comm = 0.0 if link is None else link.ring_all_reduce_time(grad_bytes, world)
    total = max(compute_seconds, comm) if overlap else compute_seconds + comm
    if total == 0:
        raise ValueError("compute_seconds and grad_bytes are both 0: nothing to predict")
    return StepPrediction(compute_seconds, comm, total, world)


def scaling_table(compute_seconds: float, grad_bytes: float, *, nodes: Sequence[int] = (1, 2, 4, 8),
                  nproc_per_node: int = 8, links: Mapping[str, AlphaBeta] | None = None,
                  intra_node: AlphaBeta | None = None, overlap: bool = False) -> list[dict]:
    """:func:`predict_step_time` for every inter-node link and node count: rows for a table or plot.

    Example::

        >>> rows = scaling_table(0.05, 250e3, nodes=(1, 2), nproc_per_node=1,
        ...                      links={"1 GbE": LINKS["1 GbE"]})
        >>> [(r["link"], r["nnodes"], round(r["speedup"], 2)) for r in rows]
        [('1 GbE', 1, 1.0), ('1 GbE', 2, 1.92)]

    .. warning::
        ``intra_node`` defaults to ``LINKS["NVLink"]``; GPUs that talk over PCIe are ~10× slower.
    """
    links = dict(LINKS) if links is None else dict(links)
    intra = intra_node if intra_node is not None else LINKS["NVLink"]
    rows = []
    for name, link in links.items():
        for n in nodes:
            p = predict_step_time(compute_seconds, grad_bytes, n, nproc_per_node, link, intra,
                                  overlap=overlap)
            rows.append({"link": name, "nnodes": n, "world_size": p.world_size,
                         "communication_s": p.communication, "step_s": p.total,
                         "speedup": p.speedup, "efficiency": p.speedup / p.world_size})
    return rows
