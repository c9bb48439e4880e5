"""DCP: save from 2 FSDP2 ranks, load on 1 (plain model) and on 3 ranks (resharded) — same parameters."""

import pytest
import torch

import gpucourse as gc


def _model():
    torch.manual_seed(0)
    return gc.MLP(6, 13, 5)


def _save(rank, world_size, folder):
    model = gc.fully_shard_model(_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    model(torch.randn(4, 6)).sum().backward()       # each rank a different batch: trained state
    opt.step()
    gc.dcp_save(folder, model, opt)
    return gc.full_model_state(model), [tuple(p.to_local().shape) for p in model.parameters()]


def _load(rank, world_size, folder):
    model = gc.fully_shard_model(gc.MLP(6, 13, 5))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gc.dcp_load(folder, model, opt)
    return gc.full_model_state(model), opt.state_dict()["state"][0]["exp_avg"].to_local().shape[0]


def test_reshard_2_to_1_and_3(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = gc.launch(_save, 2, args=(folder,), timeout=120)
    ref, shapes = saved[0][0], saved[0][1]
    assert shapes[0] == (7, 6) and saved[1][1][0] == (6, 6)              # really sharded
    untrained = _model().state_dict()
    assert not torch.equal(ref["0.weight"], untrained["0.weight"])
    plain = gc.MLP(6, 13, 5)
    gc.dcp_load(folder, plain)
    assert all(torch.equal(plain.state_dict()[k], ref[k]) for k in ref)
    three = gc.launch(_load, 3, args=(folder,), timeout=120)
    for state, rows in three:
        assert all(torch.equal(state[k], ref[k]) for k in ref)
    assert [rows for _, rows in three] == [5, 5, 3]       # Adam state resharded too (torch.chunk)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata"):
        gc.dcp_load(tmp_path, gc.MLP(2, 2))
