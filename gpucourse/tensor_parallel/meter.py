"""Count what tensor parallelism communicates: every collective of this part reports here.

The autograd functions (``autograd_ops``, ``vocab``) call :func:`record` right after each
collective; a :class:`CommMeter` opened with ``with comm_meter() as m:`` collects the records made
in this process while it is open. Nothing is recorded when no meter is open.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["CommMeter", "CommRecord", "comm_meter"]

_OPEN: list[CommMeter] = []          # meters open in this process (innermost last)


@dataclass(frozen=True)
class CommRecord:
    """One collective: ``op`` (``"all_reduce"``, ``"all_gather"``), where it ran, its payload.

    ``nbytes`` is the tensor each rank hands to the collective (for an all-gather: the gathered
    result, ``copies ×`` the shard), not what a ring algorithm sends on the wire.
    """

    op: str
    site: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class CommMeter:
    """The collectives recorded while open (see :func:`comm_meter`).

    Example::

        >>> m = CommMeter()
        >>> m.records.append(CommRecord("all_reduce", "g.forward", (2, 4), 32))
        >>> m.bytes("all_reduce"), m.count("all_reduce"), m.bytes(site="f.backward")
        (32, 1, 0)
    """

    records: list[CommRecord] = field(default_factory=list)

    def _select(self, op, site):
        return [r for r in self.records if (op is None or r.op == op)
                and (site is None or r.site == site or (isinstance(site, tuple) and r.site in site))]

    def bytes(self, op: str | None = None, site: str | tuple[str, ...] | None = None) -> int:
        """Total payload bytes of the matching records (all of them by default)."""
        return sum(r.nbytes for r in self._select(op, site))

    def count(self, op: str | None = None, site: str | tuple[str, ...] | None = None) -> int:
        """How many matching collectives ran."""
        return len(self._select(op, site))

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(op, site): (count, bytes)}``."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for r in self.records:
            c, b = out.get((r.op, r.site), (0, 0))
            out[(r.op, r.site)] = (c + 1, b + r.nbytes)
        return out


@contextlib.contextmanager
def comm_meter():
    """Record every tensor-parallel collective this process runs inside the ``with`` block.

    Example::

        >>> with comm_meter() as m:
        ...     pass                       # run tensor-parallel forward/backward here
        >>> m.bytes()
        0

    .. warning::
        It counts this process only. In tensor parallelism every rank of a group runs the same
        collectives, so one rank's count is the group's per-rank count.
    """
    meter = CommMeter()
    _OPEN.append(meter)
    try:
        yield meter
    finally:
        _OPEN.remove(meter)


def record(op: str, site: str, tensor: torch.Tensor, copies: int = 1) -> None:
    """Called by the collectives of this part right after they ran."""
    if _OPEN:
        rec = CommRecord(op, site, tuple(tensor.shape), tensor.numel() * tensor.element_size() * copies)
        for meter in _OPEN:
            meter.records.append(rec)
