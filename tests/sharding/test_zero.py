"""ZeroOptimizer (ZeRO-1/2) trains exactly like DDP + the same optimizer; its state is 1/N;
checkpoints re-shard."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc

GLOBAL_BATCH = 12             # divisible by 1, 2, 3 ranks (and by 2 micro-batches on each)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=0.02, weight_decay=0.1)),
              "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9))}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 4))   # 112 parameters


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def local(t, rank, world_size):
    return t.tensor_split(world_size)[rank]


def _train_zero(model, opt, rank, world_size, steps, first=0, accumulation=1):
    for step in range(first, first + steps):
        x, y = batch(step)
        x, y = local(x, rank, world_size), local(y, rank, world_size)
        for xm, ym in zip(x.tensor_split(accumulation), y.tensor_split(accumulation)):
            (F.mse_loss(model(xm), ym) / accumulation).backward()
        opt.step()
        opt.zero_grad()


def _vs_ddp(rank, world_size, stage, opt_name, steps, accumulation):
    cls, kw = OPTIMIZERS[opt_name]
    model = make_model()
    if rank == 1:                        # ranks start different: the optimizer must broadcast rank 0's
        with torch.no_grad():
            model[0].weight.add_(1.0)
    zero = gc.ZeroOptimizer(model.parameters(), cls, stage=stage, **kw)
    ddp = DDP(make_model())
    ddp_opt = cls(ddp.parameters(), **kw)
    _train_zero(model, zero, rank, world_size, steps, accumulation=accumulation)
    for step in range(steps):
        x, y = batch(step)
        x, y = local(x, rank, world_size), local(y, rank, world_size)
        for i, (xm, ym) in enumerate(zip(x.tensor_split(accumulation), y.tensor_split(accumulation))):
            if i < accumulation - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(xm), ym) / accumulation).backward()
            else:
                (F.mse_loss(ddp(xm), ym) / accumulation).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    shard_state = sum(v.numel() * v.element_size() for s in zero.state.values() for v in s.values() if v.dim() > 0)
    full_state = sum(v.numel() * v.element_size() for s in ddp_opt.state.values() for v in s.values()
                     if v.dim() > 0)
    zero.consolidate_state_dict(to=0)
    return (model.state_dict(), ddp.module.state_dict(), zero.state_dict() if rank == 0 else None,
            ddp_opt.state_dict(), shard_state, full_state)


@pytest.mark.parametrize("world_size, stage, opt_name, accumulation", [
    (2, 1, "adamw", 1), (2, 2, "adamw", 1), (3, 1, "sgd_momentum", 1), (3, 2, "adamw", 1),
    (2, 2, "sgd_momentum", 2), (2, 1, "adamw", 2), (1, 2, "adamw", 1)])
def test_equals_ddp(world_size, stage, opt_name, accumulation):
    results = gc.launch(_vs_ddp, world_size, args=(stage, opt_name, 4, accumulation), timeout=120)
    n = sum(p.numel() for p in make_model().parameters())
    for rank, (model_sd, ddp_sd, _, _, shard_state, full_state) in enumerate(results):
        for k, v in ddp_sd.items():
            torch.testing.assert_close(model_sd[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        # each rank holds its slice of the optimizer state: 1/N of it, the padding excluded
        start, end = gc.shard_ranges(n, world_size)[rank]
        assert shard_state == full_state // n * (min(end, n) - min(start, n))
    # the state consolidated on rank 0 is torch.optim's, value for value
    _, _, zero_osd, ddp_osd, _, _ = results[0]
    assert zero_osd["param_groups"] == ddp_osd["param_groups"]
    assert zero_osd["state"].keys() == ddp_osd["state"].keys()
    for i, s in ddp_osd["state"].items():
        for key, v in s.items():
            torch.testing.assert_close(zero_osd["state"][i][key], v, atol=1e-6, rtol=1e-5)
    assert all(torch.equal(results[0][0][k], r[0][k]) for r in results for k in results[0][0])


def _save(rank, world_size, stage, path):
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.02, weight_decay=0.1)
    _train_zero(model, opt, rank, world_size, 3)
    opt.consolidate_state_dict(to=0)               # a collective: every rank calls it
    if rank == 0:
        osd = opt.state_dict()                     # the whole state, on rank 0 only
        torch.save({"model": model.state_dict(), "optimizer": osd}, path)
    dist.barrier()
    return osd if rank == 0 else None


def _resume(rank, world_size, stage, path):
    ckpt = torch.load(path, weights_only=True)
    model = make_model()
    model.load_state_dict(ckpt["model"])
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.5)
    opt.load_state_dict(ckpt["optimizer"])
    opt.consolidate_state_dict(to=0)
    roundtrip = opt.state_dict() if rank == 0 else None    # the whole state, on rank 0 only
    _train_zero(model, opt, rank, world_size, 3, first=3)
    return model.state_dict(), roundtrip, opt.param_groups[0]["lr"]


def _single_process_reference(steps):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("stage_before, stage_after, world_after",
                         [(1, 1, 1), (2, 2, 3), (2, 1, 3), (1, 2, 1)])
def test_checkpoint_reshards(tmp_path, stage_before, stage_after, world_after):
    path = str(tmp_path / "ckpt.pt")
    saved = gc.launch(_save, 2, args=(stage_before, path), timeout=120)[0]
    results = gc.launch(_resume, world_after, args=(stage_after, path), timeout=120)
    ref = _single_process_reference(6)
    for rank, (model_sd, roundtrip, lr) in enumerate(results):
        assert lr == 0.02                          # hyper-parameters come from the checkpoint
        if rank == 0:
            for i, s in saved["state"].items():
                for key, v in s.items():
                    torch.testing.assert_close(roundtrip["state"][i][key], v)
        for k, v in ref.items():
            torch.testing.assert_close(model_sd[k], v, atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def _different_models(rank, world_size):
    model = make_model() if rank == 0 else nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 4))
    try:
        gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    except ValueError as e:
        return str(e)
    return None


def test_parameters_that_differ_across_ranks_raise_everywhere():
    msgs = gc.launch(_different_models, 2, timeout=60)
    assert all(m is not None and "same on every rank" in m for m in msgs), msgs


@pytest.mark.parametrize("stage", [0, 3, "1", None])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match="stage"):
        gc.ZeroOptimizer(make_model().parameters(), torch.optim.SGD, stage=stage, lr=0.1)


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="no parameters"):
        gc.ZeroOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        gc.ZeroOptimizer(model.parameters(), "adam", lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        gc.ZeroOptimizer(model.parameters(), nn.Linear, lr=0.1)
    with pytest.raises(TypeError, match="one tensor"):
        gc.ZeroOptimizer(torch.ones(3), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"params\[1\] must be a torch.Tensor"):
        gc.ZeroOptimizer([model[0].weight, "bias"], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\] must be a torch.Tensor"):
        gc.ZeroOptimizer([{"params": [model[0].weight]}, {"params": [3.0]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"also in param_groups\[0\].*one parameter group only"):
        gc.ZeroOptimizer([{"params": [model[0].weight, model[0].bias]}, {"params": [model[0].bias]}],
                         torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        gc.ZeroOptimizer([model[0].weight, model[0].weight], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="mixes tensors and parameter groups"):
        gc.ZeroOptimizer([model[0].weight, {"params": [model[0].bias]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="no 'params' key"):
        gc.ZeroOptimizer([{"lr": 0.1}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="set"):
        gc.ZeroOptimizer([{"params": {model[0].weight}}], torch.optim.SGD, lr=0.1)


def test_shard_ranges():
    for numel in range(40):
        for n in range(1, 7):
            ranges = gc.shard_ranges(numel, n)
            sizes = {e - s for s, e in ranges}
            assert len(sizes) == 1 and ranges[0][0] == 0
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
            assert numel <= ranges[-1][1] < numel + n
    with pytest.raises(ValueError):
        gc.shard_ranges(10, 0)


# --- a drop-in torch.optim.Optimizer: groups, a frozen layer, a scheduler -------------------------

def make_finetune_model():
    """A frozen first layer (kept, never updated) under three trainable ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 7), nn.GELU(), nn.Linear(7, 4))
    model[0].requires_grad_(False)
    return model


