"""scripts/train_amp_ddp.py runs under torchrun (2 CPU processes, gloo) in bf16 and fp16."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("amp, scaling", [("bf16", "loss scaling off"), ("fp16", "loss scaling on")])
def test_torchrun_two_processes(amp, scaling, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "scripts" / "train_amp_ddp.py"), "--amp", amp, "--size", "200", "--batch-size", "25",
           "--max-steps", "3", "--data", str(tmp_path)]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"2 process(es) on cpu, autocast {amp}, {scaling}, global batch 50" in out.stdout
    assert "Training complete" in out.stdout and "3 steps" in out.stdout
    assert out.stdout.count("Training complete") == 1            # printed by rank 0 only
