"""Measuring the α-β model's inputs on this machine: point-to-point ping-pong and all-reduce times for
a range of message sizes, to fit with :func:`~gpucourse.fit_alpha_beta`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from ..runtime import check_int, check_number


__all__ = ["measure_point_to_point", "measure_all_reduce"]

def _inner(nbytes: float) -> int:
    """Operations per timed block: enough that a block of small messages lasts well over 100 µs."""
    return 20 if nbytes < 64 * 1024 else 5 if nbytes < 1 << 20 else 2


def _timed_blocks(op, sizes, repeats, warmup, make):
    """Median over ``repeats`` blocks of the mean time of one ``op`` in a block, for each size."""
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = make(n)
        inner = _inner(n)
        for _ in range(warmup):
            op(buf)
        dist.barrier()
        blocks = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                op(buf)
            blocks.append((time.perf_counter() - start) / inner)
        out.append(statistics.median(blocks))
    return out


def _fp32_bytes(n):
    import torch

    return torch.zeros(max(int(n) // 4, 1), dtype=torch.float32)  # n bytes of fp32


def _ping_pong(rank, world_size, sizes, repeats, warmup):
    import torch.distributed as dist

    peer = 1 - rank

    def round_trip(buf):  # rank 0 sends, rank 1 sends it back
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    round_trips = _timed_blocks(round_trip, sizes, repeats, warmup, _fp32_bytes)
    return [t / 2 for t in round_trips]  # one way = half a round trip


def _all_reduce_times(rank, world_size, sizes, repeats, warmup):
    import torch.distributed as dist

    return _timed_blocks(dist.all_reduce, sizes, repeats, warmup, _fp32_bytes)


def _check_sizes(sizes, repeats):
    if not sizes:
        raise ValueError("sizes must list at least one message size in bytes")
    for s in sizes:
        check_number("size", s, 0, finite=False)
    check_int("repeats", repeats, 1)


def measure_point_to_point(sizes: Sequence[int], *, repeats: int = 20, warmup: int = 3,
                           timeout: float = 120.0) -> list[float]:
    """One-way time of a message of each size between two gloo processes on this machine.

    Rank 0 sends, rank 1 sends it back (a ping-pong); half the round trip is one message. Each
    size is timed in ``repeats`` blocks of back-to-back round trips after ``warmup`` untimed ones;
    the median block is returned.

    Example::

        >>> times = measure_point_to_point([4, 4096], repeats=3)
        >>> len(times), all(t > 0 for t in times)
        (2, True)

    .. warning::
        This is loopback: two processes on one machine, copying through the kernel. It measures
        the software path (α) and memory bandwidth (β), not a network card.
    """
    _check_sizes(sizes, repeats)
    from ..runtime import launch

    return launch(_ping_pong, 2, args=(list(sizes), repeats, warmup), timeout=timeout)[0]


def measure_all_reduce(sizes: Sequence[int], world_size: int = 2, *, repeats: int = 10,
                       warmup: int = 2, timeout: float = 120.0) -> list[float]:
    """Median time of ``dist.all_reduce`` (gloo) of each size over ``world_size`` local processes.

    Example::

        >>> len(measure_all_reduce([4, 4096], repeats=3))
        2

    .. warning::
        With more processes than CPU cores the processes take turns on the cores, and the time
        says more about the scheduler than about the algorithm.
    """
    _check_sizes(sizes, repeats)
    check_int("world_size", world_size, 1)
    from ..runtime import launch

    times = launch(_all_reduce_times, world_size, args=(list(sizes), repeats, warmup),
                   timeout=timeout)
    return [max(ts) for ts in zip(*times)]  # the slowest rank decides when everyone may go on
