"""How the K/V blocks travel, what they cost, and the check that keeps bad input from hanging.

- :func:`ring_exchange` sends one tensor to the next rank and receives one from the previous rank
  with a plain ``isend``/``irecv`` pair — even ranks post the send first, odd ranks the receive
  (``batch_isend_irecv`` can hang on gloo) — and returns at once so the caller computes meanwhile.
- :func:`cp_meter` counts every byte this part sends and times every step (for the lesson's
  timelines and imbalance plots); nothing is recorded when no meter is open.
- :func:`agree_on_shards` makes the ranks compare their shard shapes *before* the first message:
  one rank's bad input becomes a ``ValueError`` on every rank, not a rank waiting forever.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..basics import ChunkRecord, Trace
from ..runtime import group_info, rank_device

__all__ = ["CPMeter", "CPStep", "agree_on_shards", "cp_meter", "record_message", "ring_exchange", "ring_traces"]

_OPEN: list[CPMeter] = []


@dataclass(frozen=True)
class CPStep:
    """One step of a ring (or one Ulysses attention): what was computed, when, and the message in flight.

    ``work`` is the number of query·key score entries computed (a causal diagonal tile counts
    ``n(n+1)/2`` per row block); ``compute_*`` and ``comm_*`` are ``time.perf_counter()`` stamps
    (system-wide, so ranks share one time axis); ``comm_start == comm_end`` when nothing was sent.
    """

    phase: str
    step: int
    kv_source: int
    work: int
    compute_start: float
    compute_end: float
    compute_cpu: float
    comm_start: float
    comm_end: float


@dataclass
class CPMeter:
    """Bytes sent and steps run by this process while open (see :func:`cp_meter`).

    Example::

        >>> m = CPMeter()
        >>> m.messages.append(("forward", "ring", 64))
        >>> m.bytes("forward"), m.bytes("backward"), m.count()
        (64, 0, 1)
    """

    messages: list[tuple[str, str, int]] = field(default_factory=list)
    steps: list[CPStep] = field(default_factory=list)

    def bytes(self, phase: str | None = None) -> int:
        """Bytes sent by this rank (``phase``: ``"forward"`` / ``"backward"``; ``None``: both)."""
        return sum(n for p, _, n in self.messages if phase is None or p == phase)

    def count(self, phase: str | None = None) -> int:
        """Messages sent by this rank (an all-to-all counts once)."""
        return sum(1 for p, _, _ in self.messages if phase is None or p == phase)

    def work(self, phase: str = "forward") -> int:
        """Score entries this rank computed in ``phase``."""
        return sum(s.work for s in self.steps if s.phase == phase)

    def compute_seconds(self, phase: str = "forward", *, cpu: bool = False) -> float:
        """Seconds this rank spent computing attention tiles in ``phase`` (wall, or its thread's CPU
        time with ``cpu=True`` — the fairer measure when more ranks than cores take turns)."""
        return sum(s.compute_cpu if cpu else s.compute_end - s.compute_start for s in self.steps if s.phase == phase)


def ring_traces(meters, phase: str = "forward") -> tuple[Trace, Trace]:
    """Two :class:`gc.Trace` s from every rank's meter: the compute of each step, the message in flight.

    Draw them with ``gc.plot_timelines([compute, comm])``: one row per rank and kind, one bar per
    step. A message bar that lies under a compute bar is hidden behind the computation.

    Example::

        >>> m = CPMeter(steps=[CPStep("forward", 0, 0, 1, 0.0, 2.0, 2.0, 0.0, 1.0)])
        >>> compute, comm = ring_traces([m])
        >>> [(r.worker, r.wall) for r in compute], [(r.worker, r.wall, r.cpu) for r in comm]
        ([(0, 2.0)], [(0, 1.0, 0.0)])
    """
    compute, comm = Trace(f"{phase} compute"), Trace(f"{phase} K/V in flight")
    for rank, meter in enumerate(meters):
        for s in (s for s in meter.steps if s.phase == phase):
            compute.add(ChunkRecord(s.step, rank, s.compute_start, s.compute_end, s.compute_cpu))
            if s.comm_end > s.comm_start:
                comm.add(ChunkRecord(s.step, rank, s.comm_start, s.comm_end, 0.0))
    return compute, comm


@contextlib.contextmanager
def cp_meter():
    """Count the bytes and time the steps of every ring / Ulysses attention run inside the block.

    Example::

        >>> import torch, gpucourse as gc
        >>> q = torch.randn(1, 2, 8, 4)
        >>> with gc.cp_meter() as m:
        ...     _ = gc.ring_attention(q, q, q)       # one process: nothing to send
        >>> m.bytes(), len(m.steps)
        (0, 1)

    .. warning::
        It counts this process only; with a causal contiguous ring the ranks differ in work, so
        gather every rank's meter (return it from the function ``gc.launch`` runs).
    """
    meter = CPMeter()
    _OPEN.append(meter)
    try:
        yield meter
    finally:
        _OPEN.remove(meter)


def record_message(phase: str, op: str, nbytes: int) -> None:
    for m in _OPEN:
        m.messages.append((phase, op, int(nbytes)))


def record_step(step: CPStep) -> None:
    for m in _OPEN:
        m.steps.append(step)


class _Pending:
    """A message in flight: ``wait()`` returns the received tensor and the time it arrived."""

    def __init__(self, works, buffer, started):
        self.works, self.buffer, self.started, self.finished = works, buffer, started, None

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.finished = time.perf_counter()
        return self.buffer


def ring_exchange(tensor: torch.Tensor, group, phase: str, *, tag: int = 0) -> _Pending:
    """Post "send ``tensor`` to rank+1, receive the same shape from rank−1"; returns at once."""
    rank, size, to_global = group_info(group)
    tensor = tensor.contiguous()                        # gloo reads memory order: never send a view
    buffer = torch.empty_like(tensor)
    nxt, prv = to_global((rank + 1) % size), to_global((rank - 1) % size)
    started = time.perf_counter()
    if rank % 2 == 0:
        works = [dist.isend(tensor, nxt, group=group, tag=tag), dist.irecv(buffer, prv, group=group, tag=tag)]
    else:
        works = [dist.irecv(buffer, prv, group=group, tag=tag), dist.isend(tensor, nxt, group=group, tag=tag)]
    record_message(phase, "ring", tensor.numel() * tensor.element_size())
    pending = _Pending(works, buffer, started)
    pending.sent = tensor                               # keep the send buffer alive until wait()
    return pending


def agree_on_shards(facts: list[int], problem: str | None, group, what: str) -> None:
    """Every rank of ``group`` sends ``(ok, *facts)``; all raise ``ValueError`` if any rank's differ.

    ``problem`` is this rank's own complaint about its input (or ``None``); the other ranks learn
    only that rank ``r`` had one, and raise too — instead of waiting for its messages forever.
    """
    if not dist.is_initialized():
        if problem:
            raise ValueError(problem)
        return
    _, size, _ = group_info(group)
    if size == 1:
        if problem:
            raise ValueError(problem)
        return
    mine = torch.tensor([0 if problem is None else 1, *facts], dtype=torch.int64, device=rank_device(group))
    views = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(views, mine, group=group)
    views = [v.cpu() for v in views]
    bad = [r for r, v in enumerate(views) if v[0] != 0]
    if problem:
        raise ValueError(f"{what}: {problem}")
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} of the group passed invalid input (see their error)")
    rows = [tuple(v[1:].tolist()) for v in views]
    if len(set(rows)) > 1:
        raise ValueError(f"{what}: every rank must pass shards of one shape (batch, heads, kv heads, "
                         f"shard length, head_dim, causal, layout); got "
                         + ", ".join(f"{row} on rank {r}" for r, row in enumerate(rows)))
