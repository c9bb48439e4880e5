"""Chapter 11's context parallelism on a GPU: ring and Ulysses attention on ``cuda:<rank>`` over NCCL.

A world of one (one GPU holds one NCCL rank), checked against SDPA on the CPU.
"""

import pytest
import torch
import torch.nn.functional as F

import gpucourse as gc

pytestmark = pytest.mark.cuda


def _attend(rank, world, q, causal):
    dev = gc.rank_device()
    mine = q.chunk(world, dim=2)[rank].to(dev).requires_grad_()
    out = {}
    for name, fn in (("ring", gc.ring_attention), ("ulysses", gc.ulysses_attention)):
        y = fn(mine, mine, mine, causal=causal)
        (grad,) = torch.autograd.grad(y.square().sum(), mine)
        out[name] = (y.device.type, y.detach().cpu(), grad.cpu())
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_ring_and_ulysses_on_cuda_equal_sdpa(causal):
    q = torch.randn(1, 4, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = q.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(full, full, full, is_causal=causal)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), full)
    (got,) = gc.launch(_attend, 1, args=(q, causal), backend="nccl", timeout=120)
    for name, (device, y, grad) in got.items():
        assert device == "cuda", name
        torch.testing.assert_close(y, ref.detach(), msg=name)
        torch.testing.assert_close(grad, ref_grad, msg=name)
