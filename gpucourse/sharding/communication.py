"""What each ZeRO stage sends per step: predicted with chapter 05's α-β model, and measured.

Per step and rank, for ``n`` bytes of gradients (and as many of parameters), on a ring of ``p``:

* DDP — one all-reduce of the gradients: ``2(p-1)/p · n``;
* ZeRO-1/2 — a reduce-scatter of the gradients + an all-gather of the parameters: the two halves
  of that all-reduce, ``(p-1)/p · n`` each — **the same volume as DDP**;
* ZeRO-3 — an all-gather of the parameters in forward, another in backward, and the
  reduce-scatter of the gradients: ``3(p-1)/p · n`` — **1.5× DDP**.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..distributed import ring_all_reduce
from ..runtime import launch, validate
from .collectives import _all_gather_flat, _reduce_scatter_flat

__all__ = ["measure_zero_comm", "zero_comm_bytes", "zero_comm_time"]

_HALVES = {0: 2, 1: 2, 2: 2, 3: 3}      # ring phases per step: all-reduce = 2, ZeRO-3 = 3


def zero_comm_bytes(nbytes: float, world_size: int, stage: int) -> float:
    """Bytes each rank sends per step for ``nbytes`` of gradients: ``h(p-1)/p · n``, h = 2 (stages 0-2) or 3.

    Example::

        >>> [zero_comm_bytes(100, 4, s) for s in range(4)]
        [150.0, 150.0, 150.0, 225.0]
    """
    validate.check_number("nbytes", nbytes, 0)
    validate.check_int("world_size", world_size, 1)
    validate.check_choice("stage", stage, (0, 1, 2, 3))
    return _HALVES[stage] * (world_size - 1) / world_size * nbytes


def zero_comm_time(nbytes: float, world_size: int, stage: int, alpha: float, beta: float) -> float:
    """α-β time of one step's communication: ``h(p-1)·α + h(p-1)/p · n · β``.

    Example::

        >>> round(zero_comm_time(100e6, 2, 3, alpha=50e-6, beta=1 / 125e6), 3)   # 1 GbE
        1.2
    """
    validate.check_number("alpha", alpha, 0)
    validate.check_number("beta", beta, 0)
    return _HALVES[stage] * (world_size - 1) * alpha + zero_comm_bytes(nbytes, world_size, stage) * beta


def _comm_worker(rank, world_size, numel, repeats):
    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def ddp():
        ring_all_reduce(x.clone())

    def zero12():
        buf = x.clone()
        _reduce_scatter_flat(buf)
        _all_gather_flat(buf)

    def zero3():
        buf = x.clone()
        _all_gather_flat(buf)            # forward: gather the parameters
        _all_gather_flat(buf)            # backward: gather them again
        _reduce_scatter_flat(buf)        # backward: the gradients

    impls = {0: ddp, 1: zero12, 3: zero3}
    times = {k: [] for k in impls}
    for r in range(repeats + 1):
        for k, fn in impls.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:                        # the first round warms up
                times[k].append(t.item())
    return {k: statistics.median(v) for k, v in times.items()}


def measure_zero_comm(numel: int, world_size: int = 2, *, repeats: int = 5, timeout: float = 120.0) -> dict:
    """Median seconds of one step's communication of ``numel`` float32, each built from send/recv.

    Returns ``{0: DDP's ring all-reduce, 1: ZeRO-1/2's reduce-scatter + all-gather,
    3: ZeRO-3's two all-gathers + reduce-scatter}`` (stage 2 sends what stage 1 does).

    Example::

        >>> t = measure_zero_comm(1 << 12, repeats=1)
        >>> sorted(t)
        [0, 1, 3]

    .. warning::
        All three use the same ring transport (chapter 04's), so their ratio shows the volume;
        gloo's own ``all_reduce`` is a different implementation and not a fair baseline here.
    """
    validate.check_int("numel", numel, 1)
    validate.check_int("world_size", world_size, 2)
    validate.check_int("repeats", repeats, 1)
    numel = -(-numel // world_size) * world_size              # pad to split evenly
    return launch(_comm_worker, world_size, args=(numel, repeats), timeout=timeout)[0]
