"""Chapter 11's expert parallelism on a GPU: routing, the counts' all-gather and the all-to-alls over
NCCL on ``cuda:<rank>``. A world of one (one GPU holds one NCCL rank), against the dense MoE on the CPU.
"""

import pytest
import torch

import gpucourse as gc

pytestmark = pytest.mark.cuda


def _ep(rank, world_size, x):
    dev = gc.rank_device()
    torch.manual_seed(0)
    ep = gc.expert_parallel(gc.MoE(16, 32, num_experts=5, top_k=2).to(dev))
    xs = x.to(dev).requires_grad_()
    y = ep(xs)
    y.square().sum().backward()
    return y.device.type, y.detach().cpu(), xs.grad.cpu(), ep.send_counts


def test_expert_parallel_on_cuda_equals_the_dense_layer():
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    ((device, y, grad, send),) = gc.launch(_ep, 1, args=(x,), backend="nccl", timeout=120)
    torch.manual_seed(0)
    dense = gc.MoE(16, 32, num_experts=5, top_k=2)
    xd = x.clone().requires_grad_()
    ref = dense(xd)
    ref.square().sum().backward()
    assert device == "cuda" and send == [9 * 2]
    torch.testing.assert_close(y, ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, xd.grad, rtol=1e-4, atol=1e-5)
