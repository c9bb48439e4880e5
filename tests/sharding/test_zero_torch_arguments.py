"""gc.ZeroOptimizer takes ZeroRedundancyOptimizer's own arguments (process_group,
parameters_as_bucket_view, overlap_with_ddp) and never passes them on to the inner optimizer."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3))


def _run(rank, world_size, view, positional):
    group = dist.new_group(list(range(world_size)))                # not the default group
    g = torch.Generator().manual_seed(40 + rank)                   # different data per rank
    data = [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)) for _ in range(3)]
    ref = DDP(_net(1), process_group=group)
    ref_opt = ZeroRedundancyOptimizer(ref.parameters(), torch.optim.AdamW, process_group=group,
                                      parameters_as_bucket_view=view, lr=0.05, weight_decay=0.1)
    mine = _net(1)
    if positional:
        opt = gc.ZeroOptimizer(mine.parameters(), torch.optim.AdamW, group, view, lr=0.05, weight_decay=0.1)
    else:
        opt = gc.ZeroOptimizer(mine.parameters(), torch.optim.AdamW, process_group=group,
                               parameters_as_bucket_view=view, lr=0.05, weight_decay=0.1)
    for x, y in data:
        for model, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
    same = all(torch.equal(a, b) for a, b in zip(ref.module.parameters(), mine.parameters()))
    return same, opt.group is group


@pytest.mark.parametrize("view,positional", [(False, False), (True, False), (True, True)])
def test_process_group_and_parameters_as_bucket_view_as_zero_redundancy_optimizer(view, positional):
    for same, group_used in gc.launch(_run, 2, args=(view, positional), timeout=120):
        assert same and group_used


def _refused(rank, world_size):
    errors = []
    for kw in (dict(overlap_with_ddp=True), dict(process_group=dist.group.WORLD, group=dist.new_group([0, 1])),
               dict(parameters_as_bucket_view="yes")):
        try:
            gc.ZeroOptimizer(_net(0).parameters(), torch.optim.AdamW, lr=0.1, **kw)
            errors.append(None)
        except (NotImplementedError, TypeError) as e:
            errors.append((type(e).__name__, str(e)))
    return errors


def test_what_zero_optimizer_does_not_implement_is_refused():
    overlap, both, bad_view = gc.launch(_refused, 2, timeout=60)[0]
    assert overlap[0] == "NotImplementedError" and "overlap_with_ddp" in overlap[1]
    assert both[0] == "TypeError" and "process_group" in both[1]
    assert bad_view[0] == "TypeError" and "parameters_as_bucket_view" in bad_view[1]
