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


class SlowToArriveOnRank1:
    """An argument whose unpickling takes 3 s on rank 1 only: a rank that spawns late, as on a busy
    GPU machine where each spawned rank imports torch afresh."""

    def __reduce__(self):
        return (SlowToArriveOnRank1._arrive, ())

    @staticmethod
    def _arrive():
        import os
        import time

        if os.environ.get("RANK") == "1":
            time.sleep(3.0)
        return SlowToArriveOnRank1()


def join_tcp_with_a_short_timeout(rank, world_size, url, late):
    """What lesson 05 does: join through rank 0's tcp:// address with a short timeout (2 s)."""
    import datetime
    import time

    entered = time.time()
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=2))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return entered, t.item()


def join_own_tcp_group(rank, world_size, url):
    """Lesson 05's 4.1: a group of the ranks' own at rank 0's tcp:// address, not the launcher's store."""
    import datetime

    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=10))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()
