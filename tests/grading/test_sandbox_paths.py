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


@pytest.mark.skipif(sandbox.isolation() != "bwrap", reason="needs bwrap (Debian package bubblewrap)")
def test_a_course_under_tmp_is_reachable_by_the_sandboxs_user(tmp_path, monkeypatch):
    """A CI clone under /tmp: the folders above the package are made inside the sandbox's fresh /tmp
    passable by the unprivileged user (bwrap would make them root-only), so the kernel imports it."""
    import os
    import shutil

    course = Path("/tmp") / tmp_path.name / "clone"       # under /tmp whatever TMPDIR is
    try:
        shutil.copytree(Path(sandbox._GRADING_DIR).parent, course / "gpucourse",
                        ignore=shutil.ignore_patterns("__pycache__"))
        monkeypatch.setattr(sandbox, "_GRADING_DIR", course / "gpucourse" / "grading")
        work = tmp_path / "work"
        work.mkdir()
        code = (sandbox._BOOT.replace("shepherd_main; shepherd_main()", "drop_privileges; drop_privileges()")
                + "; sys.path.insert(0, sys.argv[2]); import gpucourse.grading.engine as e; print(e.__file__)")
        argv = sandbox._bwrap_argv(work, []) + [sys.executable, "-c", code, str(sandbox._GRADING_DIR), str(course)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, **sandbox._drop_env()))
        assert r.returncode == 0 and r.stdout.strip() == str(course / "gpucourse" / "grading" / "engine.py"), r.stderr
    finally:
        shutil.rmtree(Path("/tmp") / tmp_path.name, ignore_errors=True)


def test_dev_shm_dev_and_run_are_read_only_also_for_a_grader_run_by_an_ordinary_user(tmp_path, monkeypatch):
    """A bwrap started by an ordinary user makes /dev (with /dev/shm) and /run tmpfs that this user
    owns inside, without a size limit: a notebook could keep memory there that no process shows,
    past the notebook's memory total. They are read-only now, as under a root-started grader (where
    they are root's). Runs the sandbox's own bwrap arguments as user 65534 with a shell."""
    import json
    import shutil
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        pytest.skip("needs bwrap and setpriv")
    work = tmp_path / "work"
    work.mkdir()
    tmp_path.chmod(0o755)
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 65534)          # the ordinary user's arguments
    argv = sandbox._bwrap_argv(work, [])
    monkeypatch.undo()
    keep, i = [], 0
    while i < len(argv) - 1:                # without binds user 65534 may not read (a venv under /root)
        if argv[i] == "--ro-bind" and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534",
                                                      "--clear-groups", "test", "-r", argv[i + 1]]).returncode:
            i += 3
            continue
        keep.append(argv[i])
        i += 1
    script = ("for d in /dev/shm /run /dev /tmp; do (: > $d/probe) 2>/dev/null && echo $d; done; "
              "echo x > /dev/null && echo devnull")
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *keep, "--",
                          "/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
    if run.returncode != 0 and "namespace" in run.stderr:
        pytest.skip(f"this machine gives an ordinary user no namespaces: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    writable = run.stdout.split()
    assert writable == ["/tmp", "devnull"], json.dumps(writable)
