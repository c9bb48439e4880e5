"""Emulated nodes: torchrun / srun / OpenPAI launches, failures, hangs and cleanup."""

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpucourse as gc
from _processes import wait_gone

ROOT = Path(__file__).resolve().parents[2]
WHOAMI = str(ROOT / "scripts" / "whoami_allreduce.py")
LINE = re.compile(r"rank\s+(\d+) = node (\d) x (\d) \+ local (\d)\s+of world_size (\d+)\s+"
                  r"\((\w+), master ([\d.]+)\)\s+all_reduce: (\d+) ✓")


def _parse(results):
    """{global rank: (node, nproc, local, world, source, reduced)} from the script's lines."""
    seen = {}
    for res in results:
        for rank, lines in res.by_rank().items():
            for line in lines:
                m = LINE.search(line)
                if m:
                    r, node, nproc, local, world, source, _, total = m.groups()
                    assert int(r) == rank, line
                    seen[rank] = (int(node), int(nproc), int(local), int(world), source, int(total))
                    assert int(node) == res.node_rank
    return seen


# OpenPAI's processes are started by mp.spawn (a fresh interpreter each): 1 per node keeps it quick
@pytest.mark.parametrize("launcher, nproc, args", [("torchrun", 2, ()), ("srun", 2, ()),
                                                   ("openpai", 1, ("--spawn", "1"))])
def test_same_script_under_three_launchers(launcher, nproc, args, capsys):
    results = gc.launch_nodes(WHOAMI, nnodes=2, nproc_per_node=nproc, launcher=launcher,
                              script_args=args, timeout=120)
    assert [r.returncode for r in results] == [0, 0]
    seen = _parse(results)
    world = 2 * nproc
    expected = {rank: (node, nproc, local, world, launcher if launcher != "srun" else "slurm",
                       world * (world + 1) // 2)
                for rank, node, local in gc.rank_layout(2, nproc)}
    assert seen == expected
    out = capsys.readouterr().out
    assert out.index("── node 0") < out.index(f"[rank {nproc - 1}]") < out.index("── node 1")


def test_torchrun_commands_differ_only_in_node_rank():
    cmds = [gc.torchrun_command("train.py", nnodes=3, node_rank=i, nproc_per_node=4,
                                master_addr="10.0.0.1", master_port=29500) for i in range(3)]
    diffs = {tuple(sorted(set(a) ^ set(b))) for a in cmds for b in cmds if a != b}
    assert all(all(d.startswith("--node_rank=") for d in diff) for diff in diffs)
    with pytest.raises(ValueError, match="node_rank must be an int in"):
        gc.torchrun_command("t.py", nnodes=2, node_rank=2, nproc_per_node=1, master_addr="h",
                            master_port=1)


def _script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_failing_node_stops_the_job_and_shows_its_traceback(tmp_path):
    script = _script(tmp_path, """
        import os, time
        if os.environ["SLURM_NODEID"] == "1":
            raise ValueError("bad data on node 1")
        time.sleep(60)
    """)
    start = time.monotonic()
    with pytest.raises(gc.NodeError, match="ValueError: bad data on node 1") as err:
        gc.launch_nodes(script, 2, 1, launcher="srun", timeout=60, echo=False)
    assert err.value.node_rank == 1
    assert time.monotonic() - start < 30           # node 0 was stopped, not waited for
    assert err.value.results[0].returncode is None


def test_a_rank_that_exits_with_a_usage_error_is_shown_not_torchruns_report(tmp_path):
    # seen on a GPU machine: both ranks exited with code 2 and the error showed only torchrun's
    # ChildFailedError, because an argparse error has no "Traceback" and a lowercase "error:"
    script = _script(tmp_path, """
        import argparse
        argparse.ArgumentParser(prog="train.py").parse_args(["--epochz", "2"])
    """)
    with pytest.raises(gc.NodeError) as err:
        gc.launch_nodes(script, 2, 1, launcher="torchrun", timeout=60, echo=False)
    assert "train.py: error: unrecognized arguments: --epochz 2" in str(err.value)


@pytest.mark.parametrize("count, visible, nnodes, nproc, want", [
    (0, None, 2, 1, [{}, {}]),                                           # no GPU: nothing to split
    (4, None, 2, 2, [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]),
    (4, "3,1,0,2", 2, 1, [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "1"}]),
    (1, None, 2, 1, [{"CUDA_VISIBLE_DEVICES": ""}] * 2),                 # the lent H200: none each
    (3, None, 2, 2, [{"CUDA_VISIBLE_DEVICES": ""}] * 2)])
