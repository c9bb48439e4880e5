"""One run six ways: the from-scratch ZeRO stages, torch's ZeroRedundancyOptimizer and FSDP2 all equal DDP."""

import pytest
import torch
from torch import nn

import gpucourse as gc


def make_model():
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.LayerNorm(10), nn.Linear(10, 10), nn.Tanh(),
                         nn.Linear(10, 2))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g)


@pytest.fixture(scope="module")
def ddp_run():
    x, y = _data()
    return gc.train_sharded("ddp", make_model, x, y, world_size=2, steps=4, lr=0.02, measure_memory=True)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "torch_zero", "fsdp2"])
def test_strategies_equal_ddp(ddp_run, strategy):
    x, y = _data()
    run = gc.train_sharded(strategy, make_model, x, y, world_size=2, steps=4, lr=0.02, measure_memory=True)
    assert run.state_dict.keys() == ddp_run.state_dict.keys()
    for k, v in ddp_run.state_dict.items():
        torch.testing.assert_close(run.state_dict[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert run.losses == pytest.approx(ddp_run.losses, rel=1e-5)
    assert run.losses[-1] < run.losses[0]
    ddp_mem = ddp_run.memory[0]
    for mem in run.memory:             # every sharded strategy holds about half DDP's optimizer state
        assert mem.optimizer_state < 0.62 * ddp_mem.optimizer_state
    if strategy in ("zero2", "zero3", "fsdp2"):
        assert run.memory[0].gradients < 0.62 * ddp_mem.gradients
    if strategy in ("zero3", "fsdp2"):
        assert run.memory[0].parameters < 0.62 * ddp_mem.parameters
    assert len(run.step_times) == 2 and len(run.step_times[0]) == 3


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_gradient_accumulation_equals_ddp_no_sync(strategy):
    x, y = _data()
    ref = gc.train_sharded("ddp", make_model, x, y, world_size=2, steps=3, accumulation=2, lr=0.02)
    run = gc.train_sharded(strategy, make_model, x, y, world_size=2, steps=3, accumulation=2, lr=0.02)
    for k, v in ref.state_dict.items():
        torch.testing.assert_close(run.state_dict[k], v, atol=1e-6, rtol=1e-5)


def test_bad_arguments():
    x, y = _data()
    with pytest.raises(ValueError, match="strategy"):
        gc.train_sharded("zero4", make_model, x, y)
    with pytest.raises(ValueError, match="accumulation"):
        gc.train_sharded("fsdp2", make_model, x, y, accumulation=2)
