"""Checkpoints: rank 0 saves atomically, a crash mid-write never corrupts the previous file."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import gpucourse as gc

# A child process that saves v1, then dies (SIGKILL, no cleanup) in the middle of writing v2: the
# object being pickled kills the process after torch.save has opened the file and written part
# of it. `naive` writes straight to the path with torch.save; otherwise gc.save_checkpoint.
CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    import gpucourse as gc

    class DieWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    path, naive = sys.argv[1], sys.argv[2] == "naive"
    save = torch.save if naive else gc.save_checkpoint
    save({"version": 1, "w": torch.arange(100_000.0)}, path)
    save({"version": 2, "w": torch.zeros(100_000), "z": DieWhilePickled()}, path)
""")


def _crash(tmp_path, mode):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(path), mode],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return path


def test_killed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = _crash(tmp_path, "atomic")
    state = gc.load_checkpoint(path, map_location="cpu")
    assert state["version"] == 1
    torch.testing.assert_close(state["w"], torch.arange(100_000.0))


def test_the_same_crash_corrupts_a_plain_torch_save(tmp_path):
    """The control experiment: without temp file + rename the old checkpoint is lost."""
    path = _crash(tmp_path, "naive")
    with pytest.raises(Exception):  # noqa: B017 - truncated zip: RuntimeError/EOFError/… by version
        torch.load(path, map_location="cpu", weights_only=True)


def _save_then_load(rank, world_size, path):
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(rank))          # ranks differ: rank 0's must win
    gc.save_checkpoint({"model": model.state_dict()}, path)
    mtime = os.stat(path).st_mtime_ns                             # exists on every rank already
    state = gc.load_checkpoint(path)
    return state["model"]["weight"], state["model"]["weight"].device.type, mtime


def test_rank0_saves_every_rank_loads_after_the_barrier(tmp_path):
    path = str(tmp_path / "sub" / "ckpt.pt")                      # folder created on demand
    results = gc.launch(_save_then_load, 3, args=(path,), timeout=60)
    for weight, device, _ in results:
        assert torch.equal(weight, torch.zeros(2, 3)) and device == "cpu"
    assert len({m for _, _, m in results}) == 1                   # one write, seen by all
    assert os.listdir(tmp_path / "sub") == ["ckpt.pt"]           # no temporary file left behind


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "obj": _Arbitrary()}, path)
    with pytest.raises(Exception, match="(?i)weights.only|unsupported|global"):
        gc.load_checkpoint(path, map_location="cpu")
    assert isinstance(gc.load_checkpoint(path, map_location="cpu", weights_only=False)["obj"],
                      _Arbitrary)


class _Arbitrary:
    pass


def test_map_location_moves_tensors(tmp_path):
    path = tmp_path / "m.pt"
    gc.save_checkpoint({"w": torch.ones(2, dtype=torch.float64)}, path)
    assert gc.load_checkpoint(path, map_location=torch.device("meta"))["w"].device.type == "meta"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*barrier"):
        gc.load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="is a directory"):
        gc.save_checkpoint({}, tmp_path)
    with pytest.raises(TypeError, match="path must be"):
        gc.save_checkpoint({}, 3)


def _save_only_on_rank0(rank, world_size, path):
    if rank == 0:
        gc.save_checkpoint({"x": 1}, path)                        # the collective mismatch trap


def test_saving_inside_if_rank_0_hangs_until_the_timeout(tmp_path):
    with pytest.raises(TimeoutError, match="in save_checkpoint"):
        gc.launch(_save_only_on_rank0, 2, args=(str(tmp_path / "c.pt"),), timeout=3)


def _save_fails_on_rank0(rank, world_size, path):
    try:
        gc.save_checkpoint({"not a tensor": lambda: 0}, path)     # torch.save cannot pickle a lambda
    except Exception as exc:  # noqa: BLE001 -- rank 0 and the others raise different types
        return type(exc).__name__, str(exc)
    return None


def test_a_failed_save_on_rank_0_reaches_every_rank_at_once(tmp_path):
    path = str(tmp_path / "c.pt")
    # well within the launch timeout: the others learn of the failure, not from the group's timeout
    results = gc.launch(_save_fails_on_rank0, 3, args=(path,), timeout=30)
    assert results[0] is not None and "lambda" in results[0][1]     # rank 0: torch.save's own error
    for name, message in results[1:]:
        assert name == "RuntimeError" and "rank 0 failed to save the checkpoint" in message
    assert not os.path.exists(path) and os.listdir(tmp_path) == []  # no half-written file left


def test_an_empty_path_is_rejected_before_anything_is_written(tmp_path, monkeypatch):
    import gpucourse.distributed.checkpoint as checkpoint

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    made = []
    real_mkstemp = checkpoint.tempfile.mkstemp
    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", lambda **kw: made.append(kw) or real_mkstemp(**kw))
    for path in ("", "sub/"):
        with pytest.raises(ValueError, match="path must name a file"):
            gc.save_checkpoint({"w": torch.ones(1)}, path)
    assert made == [] and sorted(p.name for p in tmp_path.rglob("*")) == ["work"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_file_mode_follows_the_umask_like_torch_save(tmp_path, umask):
    old = os.umask(umask)
    try:
        gc.save_checkpoint({"w": torch.ones(1)}, tmp_path / "ours.pt")
        torch.save({"w": torch.ones(1)}, tmp_path / "torch.pt")
    finally:
        os.umask(old)
    mode = lambda p: (tmp_path / p).stat().st_mode & 0o777  # noqa: E731
    assert mode("ours.pt") == mode("torch.pt") == 0o666 & ~umask


def test_every_torch_load_in_the_repository_is_weights_only():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    call = re.compile(r"torch\.load\(")
    bad = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] in (".git", ".venv", "data") or path.suffix not in (".py", ".ipynb"):
            continue
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":   # code cells only: prose may name torch.load
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"]
                             if c["cell_type"] == "code")
        for m in call.finditer(text):
            depth, end = 0, m.end() - 1                       # the call's closing parenthesis
            for end in range(m.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            if "weights_only" not in text[m.start():end]:
                bad.append(f"{rel}: {text[m.start():end + 1]}")
    assert bad == [], bad
