"""zero_memory follows the ZeRO paper's formulas (Figure 1 included); the per-rank meter counts
real tensors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gpucourse as gc


def test_paper_figure_1():
    psi, n = 7_500_000_000, 64
    got = [gc.zero_memory(psi, n, stage) / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


@given(psi=st.integers(0, 10**12), n=st.integers(1, 4096), k=st.integers(0, 16))
def test_formulas(psi, n, k):
    expected = [(2 + 2 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (2 + 2 + k) * psi / n]
    for stage, e in enumerate(expected):
        got = gc.zero_memory(psi, n, stage, k=k)
        assert isinstance(got, int)
        assert abs(got - e) <= 1 + 1e-12 * e
        assert sum(gc.zero_memory_parts(psi, n, stage, k=k).values()) == pytest.approx(e)
    if n > 1 and psi > 0:            # each stage saves memory
        assert expected[0] >= expected[1] > expected[2] > expected[3]


def test_one_rank_shards_nothing():
    assert len({gc.zero_memory(1000, 1, s) for s in range(4)}) == 1


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_params=-1, world_size=2, stage=1), ValueError),
    (dict(num_params=10, world_size=0, stage=1), ValueError),
    (dict(num_params=10, world_size=2, stage=4), ValueError),
    (dict(num_params=1.5, world_size=2, stage=1), TypeError),
    (dict(num_params=10, world_size=2, stage=1, k=-1), ValueError),
])
def test_bad_input(kwargs, error):
    with pytest.raises(error):
        gc.zero_memory(**kwargs)


def test_measure_step_memory_counts_parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 50), nn.ReLU(), nn.Linear(50, 7))
    n = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(16, 30), torch.randn(16, 7)
    for opt, state in [(torch.optim.SGD(model.parameters(), lr=0.1), 0),
                       (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 4 * n),
                       (torch.optim.AdamW(model.parameters()), 8 * n + 4 * 4)]:
        m = gc.measure_step_memory(model, opt, x, y)
        assert (m.parameters, m.gradients, m.optimizer_state) == (4 * n, 4 * n, state)
        # the forward keeps at least the first layer's input activations (ReLU output, 16 x 50)
        assert m.activations >= 16 * 50 * 4
        assert m.peak >= m.activations
        assert all(p.grad is None for p in model.parameters())      # the step ends with zero_grad


@pytest.mark.cuda
def test_measure_step_memory_on_cuda_reads_the_allocator():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    m = gc.measure_step_memory(model, opt, torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda"))
    assert (m.parameters, m.gradients) == (4 * n, 4 * n)
    assert m.activations >= 32 * 256 * 4 and m.peak >= m.activations
