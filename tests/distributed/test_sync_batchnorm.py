"""sync_batch_stats equals the statistics of the concatenated batch (what SyncBatchNorm uses)."""

import pytest
import torch
from torch import nn

import gpucourse as gc


def _slices(world_size, seed):
    g = torch.Generator().manual_seed(seed)
    # uneven slice sizes per rank, 4-D activations with an offset per channel
    return [torch.randn(r + 2, 3, 4, 5, generator=g) + torch.arange(3.0).view(1, 3, 1, 1)
            for r in range(world_size)]


def _worker(rank, world_size, seed):
    return gc.sync_batch_stats(_slices(world_size, seed)[rank])


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_statistics_equal_those_of_the_whole_batch(world_size):
    results = gc.launch(_worker, world_size, args=(7,), timeout=60)
    whole = torch.cat(_slices(world_size, 7))
    bn = nn.BatchNorm2d(3, momentum=1.0)        # momentum 1: running stats = this batch's stats
    bn(whole)
    n = whole.numel() / 3
    for mean, var in results:
        torch.testing.assert_close(mean, whole.mean((0, 2, 3)))
        torch.testing.assert_close(var, whole.var((0, 2, 3), unbiased=False))
        torch.testing.assert_close(mean, bn.running_mean)
        torch.testing.assert_close(var * n / (n - 1), bn.running_var)   # BN stores the unbiased one


def test_without_a_group_and_bad_input():
    x = torch.randn(5, 2)
    mean, var = gc.sync_batch_stats(x)
    torch.testing.assert_close(mean, x.mean(0))
    torch.testing.assert_close(var, x.var(0, unbiased=False))
    with pytest.raises(ValueError, match=r"shape \(N, C, ...\)"):
        gc.sync_batch_stats(torch.randn(5))
    with pytest.raises(TypeError, match="floating-point"):
        gc.sync_batch_stats(torch.ones(2, 2, dtype=torch.int64))


def _channels_differ(rank, world_size):
    x = torch.randn(4, 3 + rank)              # rank 1 has one channel more
    try:
        gc.sync_batch_stats(x)
    except ValueError as e:
        return str(e)
    return None


def test_channels_differing_between_ranks_raise_on_every_rank():
    out = gc.launch(_channels_differ, 2, timeout=60)
    assert all(m is not None and "x.shape[1]" in m and "rank 1: 4" in m for m in out), out