def test_emulated_machines_get_gpus_of_their_own_or_none(monkeypatch, capsys, count, visible, nnodes,
                                                          nproc, want):
    import torch

    from gpucourse.cluster import nodes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert nodes._gpus_per_node(nnodes, nproc, None, None) == want
    said = capsys.readouterr().out
    assert ("no machine gets a GPU" in said) == (want[0] == {"CUDA_VISIBLE_DEVICES": ""})
    # the caller's own choice wins
    assert nodes._gpus_per_node(nnodes, nproc, {"CUDA_VISIBLE_DEVICES": "0"}, None) == [{}] * nnodes


def test_a_hanging_job_times_out_and_leaves_no_process(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = _script(tmp_path, f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        time.sleep(600)
    """)
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        gc.launch_nodes(script, 2, 1, launcher="srun", timeout=3, echo=False)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2
    assert not wait_gone(started)


def test_check_false_returns_results_and_environment_is_clean(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        print(os.environ.get("GREETING"), os.environ.get("NODE_NAME"), os.environ["SLURM_PROCID"])
        sys.exit(3 if os.environ["SLURM_PROCID"] == "1" else 0)
    """)
    res = gc.launch_nodes(script, 2, 1, launcher="srun", env={"GREETING": "hi"},
                          node_env=[{"NODE_NAME": "a"}, {"NODE_NAME": "b"}], check=False,
                          echo=False)
    assert [r.returncode for r in res] == [0, 3]
    assert res[0].by_rank() == {0: ["hi a 0"]} and res[1].by_rank() == {1: ["hi b 1"]}


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(nnodes=0), ValueError, "nnodes must be >= 1"),
    (dict(nproc_per_node=1.5), TypeError, "nproc_per_node must be an int"),
    (dict(launcher="mpirun"), ValueError, "launcher must be one of"),
    (dict(timeout=0), ValueError, "timeout"),
    (dict(node_env=[{}]), ValueError, "one entry per node"),
    (dict(master_port=70000), ValueError, "master_port"),
    (dict(script="no/such/script.py"), FileNotFoundError, "does not exist"),
])
def test_bad_arguments(kwargs, exc, msg):
    args = dict(script=WHOAMI, nnodes=2, nproc_per_node=1)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        gc.launch_nodes(**args)


def test_python_of_this_environment_is_used():
    cmd = gc.torchrun_command("t.py", nnodes=1, node_rank=0, nproc_per_node=1, master_addr="h",
                              master_port=1)
    assert cmd[0] == sys.executable


def test_echo_labels_relayed_lines_and_silent_nodes(capsys):
    from gpucourse.cluster.nodes import NodeResult, _echo, _group_lines
    node0 = NodeResult(0, [["torchrun"]], 0,
                       "[rank 0] hello\n[rank 0] [rank 0] mine\n[rank 0] [rank 1] relayed\n")
    node1 = NodeResult(1, [["torchrun"]], 0, "")
    for r in (node0, node1):
        r.lines = _group_lines(r.stdout, None)
    _echo([node0, node1])
    out = capsys.readouterr().out.splitlines()
    assert out == ["── node 0 (ok)", "   [rank 0] hello", "   [rank 0] mine",
                   "   [rank 1, printed by rank 0] relayed", "── node 1 (ok)",
                   "   (no output of its own: its ranks printed nothing, or only through rank 0)"]
