"""Chapter 08's training on a GPU: NCCL, the model and the batch on ``cuda:<rank>``.

One GPU can hold one NCCL rank (NCCL refuses two ranks on one device), so the NCCL runs here use a
world of one: every strategy's step, its collectives and its memory reading run on CUDA, compared
with the same run over gloo on the CPU. More ranks than GPUs fall back to gloo, saying so.
"""

import pytest
import torch
from torch import nn

import gpucourse as gc
import gpucourse.runtime.devices as devices_mod

pytestmark = pytest.mark.cuda


def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("strategy", gc.STRATEGIES)
def test_every_strategy_trains_on_cuda_as_on_the_cpu(strategy):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    on_gpu = gc.train_sharded(strategy, make_model, x, y, world_size=1, steps=3, lr=1e-2,
                              measure_memory=True, backend="nccl", timeout=180)
    on_cpu = gc.train_sharded(strategy, make_model, x, y, world_size=1, steps=3, lr=1e-2,
                              measure_memory=True, backend="gloo", timeout=180)
    assert set(on_gpu.state_dict) == set(on_cpu.state_dict)
    for k, v in on_cpu.state_dict.items():
        assert on_gpu.state_dict[k].device.type == "cpu"          # handed back as CPU tensors
        torch.testing.assert_close(on_gpu.state_dict[k], v, rtol=1e-4, atol=1e-5)
    assert on_gpu.losses == pytest.approx(on_cpu.losses, rel=1e-4, abs=1e-6)
    assert on_gpu.memory[0].parameters == on_cpu.memory[0].parameters   # the CUDA allocator's count


def test_more_ranks_than_gpus_fall_back_to_gloo_and_say_so(capsys, monkeypatch):
    monkeypatch.setattr(devices_mod, "_SAID", set())
    n = torch.cuda.device_count() + 1
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 4, generator=g)
    run = gc.train_sharded("zero2", make_model, x, y, world_size=n, steps=2, lr=1e-2, timeout=180)
    said = capsys.readouterr().out
    assert f"gc.default_backend({n}): {n} ranks but {n - 1} CUDA GPU(s)" in said
    ref = gc.train_sharded("zero2", make_model, x, y, world_size=n, steps=2, lr=1e-2, backend="gloo",
                           timeout=180)
    assert run.losses == ref.losses


def test_fully_shard_model_puts_its_mesh_on_the_groups_device():
    def shard(rank, world_size):
        model = gc.fully_shard_model(make_model().to(gc.rank_device()))
        w = next(model.parameters())
        return w.device_mesh.device_type, w.to_local().device.type

    assert gc.launch(shard, 1, backend="nccl", timeout=120) == [("cuda", "cuda")]
    assert gc.launch(shard, 1, backend="gloo", timeout=120) == [("cpu", "cpu")]
