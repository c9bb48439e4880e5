"""What a sandboxed kernel sees of the machine: the system folders, Python, its environment and the
``gpucourse`` package — read-only — and its own work copy. Not the course around the package (its
``solutions/``, its ``.git``), not another checkout of the course, not /home or /work. A venv or a CI
clone under /tmp (a private tmpfs in the sandbox) is bound back after the tmpfs, or the kernel could
not start ("bwrap: execvp …/.venv/bin/python")."""

import subprocess
import sys
from pathlib import Path

import pytest

from gpucourse.grading import sandbox


def _ro_binds(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]


def test_environment_under_tmp_is_bound_back_read_only(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(venv))
    argv = sandbox._bwrap_argv(tmp_path / "work", [])
    assert str(venv.resolve()) in _ro_binds(argv)
    # bound after the private /tmp is mounted, or the tmpfs would cover it again
    assert argv.index("/tmp") < argv.index(str(venv.resolve()))


def test_only_the_package_of_the_course_is_visible(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/usr")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(sandbox, "_GRADING_DIR", Path(sandbox._GRADING_DIR))
    binds = _ro_binds(sandbox._bwrap_argv(Path("/tmp/work"), []))
    package = str(Path(sandbox._GRADING_DIR).parent)
    assert package in binds and "/" not in binds
    assert not any(b == str(Path(package).parent) for b in binds)        # not the course root


@pytest.mark.skipif(sandbox.isolation() != "bwrap", reason="needs bwrap (Debian package bubblewrap)")
def test_a_sandboxed_process_cannot_see_the_solutions_or_git(tmp_path):
    course = Path(sandbox._GRADING_DIR).parents[1]
    work = tmp_path / "work"
    work.mkdir()
    probe = ("import os, sys; paths = sys.argv[1:]; "
             "print([os.path.exists(p) for p in paths]); import gpucourse; print('package ok'); "
             "print(sorted(os.listdir(paths[0].rsplit('/', 1)[0])))")
    argv = sandbox._bwrap_argv(work, []) + [sys.executable, "-c", probe, str(course / "solutions"),
                                            str(course / ".git"), str(course / "README.md"), "/home"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(course)})
    assert r.returncode == 0, r.stderr
    seen, ok, listing = r.stdout.splitlines()
    assert (seen, ok) == ("[False, False, False, False]", "package ok")
    assert set(eval(listing)) <= {"gpucourse", ".venv"}, listing     # the course root: the package, at most a venv
