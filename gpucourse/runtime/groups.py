"""Where this process stands in a process group — the first question every collective asks."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

__all__ = ["group_info"]


def group_info(group=None) -> tuple[int, int, Callable[[int], int]]:
    """``(rank in group, group size, group rank → global rank)`` for ``group`` (``None``: the default).

    Raises a ``RuntimeError`` that says the fix when there is no process group yet, or when this
    process is not a member of ``group`` (a non-member calling a collective would wait forever).

    Example::

        >>> import gpucourse as gc
        >>> gc.launch(lambda rank, world: group_info()[:2], 2)
        [(0, 2), (1, 2)]
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group: call torch.distributed.init_process_group() first "
                           "(torchrun or gc.launch do it for you)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the given group; only its members may "
                           "call the collective")

    def global_rank(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    return rank, dist.get_world_size(group), global_rank
