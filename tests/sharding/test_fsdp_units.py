"""FullyShardedModule(units=...): FSDP's wrapping — a whole block shards as one unit, so a step runs
3 collectives per unit instead of 3 per layer, and still trains exactly like DDP / one process."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpucourse as gc
from gpucourse.sharding import collectives

CFG = {"vocab_size": 16, "seq_len": 8, "num_layers": 2, "hidden": 8, "num_heads": 2}
UNITS = ["", "blocks.0", "blocks.1"]          # the root unit (embeddings, final norm) and each block


def make_gpt():
    torch.manual_seed(0)
    return gc.TinyGPT(**CFG)


def _data(step):
    g = torch.Generator().manual_seed(40 + step)
    return (torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"]), generator=g),
            torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"]), generator=g))


def _train(rank, world_size, units, steps=3):
    calls = collections.Counter()
    ring_phase = collectives._ring_phase

    def counting(buf, group, phase):
        calls[phase] += 1
        return ring_phase(buf, group, phase)

    collectives._ring_phase = counting
    try:
        model = gc.FullyShardedModule(make_gpt(), units=units)
        n_shards = len(model.shards)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ddp = DDP(make_gpt())
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        calls.clear()                                     # count the training steps only
        for step in range(steps):
            x, y = (t.tensor_split(world_size)[rank] for t in _data(step))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            ref = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            ref.backward()
            opt.step(), ddp_opt.step()
            opt.zero_grad(), ddp_opt.zero_grad()
        per_step = {k: v / steps for k, v in calls.items()}
        return model.full_state_dict(), ddp.module.state_dict(), n_shards, per_step
    finally:
        collectives._ring_phase = ring_phase


@pytest.mark.parametrize("units", [UNITS, ["blocks.0", "blocks.1"]])
def test_block_units_train_like_ddp(units):
    for full, ref, _, _ in gc.launch(_train, 2, args=(units,), timeout=120):
        assert full.keys() == ref.keys()
        for k, v in ref.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_a_unit_costs_three_collectives_per_step():
    """Per step: every unit all-gathers for the forward, all-gathers again for the backward and
    reduce-scatters its gradient. Wrapping blocks: 3 units → 9; one unit per layer: many more."""
    (_, _, blocks, by_block), = gc.launch(_train, 2, args=(UNITS,), timeout=120)[:1]
    (_, _, layers, by_layer), = gc.launch(_train, 2, args=(None,), timeout=120)[:1]
    assert blocks == 3
    assert by_block == {"all-gather": 2 * 3, "reduce-scatter": 3}
    n_layers = sum(1 for m in make_gpt().modules() if any(True for _ in m.parameters(recurse=False)))
    assert layers == n_layers > 3 * blocks
    assert by_layer["reduce-scatter"] == n_layers
    assert by_layer["all-gather"] > by_block["all-gather"]


def test_units_are_checked():
    with pytest.raises(TypeError, match="units must be a list"):
        gc.FullyShardedModule(make_gpt(), units="blocks.0")
    with pytest.raises(ValueError, match=r"units: \['blocks.7'\] are not modules of TinyGPT"):
        gc.FullyShardedModule(make_gpt(), units=["blocks.7"])
    with pytest.raises(ValueError, match="listed more than once"):
        gc.FullyShardedModule(make_gpt(), units=["blocks.0", "blocks.0"])
    with pytest.raises(ValueError, match=r"\['blocks'\] hold no parameters"):
        gc.FullyShardedModule(make_gpt(), units=["blocks", "blocks.0", "blocks.1"])
    with pytest.raises(ValueError, match="keep_gathered"):
        gc.FullyShardedModule(make_gpt(), units=UNITS, keep_gathered=["tok_emb"])   # inside the root unit


def _inspect(rank, world_size):
    model = gc.FullyShardedModule(make_gpt(), units=UNITS)
    net = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    gc.FullyShardedModule(net, units=["1"])
    return ([u.path for u in model._outer], sorted(n for u in model._units for n in u.names),
            [net[1][0].weight, net[1][1].bias, net[0].weight])


def test_default_keeps_the_unit_holding_the_embedding_gathered():
    outer, names, left = gc.launch(_inspect, 1)[0]
    assert outer == [""]                      # the root unit holds tok_emb, which the tied head reads
    full = [n for n, _ in make_gpt().named_parameters()]                  # blocks.0.attn.q.weight, ...
    assert names == sorted(n.split(".", 2)[2] if n.startswith("blocks.") else n for n in full)
    assert left == [None, None, None]         # inside a unit or not: no module keeps its parameters
