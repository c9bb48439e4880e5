"""scripts/train_ddp.py runs under torchrun (2 gloo processes), checkpoints on rank 0 and resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_ddp.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _torchrun(*args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), "--size", "256", "--batch-size", "32", "--no-augment", "--time-limit", "120",
           *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, f"torchrun exited {run.returncode}:\n{run.stdout}\n{run.stderr[-4000:]}"
    return run


def test_torchrun_two_processes_checkpoint_and_resume(tmp_path):
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "log.json"
    run = _torchrun("--epochs", "1", "--checkpoint", str(ckpt), "--log-json", str(log))
    assert "world_size=2 backend=gloo" in run.stdout
    assert "[rank 0] local_rank 0" in run.stdout and "[rank 1] local_rank 1" in run.stdout
    result = json.loads(log.read_text())
    assert result["world_size"] == 2 and result["steps"] == 4          # 256 / 2 ranks / 32
    assert all(loss > 0 for loss in result["losses"]) and 0 <= result["test_accuracy"] <= 1
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["epoch"] == 0 and "conv1.weight" in state["model"]    # unwrapped: no "module."
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []

    # resume without torchrun, in a world of one process: the checkpoint does not depend on it
    resumed = _python("--epochs", "2", "--checkpoint", str(ckpt), "--resume", "--log-json", str(log))
    assert "resumed from" in resumed.stdout and "epoch 2/2" in resumed.stdout
    assert "epoch 1/2" not in resumed.stdout
    assert json.loads(log.read_text())["steps"] == 8                  # 256 / 1 rank / 32
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"] == 1


def _python(*args):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(SCRIPT), "--size", "256", "--no-augment", *args],
                          capture_output=True, text=True, timeout=300, env=env, check=True)


def test_plain_python_is_a_world_of_one_and_the_time_limit_stops_it(tmp_path):
    log = tmp_path / "log.json"
    run = _python("--epochs", "200", "--time-limit", "0.5", "--log-json", str(log))
    result = json.loads(log.read_text())
    assert result["world_size"] == 1 and result["stopped_early"]
    assert result["steps"] < 200 * 8                                  # stopped long before the end
    assert "time limit of 0.5 s reached" in run.stdout
