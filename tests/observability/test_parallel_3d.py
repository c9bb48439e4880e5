"""The 3-D capstone: TinyGPT on a (pp, dp, tp) mesh trains exactly like one process.

The oracle is ``gc.train_reference_3d`` (the whole model, the whole batch, one process) and
PyTorch's own ``DeviceMesh`` coordinates. One 8-process run (2 x 2 x 2, all three axes) is shared
by the module; smaller meshes cover bf16 over a tensor-parallel all-reduce, the script and torchrun.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpucourse as gc

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_3d.py"
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
       "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
CFG = dict(vocab_size=27, seq_len=8, num_layers=2, hidden=16, num_heads=2)
STEPS = 5


@pytest.fixture(scope="module")
def cube():
    """2 x 2 x 2: 8 processes, 5 steps, fp32, batch 8 (4 rows per pipeline, 2 micro-batches)."""
    return gc.run_3d(CFG, dp=2, tp=2, pp=2, steps=STEPS, batch_size=8, chunks=2, lr=1e-2, seed=3)


def test_cube_losses_match_one_process(cube):
    ref = gc.train_reference_3d(CFG, steps=STEPS, batch_size=8, lr=1e-2, seed=3)["losses"]
    for r in cube:
        assert r["losses"] == cube[0]["losses"]                   # every rank reports the same curve
    diffs = [abs(a - b) for a, b in zip(cube[0]["losses"], ref)]
    assert max(diffs) < 1e-4, (cube[0]["losses"], ref)
    assert ref[-1] < ref[0] - 0.05                                # and the model did learn something


def test_cube_coordinates_are_device_mesh_coordinates(cube):
    want = gc.mesh_coordinates((2, 2, 2), gc.MESH_DIMS)
    assert [tuple(r["coords"][n] for n in gc.MESH_DIMS) for r in cube] == want
    assert want[5] == (1, 0, 1)                                   # rank = (pp * dp + dp_rank) * tp + tp_rank


def test_cube_memory_and_bytes_per_axis(cube):
    ref_params = gc.TinyGPT(**CFG).num_parameters()
    for r in cube:
        n = r["num_params"]
        assert r["memory"]["params"] == r["memory"]["grads"] == 4 * n
        # ZeRO-1 over dp = 2: AdamW's two moments of half the stage (padded to an even split)
        assert r["memory"]["optimizer"] == 2 * 4 * math.ceil(n / 2)
        assert r["bytes"]["dp"] == 2 * 4 * 2 * math.ceil(n / 2)    # reduce-scatter in + all-gather out
        assert r["bytes"]["tp"] > 0 and r["bytes"]["pp"] > 0 and r["bytes"]["embedding"] > 0
    # the four (pp, tp) pieces of one pipeline hold the model once, plus what is replicated or tied
    pieces = sum(r["num_params"] for r in cube if r["coords"]["dp"] == 0)
    assert ref_params < pieces < 1.5 * ref_params
    # pipeline: each of 2 micro-batches sends one (b, T, C) fp32 activation (or gradient back)
    assert cube[0]["bytes"]["pp"] == 4 * (8 // 2) * CFG["seq_len"] * CFG["hidden"]


def test_bf16_tensor_parallel_matches_one_process_bf16():
    """pp = 1 (one stage is first and last), dp = 1, tp = 2: bf16 partial sums all-reduced."""
    out = gc.run_3d(CFG, dp=1, tp=2, pp=1, steps=4, batch_size=4, chunks=1, seed=1, bf16=True)
    ref = gc.train_reference_3d(CFG, steps=4, batch_size=4, seed=1, bf16=True)["losses"]
    fp32 = gc.train_reference_3d(CFG, steps=4, batch_size=4, seed=1)["losses"]
    assert out[0]["bf16"] and out[0]["bytes"]["pp"] == 0 and out[0]["bytes"]["dp"] == 0
    assert max(abs(a - b) for a, b in zip(out[0]["losses"], ref)) < 2e-2
    assert out[0]["losses"] != fp32                                # autocast really ran


@pytest.mark.parametrize("kwargs, msg", [
    (dict(pp=4), "pp=4 stages need num_layers >= 4"),
    (dict(tp=3), "tp=3 needs num_heads >= 3"),
    (dict(dp=3), "must be a multiple of dp"),
    (dict(chunks=5), "fewer than chunks=5"),
    (dict(vocab_size=20), r"vocab_size'\] = 20 is smaller than the text's 27 characters"),
])
def test_bad_meshes_fail_in_the_parent(kwargs, msg):
    args = dict(dp=2, tp=2, pp=2, steps=1, batch_size=8, chunks=2)
    cfg = {**CFG, "vocab_size": kwargs.pop("vocab_size", CFG["vocab_size"])}
    with pytest.raises(ValueError, match=msg):
        gc.run_3d(cfg, **{**args, **kwargs})


def _script_main(monkeypatch):
    import runpy

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return runpy.run_path(str(SCRIPT))["main"]


SMALL = ["--steps", "3", "--batch-size", "4", "--hidden", "16", "--seq-len", "8", "--precision", "fp32"]


def test_script_local_launch_compare_and_json(tmp_path, monkeypatch, capsys):
    """--nprocs: the script's main in this process (gc.launch forks the ranks), as from a shell."""
    status = _script_main(monkeypatch)(SMALL + ["--nprocs", "2", "--dp", "2", "--tp", "1", "--pp", "1",
                                                "--compare", "--json", str(tmp_path / "m.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 0, lines
    assert [line.split()[:2] for line in lines[:3]] == [["step", "0"], ["step", "1"], ["step", "2"]]
    assert lines[-1].startswith("final loss ") and "(1, 2, 1)" in lines[-1] and "fp32" in lines[-1]
    assert lines[-1].endswith("match")
    saved = json.loads((tmp_path / "m.json").read_text())
    assert len(saved["ranks"]) == 2 and len(saved["reference"]["losses"]) == 3


def test_script_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           *SMALL, "--dp", "1", "--tp", "1", "--pp", "2", "--compare"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=ENV)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("step   0") and lines[-1].endswith("match") and "(2, 1, 1)" in lines[-1]


def test_script_refuses_a_wrong_world_size(monkeypatch):
    with pytest.raises(SystemExit, match="--nprocs 3 must equal --pp x --dp x --tp = 2"):
        _script_main(monkeypatch)(["--nprocs", "3", "--dp", "2", "--tp", "1", "--pp", "1"])
