"""Model splitting: the balanced partition is optimal, stages are the model's own layers."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpucourse as gc


def _brute_force_best(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])))
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_partition_is_optimal(costs, k):
    if k > len(costs):
        with pytest.raises(ValueError, match="every stage needs at least one layer"):
            gc.balanced_partition(costs, k)
        return
    sizes = gc.balanced_partition(costs, k)
    assert len(sizes) == k and sum(sizes) == len(costs) and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    assert worst == _brute_force_best(costs, k)


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_balanced_partition_rejects_bad_stage_counts(bad, err):
    with pytest.raises(err, match="num_stages"):
        gc.balanced_partition([1, 2, 3], bad)


def test_balanced_partition_rejects_negative_costs():
    with pytest.raises(ValueError, match="costs must be >= 0"):
        gc.balanced_partition([1, -2, 3], 2)


def _model(n_linear=5, width=6):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_linear):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 10])
def test_split_by_count_is_even_and_keeps_layers(num_stages):
    model = _model()
    stages = gc.split_sequential(model, num_stages)
    sizes = [len(s) for s in stages]
    assert sum(sizes) == len(model) and max(sizes) - min(sizes) <= 1
    assert [m for s in stages for m in s] == list(model)           # same objects, same order
    state = {k: v for s in stages for k, v in s.state_dict().items()}
    assert state.keys() == model.state_dict().keys()                # names kept: '2.weight'
    x = torch.randn(3, 6)
    y = x
    for s in stages:
        y = s(y)
    torch.testing.assert_close(y, model(x))


def test_split_works_for_sequential_subclasses():
    mlp = gc.MLP(4, 8, 8, 2)                      # MLP(...)[a:b] itself cannot be sliced
    stages = gc.split_sequential(mlp, 2)
    x = torch.randn(5, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), mlp(x))


def test_split_by_params_balances_parameters():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2), nn.Linear(2, 2),
                          nn.Linear(2, 2))
    stages = gc.split_sequential(model, 2, by="params")
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert counts == [100 * 100 + 100, 202 + 6 + 6]      # the big layer alone (with the free ReLU or not)


def test_split_by_time_needs_a_sample_and_returns_valid_split():
    model = _model(4, 32)
    with pytest.raises(ValueError, match="sample="):
        gc.split_sequential(model, 2, by="time")
    stages = gc.split_sequential(model, 2, by="time", sample=torch.randn(16, 32))
    assert sum(len(s) for s in stages) == len(model) and len(stages) == 2
    assert all(p.grad is None for p in model.parameters())        # timing left no gradients


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_stages=11), "cannot cut 10 layers into 11 stages"),
    (dict(balance=[3, 3]), "covers 6 layers, but the model has 10"),
    (dict(balance=[0, 10]), "positive ints"),
    (dict(), "num_stages"),
    (dict(num_stages=2, by="flops"), "by must be"),
])
def test_split_rejects_bad_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gc.split_sequential(_model(), **kwargs)


def test_split_rejects_non_sequential():
    with pytest.raises(TypeError, match="nn.Sequential"):
        gc.split_sequential(gc.Net(), 2)


def test_model_parallel_and_two_device_toy_match_single_device():
    torch.manual_seed(0)
    model = _model(3)
    ref = _model(3)
    mp = gc.ModelParallel(gc.split_sequential(model, 2), ["cpu", "cpu"])
    x = torch.randn(4, 6)
    mp(x).square().sum().backward()
    ref(x).square().sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    with pytest.raises(ValueError, match="one device per stage"):
        gc.ModelParallel(gc.split_sequential(model, 2), ["cpu"])

    torch.manual_seed(1)
    toy = gc.TwoDeviceToyModel("cpu", "cpu")
    torch.manual_seed(1)
    plain = gc.ToyModel()
    x = torch.randn(7, 10)
    torch.testing.assert_close(toy(x), plain(x))


def test_training_state_bytes():
    assert gc.training_state_bytes(10, optimizer="sgd") == {
        "weights": 40, "gradients": 40, "optimizer": 0, "total": 80}
    assert gc.training_state_bytes(10, param_bytes=2, optimizer="sgd_momentum")["total"] == 60
    with pytest.raises(ValueError, match="optimizer must be one of"):
        gc.training_state_bytes(10, optimizer="lion")
    with pytest.raises(ValueError, match="num_params"):
        gc.training_state_bytes(-1)
