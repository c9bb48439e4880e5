"""Fail fast and together: the checks that turn a would-be hang into a ``ValueError`` on every rank.

A collective whose ranks disagree (different tensor shapes, different groups) does not fail on
gloo: it waits, or reads garbage. So before the first collective the ranks exchange what they
are about to do, in a small message every rank receives, and every rank applies the same test to
the same data — they all raise the same ``ValueError``, or none does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["group_layout", "agree_across_ranks", "check_same_shape"]

_MAX_DIMS = 8


def group_layout(group) -> tuple[int, int, tuple[int, ...]]:
    """``(rank in group, group size, global ranks of the group)``; one process: ``(0, 1, (0,))``."""
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised "
                             "(call dist.init_process_group, or run under gc.launch)")
        return 0, 1, (0,)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the group it passed "
                         f"(members {dist.get_process_group_ranks(group)}); pass a group this rank belongs to")
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
    return rank, size, ranks


def agree_across_ranks(group, what: str, facts: dict) -> None:
    """Every rank of the job checks that the members of each group agree on ``facts``.

    A collective over the *default* group (``all_gather_object``): every rank must call it, in the
    same order, like ``dist.new_group``. Each rank sends (its view of its group's members, its
    ``facts``); every rank then checks every group, so a mismatch anywhere raises everywhere.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else \
            tuple(range(dist.get_world_size()))
    except (ValueError, RuntimeError):
        members = ()
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (members, facts))
    problems = []
    for r, (ranks, facts_r) in enumerate(views):
        if r not in ranks:
            problems.append(f"rank {r} passed a group it is not a member of (members {list(ranks)})")
            continue
        for m in ranks:
            other_ranks, other_facts = views[m]
            if other_ranks != ranks:
                problems.append(f"rank {r} passed the group {list(ranks)} but rank {m} passed {list(other_ranks)}")
            elif other_facts != facts_r:
                diff = {k: (facts_r.get(k), other_facts.get(k)) for k in facts_r.keys() | other_facts.keys()
                        if facts_r.get(k) != other_facts.get(k)}
                problems.append(f"ranks {r} and {m} disagree on {what}: "
                                + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in sorted(diff.items())))
    if problems:
        raise ValueError(f"{what}: the ranks do not agree — " + "; ".join(sorted(set(problems))[:4]))


def check_same_shape(x: torch.Tensor, group, name: str) -> None:
    """All ranks of ``group`` pass ``x`` of one shape, or every rank raises ``ValueError``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"{name} has {x.dim()} dimensions; at most {_MAX_DIMS} are supported")
    mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=x.device)   # NCCL: on the GPU
    mine[0] = x.dim()
    mine[1:1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64, device=x.device)
    shapes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shapes, mine, group=group)
    as_tuples = [tuple(s[1:1 + int(s[0])].tolist()) for s in shapes]
    if len(set(as_tuples)) > 1:
        raise ValueError(f"{name} must have the same shape on every rank of the group, got "
                         + ", ".join(f"{s} on rank {r}" for r, s in enumerate(as_tuples)))
