"""Resume state: a run interrupted and resumed from a checkpoint equals the uninterrupted run, bit for bit."""

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpucourse as gc

ROOT = Path(__file__).resolve().parents[2]


def _train(steps, folder, stop_at=None, resume=False):
    """Single process: SGD+momentum, loss scaler, resumable sampler, RNG-driven noise."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = gc.LossScaler(init_scale=4.0, growth_interval=2)
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 2))
    sampler = gc.ResumableSampler(data, num_replicas=1, rank=0, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    step = 0
    if resume:
        step = gc.load_training_state(gc.latest_checkpoint(folder), model=model, optimizer=opt,
                                      sampler=sampler, scaler=scaler)
    else:
        sampler.set_epoch(0)
    while step < steps:
        for x, y in loader:
            if step == stop_at:
                return None
            x = x + 0.1 * torch.randn_like(x) + random.random() + float(np.random.rand())
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            sampler.advance(len(x))
            step += 1
            if step % 4 == 0:
                gc.save_training_state(os.path.join(folder, f"step_{step}.pt"), model=model, optimizer=opt,
                                       step=step, sampler=sampler, scaler=scaler)
            if step >= steps:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), scaler.get_scale()


@pytest.mark.parametrize("stop_at", [5, 6, 9])
def test_resume_is_bit_identical(tmp_path, stop_at):
    random.seed(0); np.random.seed(0)
    ref, ref_scale = _train(15, tmp_path / "a")
    random.seed(0); np.random.seed(0)
    assert _train(15, tmp_path / "b", stop_at=stop_at) is None
    random.seed(123); np.random.seed(123); torch.manual_seed(123)     # the restart's own state differs
    resumed, scale = _train(15, tmp_path / "b", resume=True)
    assert torch.equal(ref, resumed) and scale == ref_scale


def test_without_rng_state_resume_differs(tmp_path):
    ref, _ = _train(10, tmp_path / "a")
    _train(10, tmp_path / "b", stop_at=5)
    state = torch.load(gc.latest_checkpoint(tmp_path / "b"), weights_only=True)
    state["rng"] = [gc.rng_states()]                                   # a "forgot the RNG" checkpoint
    torch.manual_seed(99)
    state["rng"] = [gc.rng_states()]
    torch.save(state, tmp_path / "b" / "step_4.pt")
    resumed, _ = _train(10, tmp_path / "b", resume=True)
    assert not torch.equal(ref, resumed)


def test_sampler_and_helpers():
    s = gc.ResumableSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1)
    ref = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1)
    s.set_epoch(2); ref.set_epoch(2)
    assert list(s) == list(ref)
    s.advance(2)
    assert list(s) == list(ref)[2:] and len(s) == 3
    with pytest.raises(ValueError):
        s.load_state_dict({"epoch": 0, "position": 6})
    assert gc.latest_checkpoint("/nonexistent/folder") is None


def _dist_resume(rank, world_size, path):
    torch.manual_seed(rank)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.save_training_state(path, model=model, optimizer=opt, step=7)
    expected = torch.rand(3)                                           # each rank's next draw
    torch.manual_seed(1000)
    step = gc.load_training_state(path, model=model, optimizer=opt)
    return step, torch.equal(torch.rand(3), expected)


def test_every_rank_gets_its_own_rng_back(tmp_path):
    assert gc.launch(_dist_resume, 2, args=(str(tmp_path / "c.pt"),)) == [(7, True), (7, True)]


def _torchrun(folder, *script_args, restarts=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(ROOT / "scripts" / "train_elastic.py"),
           "--checkpoint-dir", str(folder), "--steps", "12", "--checkpoint-every", "4", "--size", "128",
           *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=folder.parent,
                          check=False)


@pytest.mark.slow
def test_train_elastic_crash_and_restart_same_checksum(tmp_path):
    clean = _torchrun(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    crashed = _torchrun(tmp_path / "crashed", "--crash-at-step", "7", restarts=1)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "simulated failure before step 7" in crashed.stderr           # it really crashed once ...
    assert "resumed from step_4.pt: step 4" in crashed.stdout            # ... and resumed
    finals = [[line for line in run.stdout.splitlines() if line.startswith("final loss")]
              for run in (clean, crashed)]
    assert len(finals[0]) == 1 and finals[0] == finals[1]
