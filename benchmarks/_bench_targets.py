"""Importable per-rank functions for the benchmarks (torch.multiprocessing.spawn needs importable ones)."""

import datetime
import os

import torch
import torch.distributed as dist


def one_all_reduce(rank, world_size):
    """What `launch` does per rank, written by hand for spawn: join a group, all-reduce, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world_size):
    one_all_reduce(rank, world_size)


def launch_entry(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