def param_groups(model):
    """Weight decay on matrices only, as every GPT recipe: biases and norms in a second group."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.01}]


def _three_ways(rank, world_size, stage, set_to_none, steps):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ours = make_finetune_model()
    frozen_before = ours[0].weight.detach().clone()
    runs = {"ours": (ours, gc.ZeroOptimizer(param_groups(ours), torch.optim.AdamW, stage=stage, lr=0.02))}
    ddp = DDP(make_finetune_model())
    runs["ddp"] = (ddp, torch.optim.AdamW(param_groups(ddp.module), lr=0.02))
    tz = DDP(make_finetune_model())
    runs["torch_zero"] = (tz, ZeroRedundancyOptimizer(param_groups(tz.module), torch.optim.AdamW, lr=0.02))
    schedulers = {k: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) for k, (_, opt) in runs.items()}
    history = []                                   # per step: every run's parameters and learning rates
    for step in range(steps):
        x, y = (local(t, rank, world_size) for t in batch(step))
        for name, (model, opt) in runs.items():
            F.mse_loss(model(x), y).backward()
            opt.step()
            schedulers[name].step()
            opt.zero_grad(set_to_none=set_to_none)
        history.append({name: ({k: v.clone() for k, v in getattr(m, "module", m).state_dict().items()},
                               [g["lr"] for g in opt.param_groups]) for name, (m, opt) in runs.items()})
    grads_after_zero_grad = [p.grad for p in ours.parameters()]
    states = {}
    for name in ("ours", "torch_zero"):
        runs[name][1].consolidate_state_dict(to=0)
        states[name] = runs[name][1].state_dict() if rank == 0 else None
    states["ddp"] = runs["ddp"][1].state_dict()
    return (history, states, torch.equal(ours[0].weight, frozen_before),
            [g is None for g in grads_after_zero_grad], isinstance(runs["ours"][1], torch.optim.Optimizer))


@pytest.mark.parametrize("world_size, stage, set_to_none", [(2, 1, False), (2, 2, True), (3, 1, True)])
def test_a_drop_in_for_ddp_and_zero_redundancy_optimizer(world_size, stage, set_to_none):
    """Step by step, ZeroOptimizer equals DDP + AdamW and torch's ZeroRedundancyOptimizer: bit for bit
    on 2 ranks (dividing by 2 is exact, a + b = b + a), within one rounding per step on 3."""
    results = gc.launch(_three_ways, world_size, args=(stage, set_to_none, 4), timeout=120)
    for rank, (history, states, frozen_kept, grads_none, is_optimizer) in enumerate(results):
        assert is_optimizer and frozen_kept
        # zero_grad(set_to_none=False) keeps zeroed gradients (stage 1: views into the flat buffer)
        assert grads_none == [set_to_none or not p.requires_grad for p in make_finetune_model().parameters()]
        for step, runs in enumerate(history):
            params, lrs = runs["ours"]
            for other in ("ddp", "torch_zero"):
                assert lrs == runs[other][1]               # the cosine schedule, group by group
                for k, v in runs[other][0].items():
                    if world_size == 2:
                        assert torch.equal(params[k], v), f"rank {rank} step {step} {k} vs {other}"
                    else:
                        torch.testing.assert_close(params[k], v, atol=1e-6, rtol=1e-5)
    states = results[0][1]                                  # consolidated on rank 0
    for other in ("ddp", "torch_zero"):
        assert states["ours"]["param_groups"] == states[other]["param_groups"]
        assert states["ours"]["state"].keys() == states[other]["state"].keys()   # frozen: no state
        for i, s in states[other]["state"].items():
            for key, v in s.items():
                torch.testing.assert_close(states["ours"]["state"][i][key], v, atol=1e-6, rtol=1e-5)


def _freeze_after_construction(rank, world_size):
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model[0].weight.requires_grad_(False)
    F.mse_loss(model(torch.randn(2, 5)), torch.zeros(2, 4)).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def test_changing_requires_grad_after_construction_says_what_to_do():
    msg = gc.launch(_freeze_after_construction, 1, timeout=60)[0]
    assert msg is not None and "changed requires_grad" in msg and "add_param_group" in msg


def test_all_frozen_or_mixed_dtypes_are_refused():
    model = make_model()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to optimize"):
        gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model[0].requires_grad_(True)
    model[0].bias.data = model[0].bias.data.double()
    with pytest.raises(ValueError, match="one dtype and device"):
        gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model[0].bias.requires_grad_(False)            # a frozen parameter may have its own dtype
    with pytest.raises(RuntimeError, match="no process group"):
        gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
