"""Timing the all-reduces of this part against gloo's own: the measurement behind chapter 04's
naive-vs-ring comparison and ``benchmarks/all_reduce.py``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .collectives import DEFAULT_SEGMENT_BYTES, _scratch, naive_all_reduce, ring_all_reduce
from ..runtime import check_int

_IMPLEMENTATIONS = ("gloo", "ring", "naive", "messages", "checked ring")
_LABELS = {"gloo": "dist.all_reduce", "ring": "gc.ring_all_reduce", "naive": "gc.naive_all_reduce",
           "messages": "the ring's messages only", "checked ring": "ring + shape check"}


__all__ = ["all_reduce_timings"]

def _timed(fn, x) -> float:
    y = x.clone()
    dist.barrier()
    start = time.perf_counter()
    fn(y)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)          # the slowest rank decides
    return elapsed.item()


def _ring_messages_only(t: torch.Tensor) -> None:
    """What the ring moves, and nothing else: 2 (p - 1) steps of one chunk to the right neighbour and
    one from the left, each a single message, no adds, no checks — the floor the transport sets
    for :func:`ring_all_reduce` (its result is no sum)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = t.tensor_split(p)
    buf = _scratch(chunks[0].numel(), t.dtype, t.device)     # memory touched before, as the ring's
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(2 * (p - 1)):
        receive = dist.irecv(buf[: chunks[(rank - step - 1) % p].numel()], left, tag=step)
        send = dist.isend(chunks[(rank - step) % p], right, tag=step)
        receive.wait()
        send.wait()


def _timing_worker(rank, world_size, numel, rounds, segment_bytes, names):
    impls = {"gloo": dist.all_reduce,
             # like dist.all_reduce and the naive one: no shape check (its cost: "checked ring")
             "ring": lambda t: ring_all_reduce(t, segment_bytes=segment_bytes, check_shapes=False),
             "checked ring": lambda t: ring_all_reduce(t, segment_bytes=segment_bytes),
             "naive": naive_all_reduce,
             "messages": _ring_messages_only}
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref)
    for name in names:                                       # warm-up, and check the result
        y = x.clone()
        impls[name](y)
        if name != "messages":                               # moves data, computes no sum
            torch.testing.assert_close(y, ref)
    times = {name: [] for name in names}
    for r in range(rounds):                                  # rotate who goes first each round
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(_timed(impls[name], x))
    return times


def all_reduce_timings(world_size: int, numel: int = 1 << 20, *, rounds: int = 10,
                       implementations=("gloo", "ring", "naive"),
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
            (:func:`ring_all_reduce` without its shape check, which neither ``dist.all_reduce`` nor
            the naive one does), ``"checked ring"`` (with it, the default of
            :func:`ring_all_reduce`), ``"naive"`` (:func:`naive_all_reduce`), ``"messages"``
            (the ring's 2 (p - 1) chunk-sized messages alone, no adds: the transport's floor for
            the ring; not an all-reduce).
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
