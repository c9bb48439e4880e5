"""Join: ranks with different numbers of batches finish, and match the zero-shadowing arithmetic."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2 + 2 * rank)]


def _run(rank, world_size, join):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 1))
    steps = gc.train_uneven(model, _batches(rank), join=join, lr=0.1)
    return steps, [p.detach().clone() for p in model.module.parameters()]


def _reference():
    """One process: at step i the gradient is (sum of the ranks that still have batch i) / 2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank = [_batches(0), _batches(1)]
    for i in range(4):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(b[i][0]), b[i][1]) for b in per_rank if i < len(b))
        (loss / 2).backward()
        opt.step()
    return list(model.parameters())


def test_join_completes_and_matches_reference():
    (s0, p0), (s1, p1) = gc.launch(_run, 2, args=(True,), timeout=60)
    assert (s0, s1) == (2, 4)
    for a, b, r in zip(p0, p1, _reference()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r.detach())


def test_without_join_hangs_until_the_timeout():
    with pytest.raises((TimeoutError, gc.WorkerError)):
        gc.launch(_run, 2, args=(False,), timeout=4)
