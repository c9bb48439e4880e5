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
    shard_state = sum(v.numel() * v.element_size() for v in zero.state[zero.shard].values() if v.dim() > 0)
    full_state = sum(v.numel() * v.element_size() for s in ddp_opt.state.values() for v in s.values()
                     if v.dim() > 0)
    return (model.state_dict(), ddp.module.state_dict(), zero.state_dict(), ddp_opt.state_dict(),
            shard_state, full_state)


@pytest.mark.parametrize("world_size, stage, opt_name, accumulation", [
    (2, 1, "adamw", 1), (2, 2, "adamw", 1), (3, 1, "sgd_momentum", 1), (3, 2, "adamw", 1),
    (2, 2, "sgd_momentum", 2), (2, 1, "adamw", 2), (1, 2, "adamw", 1)])
def test_equals_ddp(world_size, stage, opt_name, accumulation):
    results = gc.launch(_vs_ddp, world_size, args=(stage, opt_name, 4, accumulation), timeout=120)
    for model_sd, ddp_sd, zero_osd, ddp_osd, shard_state, full_state in results:
        for k, v in ddp_sd.items():
            torch.testing.assert_close(model_sd[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        # the consolidated optimizer state is torch.optim's, value for value
        assert zero_osd["param_groups"] == ddp_osd["param_groups"]
        assert zero_osd["state"].keys() == ddp_osd["state"].keys()
        for i, s in ddp_osd["state"].items():
            for key, v in s.items():
                torch.testing.assert_close(zero_osd["state"][i][key], v, atol=1e-6, rtol=1e-5)
        # each rank holds ~1/N of the optimizer state (plus at most N-1 padding elements)
        n = sum(p.numel() for p in make_model().parameters())
        per_element = full_state // n
        assert shard_state == per_element * -(-n // world_size)
    assert all(torch.equal(results[0][0][k], r[0][k]) for r in results for k in results[0][0])


def _save(rank, world_size, stage, path):
    model = make_model()
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.02, weight_decay=0.1)
    _train_zero(model, opt, rank, world_size, 3)
    osd = opt.state_dict()                         # a collective: every rank calls it
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": osd}, path)
    dist.barrier()
    return osd


def _resume(rank, world_size, stage, path):
    ckpt = torch.load(path, weights_only=True)
    model = make_model()
    model.load_state_dict(ckpt["model"])
    opt = gc.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.5)
    opt.load_state_dict(ckpt["optimizer"])
    roundtrip = opt.state_dict()
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
    for model_sd, roundtrip, lr in results:
        assert lr == 0.02                          # hyper-parameters come from the checkpoint
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
    with pytest.raises(ValueError, match="no parameters"):
        gc.ZeroOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        gc.ZeroOptimizer(make_model().parameters(), "adam", lr=0.1)
    with pytest.raises(TypeError, match="parameter groups"):
        gc.ZeroOptimizer([{"params": list(make_model().parameters())}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError):
        gc.ZeroOptimizer(torch.ones(3), torch.optim.SGD, lr=0.1)


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


def test_frozen_parameters_are_refused():
    model = make_model()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        gc.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
