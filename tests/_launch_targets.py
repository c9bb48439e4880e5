"""Importable per-rank functions for the launcher tests (spawn, and scripts run by torchrun, can
only start importable ones)."""

import torch
import torch.distributed as dist

import gpucourse as gc


def rank_sum(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def join_env_twice(rank=None, world_size=None):
    """Join through env:// with checked_init_process_group, all-reduce, leave; twice."""
    sums = []
    for _ in range(2):
        gc.checked_init_process_group("gloo", join_timeout=20)
        t = torch.ones(1)
        dist.all_reduce(t)
        sums.append(t.item())
        dist.destroy_process_group()
    return sums
