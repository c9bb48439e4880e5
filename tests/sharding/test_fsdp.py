"""FullyShardedModule (ZeRO-3): outputs and updates equal DDP's; each rank stores 1/N; one layer
gathered at a time."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc


class Scaled(nn.Module):
    """A module with a parameter of its own *and* a child, which it calls twice (shared weights)."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return self.inner(x) * self.scale + self.inner(torch.tanh(x))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.GELU(), Scaled(9), nn.LayerNorm(9), nn.Linear(9, 3))


def batch(step, n=12):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def _vs_ddp(rank, world_size, steps, keep_gathered=None):
    sharded = gc.FullyShardedModule(make_model(), keep_gathered=keep_gathered)
    opt = torch.optim.AdamW(sharded.parameters(), lr=0.03, weight_decay=0.1)
    ddp = DDP(make_model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.03, weight_decay=0.1)
    out_errors = []
    for step in range(steps):
        x, y = (t.tensor_split(world_size)[rank] for t in batch(step))
        out, ref = sharded(x), ddp(x)
        out_errors.append((out - ref).abs().max().item())
        F.mse_loss(out, y).backward()
        F.mse_loss(ref, y).backward()
        opt.step(), ddp_opt.step()
        opt.zero_grad(), ddp_opt.zero_grad()
    shard_numels = [p.numel() for p in sharded.parameters()]
    return sharded.full_state_dict(), ddp.module.state_dict(), out_errors, shard_numels


@pytest.mark.parametrize("world_size, keep_gathered", [(1, None), (2, None), (3, None), (2, ["2.inner"])])
def test_equals_ddp(world_size, keep_gathered):
    """Within a rounding per step; bit for bit on 2 ranks once the layer that ``Scaled`` calls twice
    is gathered once for the whole forward (one reduce-scatter of the summed gradient, as DDP's
    one all-reduce) instead of once per call ((a1 + b1)/2 + (a2 + b2)/2 is not ((a1 + a2) + (b1 + b2))/2)."""
    model = make_model()
    unit_numels = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    unit_numels = [n for n in unit_numels if n]
    for full, ref, out_errors, shard_numels in gc.launch(_vs_ddp, world_size, args=(4, keep_gathered),
                                                         timeout=120):
        assert max(out_errors) < 1e-5
        assert full.keys() == ref.keys()
        for k, v in ref.items():
            if world_size == 1 or keep_gathered:
                assert torch.equal(full[k], v), k
            torch.testing.assert_close(full[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        # each rank stores ceil(1/N) of every layer's parameters, nothing more
        assert shard_numels == [-(-n // world_size) for n in unit_numels]


def _held_between_layers(rank, world_size, width, depth):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded = gc.FullyShardedModule(model)
    shard_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    between = []
    with gc.MemoryTracker(["cpu:0"]) as tracker:
        for layer in model:      # registered after the sharding hooks: runs once the layer is freed
            layer.register_forward_hook(lambda m, a, o: between.append(tracker.live()["cpu:0"]))
        loss = sharded(torch.randn(1, width)).sum()
        forward_peak = tracker.peak()["cpu:0"]
        loss.backward()
        after = tracker.live()["cpu:0"]
        peak = tracker.peak()["cpu:0"]
    return (full_bytes, shard_bytes, between, forward_peak, after, peak,
            [p.grad is not None for p in sharded.parameters()])


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_between_layers(world_size):
    width, depth = 64, 6
    layer_bytes = (width * width + width) * 4
    for full, shards, between, forward_peak, after, peak, has_grad in gc.launch(
            _held_between_layers, world_size, args=(width, depth), timeout=120):
        assert shards <= full / world_size + depth * 4 * world_size
        # between layers only activations (a few rows of width) are alive beyond the shards
        assert max(between) < layer_bytes / 4
        # the forward gathers one layer's full parameters at a time
        assert layer_bytes <= forward_peak < 1.25 * layer_bytes
        # after backward: the shards' gradients (1/N) and nothing gathered left over
        assert shards <= after < shards + layer_bytes / 4
        # backward: the shards' gradients + a few layers' full buffers in flight
        assert peak < shards + 3.5 * layer_bytes
        assert all(has_grad)


def _bad(rank, world_size, case):
    try:
        if case == "shapes":
            gc.FullyShardedModule(nn.Linear(3, 4 + rank))
        elif case == "names":
            layers = [nn.Linear(3, 3)] if rank else [nn.Identity(), nn.Linear(3, 3)]   # names 0.* vs 1.*
            gc.FullyShardedModule(nn.Sequential(*layers))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["shapes", "names"])
def test_different_models_raise_on_every_rank(case):
    msgs = gc.launch(_bad, 2, args=(case,), timeout=60)
    assert all(m is not None and "same on every rank" in m for m in msgs), msgs


def test_bad_modules():
    with pytest.raises(ValueError, match="no parameters"):
        gc.FullyShardedModule(nn.ReLU())
    with pytest.raises(TypeError, match="nn.Module"):
        gc.FullyShardedModule(lambda x: x)


def test_mixed_dtype_parameters_and_bad_param_dtype_are_refused():
    mixed = nn.Linear(3, 3)
    mixed.bias.data = mixed.bias.data.double()
    with pytest.raises(ValueError, match="dtypes"):
        gc.FullyShardedModule(mixed)
    for bad in ("bf16", torch.int8, 16):
        with pytest.raises(TypeError, match="param_dtype"):
            gc.FullyShardedModule(nn.Linear(3, 3), param_dtype=bad)


def _optimizer_before_the_wrap(rank, world_size, before):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1) if before else None
    sharded = gc.FullyShardedModule(model)
    opt = opt or torch.optim.AdamW(sharded.parameters(), lr=0.1)
    start = [p.detach().clone() for p in sharded.parameters()]
    sharded(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return all(not torch.equal(a, p) for a, p in zip(start, sharded.parameters()))


def test_an_optimizer_built_before_the_wrap_is_refused_not_silently_idle():
    """Lesson 08 §11 (issue 38): an optimizer built from the model before gc.FullyShardedModule wrapped
    it trained nothing, silently (loss flat, parameters unchanged). Its step now raises, saying the fix;
    the right order still trains."""
    before = gc.launch(_optimizer_before_the_wrap, 2, args=(True,), timeout=60)
    for message in before:
        assert "built before the model was wrapped" in message and "0.weight" in message, message
        assert "sharded.parameters()" in message, message
    assert gc.launch(_optimizer_before_the_wrap, 2, args=(False,), timeout=60) == [True, True]
