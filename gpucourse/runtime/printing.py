"""Rank-aware printing: output from several processes that is readable and in rank order.

``print`` in every rank interleaves lines at random (each process writes whenever it gets there).
Two fixes, both used in torchrun scripts (:func:`~gpucourse.launch` already groups output by rank):

* :func:`print0` — only rank 0 prints (progress, final results);
* :func:`print_ordered` — a *collective*: every rank passes its text, rank 0 prints all of them in
  rank order. Like every collective, all ranks of the group must call it.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["print0", "print_ordered", "rank_prefix"]


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def rank_prefix(group=None) -> str:
    """``"[rank r] "`` inside a process group, ``""`` outside one.

    Example::

        >>> rank_prefix()   # no process group in this process
        ''
    """
    return f"[rank {_rank(group)}] " if dist.is_available() and dist.is_initialized() else ""


def print0(*args, group=None, **kwargs) -> None:
    """``print`` on rank 0 only (and normally when no process group exists).

    Example::

        >>> print0("epoch 1: loss 0.53")
        epoch 1: loss 0.53
    """
    if _rank(group) == 0:
        print(*args, **kwargs, flush=True)


def print_ordered(*args, group=None, sep: str = " ") -> None:
    """Collective print: rank 0 prints every rank's message, prefixed and in rank order.

    Every rank of ``group`` must call it (it uses ``all_gather_object``); outside a process group
    it is a plain ``print``.

    Example::

        >>> print_ordered("loss", 0.25)
        loss 0.25
    """
    text = sep.join(str(a) for a in args)
    if not (dist.is_available() and dist.is_initialized()):
        print(text, flush=True)
        return
    texts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    if dist.get_rank(group) == 0:
        for r, t in enumerate(texts):
            print(f"[rank {r}] {t}", flush=True)


def in_kernel() -> bool:
    """True inside an IPython kernel (a notebook): explorers display themselves only there."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None
