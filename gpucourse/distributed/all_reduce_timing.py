"""Timing the all-reduces of this part against gloo's own: the measurement behind chapter 04's
naive-vs-ring comparison and ``benchmarks/all_reduce.py``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .collectives import DEFAULT_SEGMENT_BYTES, naive_all_reduce, ring_all_reduce
from ..runtime import check_int

_IMPLEMENTATIONS = ("gloo", "ring", "naive")
_LABELS = {"gloo": "dist.all_reduce", "ring": "gc.ring_all_reduce", "naive": "gc.naive_all_reduce"}


__all__ = ["all_reduce_timings"]

def _timed(fn, x) -> float:
    y = x.clone()
    dist.barrier()
    start = time.perf_counter()
    fn(y)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)          # the slowest rank decides
    return elapsed.item()


def _timing_worker(rank, world_size, numel, rounds, segment_bytes, names):
    impls = {"gloo": dist.all_reduce,
             "ring": lambda t: ring_all_reduce(t, segment_bytes=segment_bytes),
             "naive": naive_all_reduce}
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref)
    for name in names:                                       # warm-up, and check the result
        y = x.clone()
        impls[name](y)
        torch.testing.assert_close(y, ref)
    times = {name: [] for name in names}
    for r in range(rounds):                                  # rotate who goes first each round
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(_timed(impls[name], x))
    return times


def all_reduce_timings(world_size: int, numel: int = 1 << 20, *, rounds: int = 10,
                       implementations=_IMPLEMENTATIONS,
                       segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float = 300.0):
    """Time all-reduces of ``numel`` float32 per rank on ``world_size`` fresh gloo processes.

    Each implementation runs once per round, in rotating order (a slow moment of the machine hits
    all of them alike); each time is the slowest rank's, measured from a barrier. Results are
    checked against ``dist.all_reduce`` first.

    Args:
        world_size: number of processes to start (with :func:`gpucourse.launch`).
        numel: float32 elements per rank.
        rounds: timed repeats of each implementation.
        implementations: any of ``"gloo"`` (``dist.all_reduce``), ``"ring"``
            (:func:`ring_all_reduce`), ``"naive"`` (:func:`naive_all_reduce`).
        segment_bytes: passed to :func:`ring_all_reduce`.
        timeout: seconds for the whole measurement.

    Returns:
        ``{implementation: gc.Timing}`` in the order given.

    Example::

        >>> t = all_reduce_timings(2, 1000, rounds=2, implementations=("gloo", "ring"))
        >>> [timing.name for timing in t.values()], len(t["ring"].times)
        (['dist.all_reduce', 'gc.ring_all_reduce'], 2)

    .. warning::
        Timings taken while other programs run are noise. Compare implementations only within
        one call (same machine, same moment), as ratios.
    """
    from ..runtime import launch
    from ..runtime import Timing

    names = list(implementations)
    unknown = [n for n in names if n not in _IMPLEMENTATIONS]
    if unknown or not names:
        raise ValueError(f"implementations must be a non-empty subset of {_IMPLEMENTATIONS}, got {names}")
    check_int("numel", numel, 1)
    check_int("rounds", rounds, 1)
    times = launch(_timing_worker, world_size, args=(numel, rounds, segment_bytes, names),
                   timeout=timeout)[0]
    return {name: Timing(_LABELS[name], times[name]) for name in names}
