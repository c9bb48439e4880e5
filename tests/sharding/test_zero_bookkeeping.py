"""ZeroOptimizer's bookkeeping: per-rank checkpoints reload exactly, the wrong slice is refused, and
add_param_group (unfreezing layers mid-run) trains like torch.optim with the same group added."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpucourse as gc

STEPS = 4


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 7), nn.GELU(), nn.Linear(7, 4))
    model[0].requires_grad_(False)
    return model


def groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.01}]


def train(model, opt, rank, world_size, steps, average=False):
    for step in steps:
        g = torch.Generator().manual_seed(300 + step)
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        F.mse_loss(model(x), y).backward()
        if average:                                     # the reference: plain data parallelism
            gc.average_gradients(model)
        opt.step()
        opt.zero_grad()


def _per_rank_checkpoint(rank, world_size, stage):
    model = make_model()
    opt = gc.ZeroOptimizer(groups(model), torch.optim.AdamW, stage=stage, lr=0.02)
    train(model, opt, rank, world_size, range(2))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.shard_state_dict())  # this rank's slice
    train(model, opt, rank, world_size, range(2, STEPS))

    resumed = make_model()
    resumed.load_state_dict(saved_model)
    opt2 = gc.ZeroOptimizer(groups(resumed), torch.optim.AdamW, stage=stage, lr=0.5)
    opt2.load_state_dict(saved_opt)
    lrs = [g["lr"] for g in opt2.param_groups]          # from the checkpoint, group by group
    train(resumed, opt2, rank, world_size, range(2, STEPS))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

    errors = []
    other = {**saved_opt, "zero_shard": {**saved_opt["zero_shard"], "rank": 1 - rank}}
    one_group = gc.ZeroOptimizer([p for p in make_model().parameters() if p.requires_grad], torch.optim.AdamW)
    for target, state in ((opt2, other), (one_group, saved_opt), (opt2, {"state": {}, "param_groups": []})):
        try:
            target.load_state_dict(state)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return same, lrs, errors


@pytest.mark.parametrize("stage", [1, 2])
def test_each_rank_reloads_its_own_slice_exactly(stage):
    for same, lrs, errors in gc.launch(_per_rank_checkpoint, 2, args=(stage,), timeout=120):
        assert same and lrs == [0.02, 0.01]
        assert "rank 1 of 2" in errors[0] or "rank 0 of 2" in errors[0]      # another rank's slice
        assert "other parameters" in errors[1]                              # another layout
        assert "parameter group" in errors[2]                               # not a state at all


def _unfreeze_mid_run(rank, world_size, stage):
    runs = {}
    for name in ("ours", "reference"):
        model = make_model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = (gc.ZeroOptimizer(trainable, torch.optim.AdamW, stage=stage, lr=0.02, weight_decay=0.1)
               if name == "ours" else torch.optim.AdamW(trainable, lr=0.02, weight_decay=0.1))
        train(model, opt, rank, world_size, range(2), average=name == "reference")
        model[0].requires_grad_(True)                   # fine-tuning: unfreeze the first layer
        opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.005})
        train(model, opt, rank, world_size, range(2, STEPS), average=name == "reference")
        if name == "ours":
            opt.consolidate_state_dict(to=0)
        runs[name] = ([p.detach().clone() for p in model.parameters()],
                      opt.state_dict() if name != "ours" or rank == 0 else None)   # consolidated on rank 0
    return runs


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group_trains_like_torch_optim(stage):
    results = gc.launch(_unfreeze_mid_run, 2, args=(stage,), timeout=120)
    for runs in results:
        (ours, _), (ref, _) = runs["ours"], runs["reference"]
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))    # 2 ranks: bit for bit
        assert not torch.equal(ours[0], make_model()[0].weight)      # the unfrozen layer trained
    (_, state), (_, ref_state) = results[0]["ours"], results[0]["reference"]
    assert state["param_groups"] == ref_state["param_groups"]
    for i, s in ref_state["state"].items():
        for key, v in s.items():
            assert torch.equal(state["state"][i][key], v), (i, key)


def test_a_plain_optimizers_state_loads_on_any_number_of_ranks():
    """One process trained with AdamW on two groups; its state_dict() loads into ZeroOptimizer on 3
    ranks, and consolidating it again gives back the same state."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=0.02)
    train(model, opt, 0, 1, range(2))
    state = opt.state_dict()
    back = gc.launch(_load_and_consolidate, 3, args=(model.state_dict(), state), timeout=120)[0]
    assert back["param_groups"] == state["param_groups"]
    assert back["state"].keys() == state["state"].keys()
    for i, s in state["state"].items():
        for key, v in s.items():
            assert torch.equal(back["state"][i][key], v), (i, key)


def _load_and_consolidate(rank, world_size, model_state, state):
    model = make_model()
    model.load_state_dict(model_state)
    opt = gc.ZeroOptimizer(groups(model), torch.optim.AdamW, lr=0.5)
    opt.load_state_dict(state)
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if rank == 0 else None          # the whole state, on rank 0 only
