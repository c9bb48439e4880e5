"""Importable per-rank functions for the launcher tests (spawn can only start importable ones)."""

import torch
import torch.distributed as dist


def rank_sum(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()
