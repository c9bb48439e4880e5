"""The bwrap sandbox hides /tmp, /dev/shm and /run behind private tmpfs mounts; a course checkout or
a virtual environment that lives there must be bound back (read-only), or the kernel cannot start.
(A CI clone in /tmp failed every sandboxed grade with "bwrap: execvp …/.venv/bin/python".)"""

import sys
from pathlib import Path

from gpucourse.grading import sandbox


def _ro_binds(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind" and argv[i + 1] != "/"]


def test_environment_under_tmp_is_bound_back_read_only(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(venv))
    argv = sandbox._bwrap_argv(tmp_path / "work", [])
    assert str(venv.resolve()) in _ro_binds(argv)
    # bound after the private /tmp is mounted, or the tmpfs would cover it again
    assert argv.index("--tmpfs") < argv.index(str(venv.resolve())) - 1


def test_nothing_extra_is_bound_when_the_environment_is_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/usr")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(sandbox, "_GRADING_DIR", Path("/opt/course/gpucourse/grading"))
    assert _ro_binds(sandbox._bwrap_argv(Path("/tmp/work"), [])) == []
